"""Why the bundled model loops on "I like apples. I like apples. I like" (raw, greedy): every listed cause
carries its rerun, at least one copy-head or sampler change breaks the loop for 64 tokens, the same
report comes out twice, and a loop-free prompt gets no causes."""
from __future__ import annotations

import time
from collections import Counter

import pytest

from engine import RunSettings
from engine.tools.why_loop import HORIZON, MAX_RERUNS, why_loop

pytestmark = pytest.mark.model
LOOPING = RunSettings(prompt="I like apples. I like apples. I like", chat=False)


def most_repeated_ngram(items, n: int = 3) -> int:
    """How often the most frequent n-gram occurs (n >= 3 grams repeat at most as often as their 3-grams)."""
    grams = Counter(tuple(items[i:i + n]) for i in range(len(items) - n + 1))
    return max(grams.values(), default=0)


@pytest.fixture(scope="module")
def timed(bundled_model):
    t0 = time.perf_counter()
    report = why_loop(bundled_model, LOOPING)
    seconds = time.perf_counter() - t0
    print(f"\nwhy_loop on the looping prompt: {seconds:.1f} s, {report.reruns} reruns")
    return report, seconds


def test_the_loop_is_found_with_period_6_from_step_1(timed):
    report, _ = timed
    assert report.status == "loop" and report.loop["start"] == 1 and report.loop["period"] == 6
    assert report.reruns <= MAX_RERUNS and not report.skipped
    assert report.copy_heads and report.copy_heads[0]["mass"] > 0.3     # one head reads the copy hard


def test_a_copy_head_or_sampler_change_breaks_the_loop_and_its_text_has_no_ngram_three_times(timed, bundled_model):
    report, _ = timed
    broken = [c for c in report.causes if c.loop_gone and c.kind in ("heads", "sampler")]
    assert broken
    for c in broken:
        assert c.tokens == HORIZON or c.stopped == "eos"
        assert most_repeated_ngram(c.text_after.split()) < 3, (c.change, c.text_after)          # words
        assert most_repeated_ngram(bundled_model.tokenizer.encode(c.text_after)) < 3, c.change   # tokens


def test_every_cause_carries_its_rerun_and_the_breaking_ones_come_first(timed):
    report, _ = timed
    kinds = Counter(c.kind for c in report.causes)
    assert kinds["heads"] == 1 and kinds["sampler"] == 5 and kinds["numerics"] == 1 and kinds["prompt"] == 3
    # fewest heads first: zeroing the top copy head alone breaks this loop, so no larger k is rerun
    heads = next(c for c in report.causes if c.kind == "heads")
    assert heads.loop_gone and heads.detail["k"] == 1 and heads.detail["tried"] == [1]
    assert heads.change == f"zero the top-1 copy head: L{report.copy_heads[0]['layer']}h{report.copy_heads[0]['head']}"
    gone = [c.loop_gone for c in report.causes]
    assert gone == sorted(gone, reverse=True)
    for c in report.causes:
        assert c.text_after and c.tokens >= 1
        if not c.loop_gone:
            assert c.stopped == "loop" and c.tokens < HORIZON


def test_the_same_report_twice_is_identical(timed, bundled_model):
    report, _ = timed
    assert why_loop(bundled_model, LOOPING).as_dict() == report.as_dict()


def test_a_loop_free_prompt_gets_no_causes(bundled_model):
    report = why_loop(bundled_model, RunSettings(prompt="What is 2+2?", chat=True))
    assert report.status == "no loop" and report.causes == [] and report.reruns == 1
