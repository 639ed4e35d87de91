"""Tools that pressed on a GGUF file loaded as stored raised (scripts/pages_on_model.py on the bundled file): the
Explain page's gradient x input (the quantised product had no gradient: "element 0 of tensors does not require grad")
and the NaN doctor's fp32 rescue set (its precision plans copied the fp32 source's matrices with Tensor.to, which a
QuantMatrix has not). Each is held to the same tool on the same file loaded dequantised, the independent reference:
the same weight values, so only float32 summation orders differ (LOGITS_RTOL, tests/unit/test_gguf_as_stored.py)."""
from __future__ import annotations

import pytest
import torch

from engine.quant_matrix import QuantMatrix
from engine.variants import cast_model, precision_plan
from tests.unit.test_gguf_as_stored import IDS, LOGITS_RTOL, both, cache, write_gguf  # noqa: F401 (cache: a fixture)

pytestmark = pytest.mark.unit


def test_gradient_x_input_on_a_model_kept_quantised_is_the_dequantised_models(cache):
    from engine.tools.attribution import grad_x_input

    stored, floats = both(write_gguf(cache / "tiny.gguf"))
    assert isinstance(stored.weights.lm_head, QuantMatrix)
    ids, target = IDS.tolist(), 260
    got, want = torch.tensor(grad_x_input(stored, ids, target)), torch.tensor(grad_x_input(floats, ids, target))
    assert want.abs().max() > 0
    assert (got - want).abs().max() <= LOGITS_RTOL * want.abs().max(), (got, want)


@pytest.mark.parametrize("tied", [False, True])
def test_a_precision_plan_from_a_source_kept_quantised_holds_its_dequantised_values(cache, tied):
    stored, floats = both(write_gguf(cache / "tiny.gguf", tied=tied))
    low = cast_model(stored, "bfloat16")
    units = ["embed", "blocks.0.mlp", "blocks.0.attn", "logits"]
    plan, ref = precision_plan(low, units, source=stored), precision_plan(cast_model(floats, "bfloat16"), units,
                                                                             source=floats)
    for f in ("embed", "lm_head"):
        assert torch.equal(getattr(plan.weights, f), getattr(ref.weights, f)), f
        assert getattr(plan.weights, f).dtype == torch.float32
    for f in ("wqkv", "wo", "w_gate_up", "w_down"):
        assert torch.equal(getattr(plan.weights.layers[0], f), getattr(ref.weights.layers[0], f)), f
    a, b = plan.logits(IDS), ref.logits(IDS)
    assert (a - b).abs().max() <= LOGITS_RTOL * b.abs().max()
