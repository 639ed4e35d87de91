"""The prompt's spans the why-loop blanks one at a time: clauses, or runs of words where clauses are few."""
from __future__ import annotations

import heapq
import re

MAX_SPANS = 6


_PUNCT_RUN = re.compile(r"[.!?;:,\n]+")


def _clause_cuts(prompt: str) -> list[int]:
    """The ends of `[.!?;:,\n]+(?=\\s|$)` matches, without the regex's backtracking (quadratic on a long run
    of punctuation not followed by a space). Within one maximal run of those characters a match ends at the
    last place followed by whitespace or the end: the run's end if that holds there, else its last newline
    past the run's first character (a newline is whitespace too). Each run gives at most one cut."""
    cuts, n = [], len(prompt)
    for m in _PUNCT_RUN.finditer(prompt):
        a, b = m.span()
        end = b if b == n or prompt[b].isspace() else prompt.rfind("\n", a + 1, b)
        if end > a and end < n:
            cuts.append(end)
    return cuts


def _word_cuts(prompt: str, most: int) -> list[int]:
    r"""The first `most` starts of `\s+\S` matches: whitespace runs with something after them (the regex
    itself backtracks quadratically over trailing whitespace)."""
    if most <= 0:
        return []
    n = len(prompt)
    return [c for c in (m.start() for m in re.finditer(r"\s+", prompt) if m.end() < n)][:most]


def prompt_spans(prompt: str, max_spans: int = MAX_SPANS) -> list[tuple[int, int]]:
    """(start, end) character spans covering the prompt: sentences or clauses (split after . ! ? ; : , and
    newlines), or words when there is only one; neighbours merged (shortest pair first, the earlier pair on a
    tie) down to max_spans. O(n log n) in the prompt's length: a heap of neighbouring pairs, a pair made
    stale by a merge skipped when it comes up."""
    cuts = _clause_cuts(prompt) or _word_cuts(prompt, max_spans - 1)
    bounds = [0, *cuts, len(prompt)]
    spans = [(a, b) for a, b in zip(bounds, bounds[1:]) if prompt[a:b].strip()]
    if len(spans) <= max_spans:
        return spans
    start, end = [a for a, _ in spans], [b for _, b in spans]
    nxt, prev = list(range(1, len(spans))) + [-1], list(range(-1, len(spans) - 1))
    alive, count = [True] * len(spans), len(spans)
    heap = [(end[i + 1] - start[i], start[i], i) for i in range(len(spans) - 1)]
    heapq.heapify(heap)
    while count > max_spans:
        width, _, i = heapq.heappop(heap)
        j = nxt[i] if alive[i] else -1
        if j < 0 or end[j] - start[i] != width:        # a pair one of whose spans has grown since
            continue
        end[i], alive[j], count = end[j], False, count - 1       # span i takes in span j
        nxt[i] = nxt[j]
        if nxt[i] >= 0:
            prev[nxt[i]] = i
            heapq.heappush(heap, (end[nxt[i]] - start[i], start[i], i))
        if prev[i] >= 0:
            heapq.heappush(heap, (end[i] - start[prev[i]], start[prev[i]], prev[i]))
    return [(start[i], end[i]) for i in range(len(spans)) if alive[i]]
