"""Loops in generated tokens: maximal periodic runs ("the same n tokens again and again").

Definition (what `find_loops` reports). Let t[0..n) be the generated token ids (indices are generation
steps: index i is the token chosen at step i, at absolute position n_prompt + i).

* A span t[s:e] has period p when t[i] == t[i + p] for every s <= i < e - p.
* A *loop* is a span with period p that cannot be extended (t[s-1] != t[s-1+p], and e == n or
  t[e] != t[e-p]), holds at least `min_count` full periods ((e - s) // p >= min_count, min_count >= 2) and
  covers at least `min_tokens` tokens. p is the smallest period of the span: a span of period p lying
  inside a loop of a smaller period q is not reported again (by Fine and Wilf it is periodic in gcd(p, q)).
* Loop(start=s, period=p, count=(e - s) // p, end=e): `count` full periods, then (e - s) % p tokens
  of a last, partial one.

`tail_loop` is the loop the generation is stuck in: among loops reaching the last token (e == n), the one
with the earliest start, then the smallest period; i.e. the earliest s and smallest p such that t[s:] has
period p at least twice over. None when the text does not end in a loop.

Example: greedy SmolLM2-135M on the raw prompt "I like apples. I like apples. I like" continues
" apples. I'm a big apple. I'm a big apple. ..." and tail_loop gives start 1, period 6
(". I'm a big apple" = 6 tokens, from the first '.').
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

MIN_COUNT = 2
MIN_TOKENS = 6


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
    """The loops of `tokens` (see the module docstring), sorted by start, then period."""
    if min_count < 2:
        raise ValueError(f"min_count must be >= 2, got {min_count}")
    runs = periodic_runs(tokens, max_period)
    kept = []
    for r in runs:
        if r.count < min_count or r.length < min_tokens:
            continue
        if any(q.period < r.period and q.start <= r.start and r.end <= q.end for q in runs):
            continue                                             # a multiple of a smaller period
        kept.append(r)
    return sorted(kept, key=lambda r: (r.start, r.period))


def tail_loop(tokens: Sequence[int], **kw) -> Loop | None:
    """The loop running through the last token: earliest start, then smallest period. None if none."""
    n = len(tokens)
    ends = [r for r in find_loops(tokens, **kw) if r.end == n]
    return min(ends, key=lambda r: (r.start, r.period)) if ends else None


def repeats(loop: Loop) -> list[tuple[int, int]]:
    """(first, end) index ranges of each repeat of a loop, the last one possibly partial."""
    return [(s, min(s + loop.period, loop.end)) for s in range(loop.start, loop.end, loop.period)]
