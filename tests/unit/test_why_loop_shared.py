"""The why-loop's reruns share the forwards they have in common (engine.tools.why_loop.SharedForwards): a
sampler rerun draws the baseline's tokens until its change first picks another one, and those forwards (the
prefill included) are answered from the baseline's, KV cache rows and all. The rerun's tokens and text are
those of a fresh GenerationRun on the model itself, and fewer positions are computed than the two runs hold. On
the tiny looping model: the same code paths as the bundled model's, for a 2-layer model's cost."""
from __future__ import annotations

import dataclasses

import pytest

from engine import RunSettings
from engine.generate import GenerationRun
from engine.sampling import SamplingParams
from engine.tools.why_loop import HORIZON, SharedForwards, loops_in

pytestmark = pytest.mark.unit
LOOPING = RunSettings(prompt="I like apples. I like apples. I like", chat=False)


def rerun(model, params: SamplingParams, early_stop: bool) -> GenerationRun:
    run = GenerationRun(model, LOOPING.prompt, params=params, max_new_tokens=HORIZON, seed=LOOPING.seed)
    while run.step() is not None:
        if early_stop and len(run.token_ids) >= 6 and loops_in(run.token_ids):
            break
    return run


@pytest.mark.parametrize("change", [dict(repetition_penalty=1.05), dict(frequency_penalty=0.5),
                                    dict(no_repeat_ngram=3)])
def test_a_sampler_rerun_through_the_shared_forwards_is_a_fresh_rerun_for_fewer_forwards(tiny_looping_model, change):
    model = tiny_looping_model
    shared = SharedForwards(model)
    base = rerun(shared, LOOPING.params, early_stop=False)
    before = shared.computed
    params = dataclasses.replace(LOOPING.params, **change)
    got, fresh = rerun(shared, params, early_stop=True), rerun(model, params, early_stop=True)
    assert got.token_ids == fresh.token_ids and got.text == fresh.text and got.stop_reason == fresh.stop_reason
    assert base.token_ids != got.token_ids                         # the change did change the run
    n = len(got.prompt_ids) + len(got.token_ids) - 1               # positions the rerun puts through the model
    assert shared.answered >= len(got.prompt_ids) and shared.computed - before < n
    first = next(i for i, (a, b) in enumerate(zip(base.token_ids, got.token_ids)) if a != b)
    assert shared.computed - before == max(0, len(got.token_ids) - 1 - first)   # only the steps after it diverged
