"""Why the bundled model loops on "I like apples. I like apples. I like" (raw, greedy): every listed cause
carries its rerun, at least one copy-head or sampler change breaks the loop for the run's 32 tokens and past them
(each rerun continued by twice the loop's span), and a
loop-free prompt gets no causes; an ordinary answer ("The capital of France is", issue 33) is no loop, neither in
the user's 8 tokens nor when looked at further. That the same report comes out twice is checked on the tiny
looping model (tests/unit/test_why_loop_twice.py)."""
from __future__ import annotations

import time
from collections import Counter

import pytest

from engine import RunSettings
from engine.generate import generate
from engine.tools.why_loop import LOOK_FURTHER, MAX_RERUNS, why_loop

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
        # past the run's 32 tokens: to the rerun horizon, or to an end-of-text after the run's length
        assert c.tokens > LOOPING.max_new_tokens and c.loop is None
        assert (c.stopped, c.tokens) == ("max_new_tokens", report.rerun_horizon) or c.stopped == "eos", c.change
        # within the run's 32 tokens no n-gram three times (past them, ordinary text may say "subject-verb
        # agreement" a third time: the verdict, no loop and no repeat heading into one, is what holds there)
        own = bundled_model.tokenizer.encode(c.text_after)[:LOOPING.max_new_tokens]
        assert most_repeated_ngram(bundled_model.tokenizer.decode(own).split()) < 3, (c.change, c.text_after)  # words
        assert most_repeated_ngram(own) < 3, c.change                                                          # tokens


def test_every_cause_carries_its_rerun_and_the_breaking_ones_come_first(timed):
    report, _ = timed
    kinds = Counter(c.kind for c in report.causes)
    assert kinds["heads"] == 1 and kinds["sampler"] == 4 and kinds["numerics"] == 1 and kinds["prompt"] == 3
    # fewest heads first: zeroing the top copy head alone breaks this loop, so no larger k is rerun
    heads = next(c for c in report.causes if c.kind == "heads")
    assert heads.loop_gone and heads.detail["k"] == 1 and heads.detail["tried"] == [1]
    assert heads.change == f"zero the top-1 copy head: L{report.copy_heads[0]['layer']}h{report.copy_heads[0]['head']}"
    gone = [c.loop_gone for c in report.causes]
    assert gone == sorted(gone, reverse=True)
    for c in report.causes:
        assert c.text_after and c.tokens >= 1
        if c.outcome == "loop kept":
            assert c.stopped == "loop" and c.tokens <= LOOPING.max_new_tokens
        elif c.outcome == "stopped":
            assert c.stopped in ("eos", "context") and c.tokens <= LOOPING.max_new_tokens
        elif c.outcome == "loop delayed":
            assert c.tokens > LOOPING.max_new_tokens and c.loop is not None


def test_a_loop_free_prompt_gets_no_causes(bundled_model):
    report = why_loop(bundled_model, RunSettings(prompt="What is 2+2?", chat=True))
    assert report.status == "no loop" and report.causes == [] and report.reruns == 1


def test_an_ordinary_answer_is_no_loop_in_the_users_run_nor_further(bundled_model):
    """`doctor "The capital of France is" --max-new-tokens 8 --why-loop` once called "12:12:" in a time (its 64-token
    rerun: " Paris.\\n\\nThe answer is: 2018-01-22 12:12:53.") a loop and listed 22 reruns of causes."""
    own = RunSettings(prompt="The capital of France is", chat=False, max_new_tokens=8)
    report = why_loop(bundled_model, own)
    assert report.status == "no loop" and report.causes == [] and report.reruns == 1 and not report.looked_further
    assert report.headline.startswith("Your run's 8 generated tokens hold no loop: there is nothing to diagnose.")
    further = why_loop(bundled_model, own, look_further=LOOK_FURTHER)
    assert "12:12:53" in further.baseline_text and further.looked_further
    assert further.status == "no loop" and further.causes == [] and further.reruns == 2
    assert "neither does a longer rerun" in further.headline


def test_the_loop_diagnosed_is_the_loop_the_page_shows(bundled_model):
    """"Tomorrow will be" (raw, greedy, 64 tokens): the page's loop is the diagnosis's loop (start 40, period 8).
    Zeroing its top copy heads holds no loop in the 64 tokens, and was once called "loop gone" (issue 48), but its
    text goes on "It is a choice between the past and the present, ... It is a choice between the ...": continued
    past the run, it is "loop delayed", with the step its repeat starts."""
    from engine.generate import GenerationRun
    from engine.inspection.loops import has_loop, tail_loop
    from engine.variants import without_heads
    settings = RunSettings(prompt="Tomorrow will be", chat=False, max_new_tokens=64)
    shown = generate(bundled_model, settings.prompt, max_new_tokens=64)
    report = why_loop(bundled_model, settings, max_reruns=6)
    assert report.loop == tail_loop(shown.token_ids).as_dict()
    assert (report.loop["start"], report.loop["period"]) == (40, 8)
    assert report.headline.startswith("Your run's 64 generated tokens end in a loop from step 40 with period 8")
    assert report.rerun_horizon == 64 + 2 * 24
    heads = next(c for c in report.causes if c.kind == "heads")
    assert heads.outcome == "loop delayed" and not heads.loop_gone and heads.detail["tried"] == [1, 2, 4, 8]
    assert heads.loop["start"] >= 40 and heads.loop["end"] > 64 and heads.loop["count"] >= 2
    rerun = GenerationRun(without_heads(bundled_model, [tuple(h) for h in heads.detail["heads"]]), settings.prompt,
                          max_new_tokens=heads.tokens).run()
    t, (a, p, e) = rerun.token_ids, (heads.loop["start"], heads.loop["period"], heads.loop["end"])
    assert not has_loop(t[:64]) and e == len(t) and all(t[i] == t[i + p] for i in range(a, e - p))     # by hand
    assert heads.text_after == rerun.text and heads.text_after.count("It is a choice between the past and the") >= 2
