"""Loop detection (engine.inspection.loops) against a brute-force reading of its definition, on a real greedy loop of
the bundled model, the settings that break it, and attention from looping tokens to their earlier copy."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import RunSettings
from engine.generate import generate
from engine.inspection.loops import Loop, find_loops, has_loop, periodic_runs, repeats, tail_loop
from inspector.views import repetition as rv

LOOP_PROMPT = "I like apples. I like apples. I like"     # raw prompt: greedy SmolLM2 loops on ". I'm a big apple"
LOOP_NEW = 20


def brute_loops(t, min_count=3, min_tokens=12):
    """The module docstring's definition, read literally: every (s, e, p), no cleverness."""
    n = len(t)

    def periodic(s, e, p):
        return all(t[i] == t[i + p] for i in range(s, e - p))
    cands = []
    for p in range(1, n + 1):
        for s in range(n):
            for e in range(s + 2 * p, n + 1):
                if periodic(s, e, p) and (s == 0 or t[s - 1] != t[s - 1 + p]) and (e == n or t[e] != t[e - p]):
                    cands.append((s, e, p))
    cands = [(s, e, p) for s, e, p in cands if e == n]           # a loop runs through the last token
    out = []
    for s, e, p in cands:
        if (e - s) // p < min_count or e - s < min_tokens:
            continue
        if any(q < p and s2 <= s and e <= e2 for s2, e2, q in cands):
            continue
        out.append(Loop(s, p, (e - s) // p, e))
    return sorted(out, key=lambda r: (r.start, r.period))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=18), st.integers(2, 3), st.integers(1, 7))
def test_find_loops_matches_the_definition(t, min_count, min_tokens):
    assert find_loops(t, min_count=min_count, min_tokens=min_tokens) == brute_loops(t, min_count, min_tokens)
    assert find_loops(t) == brute_loops(t)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(10, 99), min_size=1, max_size=6, unique=True), st.lists(st.integers(0, 9), max_size=6),
       st.integers(2, 5), st.integers(0, 5))
def test_tail_loop_of_a_repeated_unit(unit, prefix, k, partial):
    """prefix + unit × k + part of unit: the tail loop reaches the end with period len(unit) (the unit has
    distinct tokens, so no smaller period) and starts at the prefix or, if the prefix's end happens to
    continue the pattern, before it."""
    t = prefix + unit * k + unit[:partial % len(unit)]
    loop = tail_loop(t, min_count=2, min_tokens=1)
    assert loop is not None and loop.end == len(t) and loop.period == len(unit)
    assert loop.start <= len(prefix) and loop.count >= k
    assert all(t[i] == t[i + loop.period] for i in range(loop.start, len(t) - loop.period))
    assert loop.start == 0 or t[loop.start - 1] != t[loop.start - 1 + loop.period]


def test_loop_examples():
    assert find_loops([5] * 12) == [Loop(0, 1, 12, 12)]              # not also period 2, 3, ...
    assert find_loops([5] * 11) == []                                # under 12 tokens: no loop
    assert find_loops(list("cababcababcabab")) == [Loop(0, 5, 3, 15)]
    assert find_loops(list("cababcabab"), min_count=2, min_tokens=4) == [Loop(0, 5, 2, 10), Loop(6, 2, 2, 10)]
    assert tail_loop(list("xyzabcabcabcabca")) == Loop(3, 3, 4, 16)
    assert tail_loop(list("abcabcabcabcabcxyz")) is None and find_loops(list("abcabcabcabcabcxyz")) == []
    assert find_loops([]) == [] and tail_loop([1]) is None
    assert repeats(Loop(3, 3, 2, 11)) == [(3, 6), (6, 9), (9, 11)]
    assert periodic_runs([1, 2] * 4) == [Loop(0, 2, 4, 8), Loop(0, 4, 2, 8)]   # unfiltered: every period
    with pytest.raises(ValueError):
        find_loops([1, 1, 1], min_count=1)


# Ordinary answers: repeats a text moves on from, or short patterns seen twice. SmolLM2's tokenizer splits digits
# one by one, so a character list is how it sees a number. None is a loop.
ORDINARY = {
    "a clock time (the bundled model's answer to 'The capital of France is')":
        [" Paris", ".", "\n", "\n", "The", " answer", " is", ":", " ", *"2018-01-22 12:12:53", ".", "<|im_end|>"],
    "a time at the very end": ["It", " is", " now", " ", *"12:12:12"],
    "a date range": ["From", " ", *"2020-01-01", " to", " ", *"2020-01-01"],
    "a list": [*"1. apples\n2. pears\n3. plums\n4. figs\n"],
    "a phrase said twice, then the text goes on": [*"I'm not sure what to do with it. I'm not sure what to do with it "
                                                     "either, so I will ask."],
    "a phrase said twice at the end": ["Yes", ".", " I", " agree", ".", " I", " agree", "."],
    "a sentence said twice at the end (14 tokens: two copies, not three)":
        ["He", " said", ":"] + [" I", " will", " be", " there", " at", " noon", "."] * 2,
    "a number with zeros": [" It", " costs", " ", *"1000000", " dollars", "."],
}
# Real loops: the same tokens again and again to the end of the run (the first two from the bundled model).
REAL = {
    "greedy 'I like apples...'": ([" apples"] + [".", " I", "'m", " a", " big", " apple"] * 4 + ["."], (1, 6, 4)),
    "greedy 'Tomorrow will be' (64 tokens)": (
        [" a", " day", " of", " the", " past", ".", "\n", "\n", "I", "'m", " not", " sure", " what", " to", " do",
         " with", " it", ",", " but"]
        + [" I", "'m", " not", " sure", " what", " to", " do", " with", " it", " either", "."] * 2
        + [" I", "'m", " not", " sure", " what", " to", " do", "."] * 2 + [" I", "'m", " not", " sure", " what", " to",
                                                                            " do"], (40, 8, 3)),
    "one token forever": (["The", " end"] + ["!"] * 14, (2, 1, 14)),
}


@pytest.mark.parametrize("name", ORDINARY)
def test_ordinary_answers_hold_no_loop(name):
    toks = ORDINARY[name]
    assert find_loops(toks) == [] and tail_loop(toks) is None and not has_loop(toks), name


@pytest.mark.parametrize("name", REAL)
def test_real_loops_are_found_where_they_start(name):
    toks, (start, period, count) = REAL[name]
    loop = tail_loop(toks)
    assert loop is not None and has_loop(toks)
    assert (loop.start, loop.period, loop.count, loop.end) == (start, period, count, len(toks))


@pytest.fixture(scope="module")
def looping(bundled_model):
    return generate(bundled_model, LOOP_PROMPT, max_new_tokens=LOOP_NEW)


@pytest.mark.model
def test_greedy_loop_of_the_bundled_model(looping, bundled_model):
    tok = bundled_model.tokenizer
    assert looping.text.startswith(" apples. I'm a big apple. I'm a big apple. I'm a big apple.")
    loop = tail_loop(looping.token_ids)
    assert (loop.start, loop.period, loop.count, loop.end) == (1, 6, 3, LOOP_NEW)
    assert tok.decode(looping.token_ids[1:7]) == ". I'm a big apple"
    assert find_loops(looping.token_ids) == [loop]
    df = rv.loops_frame([loop], looping.steps, len(looping.prompt_ids))
    assert df.iloc[0]["positions"] == f"{len(looping.prompt_ids) + 1}–{len(looping.prompt_ids) + LOOP_NEW - 1}"
    assert df.iloc[0]["repeated text"] == ".·I'm·a·big·apple"
    html = rv.highlight_html(looping.steps, [loop])
    assert html.count('class="loop"') == LOOP_NEW - 1 and "loop 1 (start 1, period 6) · repeat 3" in html


@pytest.mark.model
def test_a_frequency_penalty_breaks_the_loop(looping, bundled_model):
    settings_ = RunSettings(prompt=LOOP_PROMPT, chat=False, max_new_tokens=LOOP_NEW)
    table = rv.compare_penalties(bundled_model, settings_, {"frequency penalty 0.5": dict(frequency_penalty=0.5)},
                                 baseline=(looping.token_ids, looping.text))
    assert table["setting"].tolist() == ["as run", "frequency penalty 0.5"]
    assert table["breaks the loop"].tolist() == [False, True]
    assert table.iloc[0]["tail loop"] == "start 1, period 6, ×3"
    assert table.iloc[1]["loops"] == 0 and table.iloc[1]["tail loop"] == "—"
    assert table.iloc[1]["text"].startswith("·apples.·I'm·a·big·apple.⏎⏎")


@pytest.mark.model
def test_attention_to_the_earlier_copy(looping, bundled_model):
    loop = tail_loop(looping.token_ids)
    ids, n = looping.prompt_ids + looping.token_ids, len(looping.prompt_ids)
    ca = rv.copy_attention(bundled_model, ids, n, loop)
    assert ca.queries == list(range(n + loop.start + loop.period, n + loop.end))
    assert ca.copies == [q - loop.period for q in ca.queries]
    L, H = bundled_model.config.num_layers, bundled_model.config.num_heads
    assert ca.to_copy.shape == ca.to_next.shape == (L, H, len(ca.queries))
    # the same numbers as the layer's full pattern (inspector.views.attention)
    from inspector.views.attention import attention_pattern
    pat = attention_pattern(bundled_model, ids, 5)
    q, c = ca.queries[3], ca.copies[3]
    assert abs(float(pat[2, q, c]) - float(ca.to_copy[5, 2, 3])) < 1e-5
    assert abs(float(pat[2, q, c + 1]) - float(ca.to_next[5, 2, 3])) < 1e-5
    # induction: for every looping token some head looks at the token after an earlier copy far more than a
    # uniform head would (the weight splits where the prompt holds the same pair too), mostly > 0.5
    best = ca.to_next.amax(dim=(0, 1))
    uniform = 1 / (torch.tensor(ca.queries) + 1)
    assert bool((best > 3 * uniform).all()) and float(best.median()) > 0.5, best
    table = rv.copy_attention_table(ca, [str(i) for i in range(len(ids))])
    assert table["position"].tolist() == ca.queries and (table["weight → after copy"] > table["uniform"]).all()
