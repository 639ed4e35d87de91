"""engine.tools.prompt_spans.prompt_spans: the same spans as the original regex-and-rescan version on every small input,
and work that grows with the prompt's length, not its square (the original took 11.7 s at 8k clauses, and its
regexes backtracked quadratically over a long run of commas or of trailing spaces)."""
from __future__ import annotations

import random
import re
import time

import pytest

from engine.tools.prompt_spans import MAX_SPANS, prompt_spans

pytestmark = pytest.mark.unit


def reference_spans(prompt: str, max_spans: int = MAX_SPANS) -> list[tuple[int, int]]:
    """The original implementation, kept verbatim as the reference the linear one must agree with."""
    cuts = [m.end() for m in re.finditer(r"[.!?;:,\n]+(?=\s|$)", prompt) if m.end() < len(prompt)]
    if not cuts:
        cuts = [m.start() for m in re.finditer(r"\s+\S", prompt)][:max_spans - 1]
    bounds = [0, *cuts, len(prompt)]
    spans = [(a, b) for a, b in zip(bounds, bounds[1:]) if prompt[a:b].strip()]
    while len(spans) > max_spans:
        i = min(range(len(spans) - 1), key=lambda j: spans[j + 1][1] - spans[j][0])
        spans[i:i + 2] = [(spans[i][0], spans[i + 1][1])]
    return spans


# Punctuation, newlines, other whitespace (\x1c-\x1f, NEL, NBSP and U+2028 are whitespace to both \s and
# str.isspace; U+200B is not), letters: every branch of the cut rules shows up in a few thousand strings.
ALPHABET = list(".!?;:,") + ["\n", "\n", " ", " ", "\t", "\r", "\x1c", "\x85", "\xa0", "\u2028", "\u200b"] + list("abc")


def test_hand_worked_examples():
    # "One. Two, three" -> cuts after "." (4) and "," (9): spans cover the text between them.
    assert prompt_spans("One. Two, three") == [(0, 4), (4, 9), (9, 15)]
    # Punctuation followed by a letter is not a cut; a lone sentence splits into words.
    assert prompt_spans("a,b c") == [(0, 3), (3, 5)]
    # Inside ",\n,x" the match ends at the newline (the only place followed by whitespace).
    assert prompt_spans(",\n,x") == [(0, 1), (1, 4)]
    # "a, " * 7: cuts after each comma (2, 5, ..., 20), the trailing " " is no span: (0, 2), (2, 5), ... (17, 20).
    # Seven spans, six allowed: the narrowest pair is the first (width 5; the others 6), so it is merged.
    assert prompt_spans("a, " * 7) == [(0, 5), (5, 8), (8, 11), (11, 14), (14, 17), (17, 20)]
    # "a, a, b, a, " down to 2: spans (0, 2), (2, 5), (5, 8), (8, 11); pair widths 5, 6, 6 -> merge the first;
    # then (0, 5), (5, 8), (8, 11) with pair widths 8, 6 -> merge the second.
    assert prompt_spans("a, a, b, a, ", 2) == [(0, 5), (5, 11)]


@pytest.mark.parametrize("max_spans", [1, 2, 3, 6, 10])
def test_the_same_spans_as_the_original_on_random_prompts(max_spans):
    rng = random.Random(max_spans)
    for _ in range(4000):
        prompt = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 40)))
        assert prompt_spans(prompt, max_spans) == reference_spans(prompt, max_spans), repr(prompt)


def test_the_same_spans_as_the_original_on_clause_lists_with_ties():
    rng = random.Random(7)
    for _ in range(300):
        clauses = [rng.choice(["a", "bb", "ccc", "a b", ""]) + rng.choice([", ", ". ", "; ", "\n", ",", " "])
                   for _ in range(rng.randrange(1, 60))]
        prompt = "".join(clauses)
        for k in (1, 4, 6):
            assert prompt_spans(prompt, k) == reference_spans(prompt, k), repr(prompt)


def _seconds(prompt: str) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        prompt_spans(prompt)
        best = min(best, time.perf_counter() - t0)
    return best


@pytest.mark.alone          # compares two timings: by itself (tests/alone.py); beside another worker's test the
# small prompt's best of three once took 17 ms against 158 ms for the large one (9.2x)
@pytest.mark.parametrize("unit", ["clause, ", ",", " "], ids=["clauses", "a run of commas", "trailing spaces"])
def test_four_times_the_prompt_costs_about_four_times_the_work(unit):
    # 8k units and 32k: linear work grows 4x (n log n a little more); the original grew 16x (quadratic).
    # A ratio of the same machine's own timings, not an absolute time; best of three against noise.
    make = (lambda n: "x" + unit * n) if unit == " " else (lambda n: unit * n + "x")
    small, large = make(8_000), make(32_000)
    assert len(prompt_spans(small)) <= MAX_SPANS
    t_small, t_large = _seconds(small), _seconds(large)
    assert t_large < 9 * max(t_small, 1e-4), (t_small, t_large)


def test_eight_thousand_clauses_give_six_spans_covering_the_prompt():
    prompt = "".join(f"clause {i}, " for i in range(8_000))
    spans = prompt_spans(prompt)
    assert len(spans) == MAX_SPANS and spans[0][0] == 0 and spans[-1][1] == len(prompt) - 1   # the last " "
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    shorter = "".join(f"clause {i}, " for i in range(600))       # the reference takes seconds at 8k
    assert prompt_spans(shorter) == reference_spans(shorter)
