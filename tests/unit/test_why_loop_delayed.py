"""A change that only postpones the loop is "loop delayed", not a fix (issue 48): every rerun is continued past the
diagnosed run's length by twice the loop's span and judged there (engine.tools.loop_verdict). On the tiny model
(untied, seed 0) made to loop by its run's own sampler, a frequency penalty of -1 (each repeat rewarded): on "I like
apples. I like apples. I like" (raw, greedy, 18 tokens) it loops on one token from step 6. Zeroing its top copy
head holds no loop in those 18 tokens (so the old verdict, judged at 18, called it "loop gone"), but 37 tokens in
it loops with period 11 from step 4; a frequency penalty of 0.1 instead is a real fix: loop-free to the rerun
horizon. Both are checked against fresh generations, the periods by hand."""
from __future__ import annotations

import dataclasses

import pytest

from engine import RunSettings, SamplingParams
from engine.cli.prescribe import human_lines
from engine.generate import GenerationRun
from engine.inspection.loops import has_loop
from engine.tools.why_loop import why_loop
from engine.variants import without_heads
from inspector.views import prescribe as pv

pytestmark = pytest.mark.unit
RUN = RunSettings(prompt="I like apples. I like apples. I like", chat=False, max_new_tokens=18,
                  params=SamplingParams(frequency_penalty=-1.0))


def fresh(model, n: int, params: SamplingParams = RUN.params) -> GenerationRun:
    return GenerationRun(model, RUN.prompt, params=params, max_new_tokens=n, seed=RUN.seed).run()


def ends_in_a_repeat(t: list[int]) -> bool:
    """By hand: the last 2p tokens are one p-token piece twice, 2p >= 12 (a loop on its way, or one)."""
    return any(t[-p:] == t[-2 * p:-p] for p in range(6, len(t) // 2 + 1))


@pytest.fixture(scope="module")
def report(tiny_model):
    # baseline + 4 head reruns + 5 repetition_penalty rungs + the first frequency_penalty rung
    return why_loop(tiny_model, RUN, max_reruns=11)


def test_the_reruns_run_past_the_run_by_twice_the_loops_span(report):
    assert report.loop == {"start": 6, "period": 1, "count": 12, "end": 18} and report.horizon == 18
    assert report.rerun_horizon == 18 + 2 * 12 and report.as_dict()["rerun_horizon"] == 42


def test_a_head_zeroing_whose_loop_returns_after_the_run_is_delayed_with_its_step(report, tiny_model):
    heads = next(c for c in report.causes if c.kind == "heads")
    assert heads.outcome == "loop delayed" and not heads.loop_gone and heads.detail["tried"] == [1, 2, 4, 8]
    assert heads.detail["k"] == 1            # the first k that delayed it (none broke it)
    top = report.copy_heads[0]
    variant = without_heads(tiny_model, [(top["layer"], top["head"])])
    assert not has_loop(fresh(variant, 18).token_ids)         # loop-free for the run's 18 tokens
    t = fresh(variant, 37).token_ids
    assert all(t[i] == t[i + 11] for i in range(4, 37 - 11)) and t[3] != t[14]       # period 11 from step 4
    assert heads.loop == {"start": 4, "period": 11, "count": 3, "end": 37} and heads.tokens == 37
    assert heads.text_after == fresh(variant, 37).text                # the delayed rerun's text, whole
    assert heads.verdict == "loop delayed: loop-free for the run's 18 tokens, then a loop from step 4, period 11"


def test_a_real_fix_stays_loop_gone_past_the_run(report, tiny_model):
    fix = next(c for c in report.causes if c.detail.get("setting") == "frequency_penalty")
    assert fix.change == "frequency_penalty -1 -> 0.1" and fix.outcome == "loop gone" and fix.loop is None
    assert fix.tokens == 42 and fix.stopped == "max_new_tokens"
    t = fresh(tiny_model, 42, dataclasses.replace(RUN.params, frequency_penalty=0.1)).token_ids
    assert not ends_in_a_repeat(t) and not has_loop(t)
    # fixes rank first (the repetition penalty's 1.5 breaks it too), the delay after them
    assert [c.outcome for c in report.causes] == ["loop gone", "loop gone", "loop delayed"]


def test_the_json_the_doctors_text_and_the_pages_table_say_the_same_verdict(report):
    d = report.as_dict()
    heads = next(c for c in d["causes"] if c["kind"] == "heads")
    assert heads["outcome"] == "loop delayed" and not heads["loop_gone"] and heads["loop"]["start"] == 4
    lines = human_lines({"why_loop": {k: v for k, v in d.items() if k != "causes"}, "causes": d["causes"]})
    assert any(line.startswith("  [delayed] heads") and heads["verdict"] in line for line in lines)
    assert report.headline.endswith("2 of 3 changes break it; 1 more only delays it (the loop comes back after the "
                                    "run's 18 tokens).") and lines[0] == f"why the loop: {report.headline}"
    row = pv.causes_frame(report).set_index("kind").loc["heads"]
    assert row["outcome"] == "loop delayed" and row["loop from step"] == 4 and row["verdict"] == heads["verdict"]


def test_the_pages_penalty_table_calls_a_loop_that_returns_after_the_run_delayed_not_broken(tiny_model):
    """The Repetition page's "Which settings break the loop?" reads the same verdict: a presence penalty of 1 on top
    of the run's frequency penalty of -1 is loop-free for 18 tokens, then loops on one token from step 10."""
    from inspector.views import repetition as rv
    base = fresh(tiny_model, 18)
    both = dict(frequency_penalty=-1.0, presence_penalty=1.0)
    t = fresh(tiny_model, 22, dataclasses.replace(RUN.params, **both)).token_ids
    assert not has_loop(t[:18]) and len(set(t[10:22])) == 1 and t[9] != t[10]            # by hand
    table = rv.compare_penalties(tiny_model, RUN, {"presence 1, frequency -1": both, "frequency 0.1": dict(
        frequency_penalty=0.1)}, baseline=(base.token_ids, base.text)).set_index("setting")
    assert not table.loc["as run", "breaks the loop"] and table.loc["as run", "verdict"].startswith("loop kept")
    assert not table.loc["presence 1, frequency -1", "breaks the loop"]
    assert table.loc["presence 1, frequency -1", "verdict"] == (
        "loop delayed: loop-free for the run's 18 tokens, then a loop from step 10, period 1")
    fix = table.loc["frequency 0.1"]
    assert fix["breaks the loop"] and fix["verdict"].startswith("loop gone")
