"""Loops in generated tokens: what this app calls a loop, in one place. The Repetition page, the doctor's `loops`
(CLI and JSON), the why-loop's judgement of every rerun, trace files and the report all use `find_loops`.

A loop is a degenerate repeat: the same tokens again and again, **to the end of the run**. Ordinary text repeats
short patterns all the time without being stuck -- a clock time ("12:12:53": `12:` twice), a date, a list, a
phrase said twice -- so neither a pattern seen twice nor one the text moves on from is a loop.

Definition (what `find_loops` reports). Let t[0..n) be the generated token ids (indices are generation
steps: index i is the token chosen at step i, at absolute position n_prompt + i).

* A span t[s:e] has period p when t[i] == t[i + p] for every s <= i < e - p.
* A *loop* is a span with period p that cannot be extended (t[s-1] != t[s-1+p]) and **runs through the last
  generated token** (e == n), holds at least `min_count` full periods ((e - s) // p >= min_count; MIN_COUNT = 3:
  the pattern, then two more copies of it) and covers at least `min_tokens` tokens (MIN_TOKENS = 12). p is the
  smallest period of the span: a span of period p lying inside a loop of a smaller period q is not reported
  again (by Fine and Wilf it is periodic in gcd(p, q)).
* Loop(start=s, period=p, count=(e - s) // p, end=e): `count` full periods, then (e - s) % p tokens
  of a last, partial one.

A run shorter than MIN_TOKENS generated tokens has no loop; a repeat the run leaves before its end is not a
loop (`periodic_runs` still lists every periodic span, loop or not). `tail_loop` is the loop the generation is
stuck in: the one with the earliest start, then the smallest period; None when there is none.

A *repeat heading into a loop* (`heading_into_loop`) is the same test with HEADING_COUNT = 2 full periods: a
periodic tail of two copies or more, still MIN_TOKENS tokens or more, that a run cut off by its length may have
been about to make a loop of. It is not a loop (the Repetition page and the doctor's `loops` never list one); the
why-loop uses it only to judge a rerun's last tokens (engine.tools.loop_verdict).

Examples: greedy SmolLM2-135M on the raw prompt "I like apples. I like apples. I like" continues
" apples. I'm a big apple. I'm a big apple. ..." and, over 20 tokens, tail_loop gives start 1, period 6, count 3
(". I'm a big apple" = 6 tokens, from the first '.'). On "The capital of France is" it writes
" Paris.\n\nThe answer is: 2018-01-22 12:12:53." and stops: `1 2 :` twice in a time, not a loop.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

MIN_COUNT = 3     # full periods: a pattern seen twice (a time, a date) is ordinary text
MIN_TOKENS = 12   # a run shorter than this has no loop
HEADING_COUNT = 2  # full periods of a periodic tail heading into a loop (heading_into_loop)


@dataclass(frozen=True)
class Loop:
    start: int      # index of the first token of the loop (generation step)
    period: int     # tokens per repeat
    count: int      # full periods: (end - start) // period
    end: int        # one past the last token that still follows the period

    @property
    def length(self) -> int:
        return self.end - self.start

    def as_dict(self) -> dict:
        return asdict(self)


def periodic_runs(tokens: Sequence[int], max_period: int | None = None) -> list[Loop]:
    """Every maximal span with period p holding at least two full periods, for every p (not filtered)."""
    t = list(tokens)
    n = len(t)
    top = n // 2 if max_period is None else min(max_period, n // 2)
    runs = []
    for p in range(1, top + 1):
        i = 0
        while i < n - p:
            if t[i] != t[i + p]:
                i += 1
                continue
            a = i
            while i < n - p and t[i] == t[i + p]:
                i += 1
            length = i - a + p                                   # t[a : i + p] has period p
            if length >= 2 * p:
                runs.append(Loop(a, p, length // p, a + length))
    return runs


def find_loops(tokens: Sequence[int], *, min_count: int = MIN_COUNT, min_tokens: int = MIN_TOKENS,
               max_period: int | None = None) -> list[Loop]:
    """The loops of `tokens` (see the module docstring: periodic to the last token, min_count full periods,
    min_tokens tokens), sorted by start, then period."""
    if min_count < 2:
        raise ValueError(f"min_count must be >= 2, got {min_count}")
    n = len(tokens)
    runs = [r for r in periodic_runs(tokens, max_period) if r.end == n]
    kept = []
    for r in runs:
        if r.count < min_count or r.length < min_tokens:
            continue
        if any(q.period < r.period and q.start <= r.start for q in runs):
            continue                                             # a multiple of a smaller period
        kept.append(r)
    return sorted(kept, key=lambda r: (r.start, r.period))


def has_loop(tokens: Sequence[int]) -> bool:
    """Whether `tokens` end in a loop (the definition above, default thresholds)."""
    return bool(find_loops(tokens))


def tail_loop(tokens: Sequence[int], **kw) -> Loop | None:
    """The loop running through the last token: earliest start, then smallest period. None if none."""
    loops = find_loops(tokens, **kw)
    return min(loops, key=lambda r: (r.start, r.period)) if loops else None


def heading_into_loop(tokens: Sequence[int]) -> Loop | None:
    """The periodic tail of at least HEADING_COUNT full periods and MIN_TOKENS tokens running through the last
    token (earliest start, then smallest period), or None: what a run cut off mid-repeat ends in."""
    return tail_loop(tokens, min_count=HEADING_COUNT)


def repeats(loop: Loop) -> list[tuple[int, int]]:
    """(first, end) index ranges of each repeat of a loop, the last one possibly partial."""
    return [(s, min(s + loop.period, loop.end)) for s in range(loop.start, loop.end, loop.period)]
