"""The why-loop's head reruns run on engine.variants.without_heads (the native decode step kept); before, they ran
the model with engine.inspection.probe.zero_heads at blocks.{i}.attn.z (the PyTorch forward at every step). On a
looping model's prompt (the tiny looping model: the same code paths as the bundled model's, for a 2-layer model's
cost), each of the report's head reruns gives the tokens and text the hooked rerun gives, 64 tokens each; and each
changes the run, so that a variant that zeroed nothing (or the wrong heads) would not pass."""
from __future__ import annotations

import pytest

from engine import RunSettings
from engine.generate import GenerationRun
from engine.inspection.interventions import zero_heads
from engine.inspection.loops import tail_loop
from engine.inspection.probe import Probe
from engine.tools.why_loop import HEAD_KS, HORIZON, copy_head_scores
from engine.variants import without_heads

pytestmark = pytest.mark.unit
LOOPING = RunSettings(prompt="I like apples. I like apples. I like", chat=False)


def _run(model, probe=None) -> GenerationRun:
    return GenerationRun(model, LOOPING.prompt, params=LOOPING.params, max_new_tokens=HORIZON, seed=LOOPING.seed,
                         chat=False, probe=probe).run()


def test_each_head_rerun_on_the_variant_is_the_hooked_rerun(tiny_looping_model):
    model = tiny_looping_model
    base = _run(model)
    loop = tail_loop(base.token_ids)
    assert loop is not None
    scores = copy_head_scores(model, base.prompt_ids + base.token_ids, len(base.prompt_ids), loop)
    H = scores.shape[1]
    top = [(i // H, i % H) for i in scores.flatten().argsort(descending=True, stable=True)[:max(HEAD_KS)].tolist()]
    for k in HEAD_KS:
        heads = top[:k]
        probe = Probe()
        for layer in sorted({layer for layer, _ in heads}):
            probe.replace(f"blocks.{layer}.attn.z", zero_heads(*[h for lay, h in heads if lay == layer]))
        variant = without_heads(model, heads)
        assert variant.accelerator.decode is not None or model.accelerator.decode is None
        hooked, fast = _run(model, probe), _run(variant)
        assert fast.token_ids == hooked.token_ids and fast.text == hooked.text, heads
        assert hooked.token_ids != base.token_ids, heads                 # the zeroed heads do change this run
