"""Precision plans (engine.variants.precision_plan): a low-precision model with chosen units computed in fp32.
Checked against the fp32 model itself: a plan with every unit in fp32 is the fp32 model (RoPE tables, KV cache
and embedding included), an fp32 attention unit keeps keys that overflow float16, the logit lens works on a
plan, and a plan of a plan holds both plans' units."""
from __future__ import annotations

import pytest
import torch

from engine import InputError, SamplingParams
from engine.generate import generate
from engine.inspection.interventions import scale
from engine.inspection.probe import Probe
from engine.variants import cast_model, precision_plan

pytestmark = pytest.mark.unit
PROMPT = "The quick brown fox jumps over the lazy dog, and then"


def every_unit(n_layers: int) -> list[str]:
    return (["embed", "blocks.0.resid"] + [f"blocks.{i}.{part}" for i in range(n_layers) for part in ("attn", "mlp")]
            + ["final_norm", "logits"])


@pytest.fixture(scope="module")
def low(tiny_model):
    return {dt: cast_model(tiny_model, dt) for dt in ("bfloat16", "float16")}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_a_plan_with_every_unit_in_fp32_is_the_fp32_model(tiny_model, low):
    ids = tiny_model.tokenizer.encode(PROMPT)
    want = tiny_model.logits(ids)
    bf16 = low["bfloat16"]
    plan = precision_plan(bf16, every_unit(tiny_model.config.num_layers), source=tiny_model)
    assert plan.new_cache(8).k.dtype == torch.float32 and plan.rope["main"][0].dtype == torch.float32
    assert rel(plan.logits(ids), want) < 1e-5
    assert rel(bf16.logits(ids), want) > 1e-3                 # the low model itself is far from it
    # the decode path (one position at a time through the cache) too
    kw = dict(max_new_tokens=12, params=SamplingParams(temperature=0.0), chat=False)
    assert generate(plan, PROMPT, **kw).token_ids == generate(tiny_model, PROMPT, **kw).token_ids


def test_an_fp32_attention_unit_keeps_keys_that_overflow_float16(tiny_model, low):
    ids = tiny_model.tokenizer.encode(PROMPT)
    fp16 = low["float16"]

    def faulty():
        return Probe().replace("blocks.1.attn.k", scale(1e6))        # O(1) keys -> 1e6: inf in float16
    assert not torch.isfinite(fp16.logits(ids, faulty())).all()
    want = tiny_model.logits(ids, faulty())
    assert torch.isfinite(want).all()
    plan = precision_plan(fp16, ["blocks.1.attn"], source=tiny_model)
    got = plan.logits(ids, faulty())
    assert torch.isfinite(got).all()
    assert rel(got, want) < 0.05                              # the other units still round to float16


def test_the_logit_lens_of_a_plan(tiny_model, low):
    resid = torch.randn(5, tiny_model.config.hidden_size).bfloat16().float()    # exact in bfloat16
    plan = precision_plan(low["bfloat16"], ["final_norm", "logits"], source=tiny_model)
    assert rel(plan.unembed(resid), tiny_model.unembed(resid)) < 1e-5
    assert rel(low["bfloat16"].unembed(resid), tiny_model.unembed(resid)) > 1e-4


def test_a_plan_of_a_plan_holds_both(tiny_model, low):
    ids = tiny_model.tokenizer.encode(PROMPT)
    bf16 = low["bfloat16"]
    twice = precision_plan(precision_plan(bf16, ["blocks.0.attn"], source=tiny_model), ["logits"], source=tiny_model)
    once = precision_plan(bf16, ["blocks.0.attn", "logits"], source=tiny_model)
    assert twice.fp32_units == ["blocks.0.attn", "logits"]
    assert twice.name == once.name == f"{bf16.name} [fp32: blocks.0.attn, logits]"
    assert twice.weights.layers[0].wqkv.dtype == twice.weights.lm_head.dtype == torch.float32
    assert twice.weights.layers[1].wqkv.dtype == torch.bfloat16
    assert torch.equal(twice.logits(ids), once.logits(ids))
    with pytest.raises(InputError, match="unknown precision unit 'embedding'"):
        precision_plan(bf16, ["embedding"])
