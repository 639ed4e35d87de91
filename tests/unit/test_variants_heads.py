"""engine.variants.without_heads: the model with some heads' outputs zeroed through its wo matrix, held to the
hook it stands in for (engine.inspection.probe.zero_heads at blocks.{i}.attn.z) on the tiny random model: the
PyTorch forward gives the same numbers bit for bit, the variant keeps a native decode step that reads the model's
own weights (only the changed wo its own) and agrees with the hooked PyTorch decode, and the model is untouched."""
from __future__ import annotations

import ctypes

import pytest
import torch

from engine.accelerator import PLAIN
from engine.errors import InputError
from engine.inspection.interventions import zero_heads
from engine.inspection.probe import Probe
from engine.variants import without_heads

PROMPT = [1, 400, 2000, 31, 77, 1234, 9000, 15]
STEPS = [5, 4000, 321, 48000, 17, 9]
HEADS = [(1, 0), (1, 2)]


def _hooked() -> Probe:
    return Probe().replace("blocks.1.attn.z", zero_heads(0, 2))


def _run(model, probe=None) -> torch.Tensor:
    """Prompt (PyTorch prefill), then STEPS one token each (the native step where the model has one and the
    probe allows it) -> logits (1 + steps, V)."""
    cache = model.new_cache(32)
    out = [model.forward(torch.tensor(PROMPT), cache, probe, last_only=True)]
    out += [model.forward(torch.tensor([t]), cache, probe) for t in STEPS]
    return torch.cat(out)


def test_the_pytorch_forward_equals_the_hook_bit_for_bit(tiny_model):
    hooked = _run(tiny_model.with_accelerator(PLAIN), _hooked())
    variant = _run(without_heads(tiny_model, HEADS).with_accelerator(PLAIN))
    assert torch.equal(variant, hooked)
    assert not torch.equal(hooked, _run(tiny_model.with_accelerator(PLAIN)))     # the heads did matter


def test_the_native_decode_step_is_kept_and_reads_the_models_weights(tiny_model):
    if tiny_model.accelerator.decode is None:
        pytest.skip("no native decode step here")
    wo_before = [lw.wo.clone() for lw in tiny_model.weights.layers]
    variant = without_heads(tiny_model, HEADS)
    step = variant.accelerator.decode
    assert step is not None and step.model.weights is variant.weights
    calls = []
    real = type(step).__call__
    type(step).__call__ = lambda self, *a: calls.append(self) or real(self, *a)
    try:
        native = _run(variant)
    finally:
        type(step).__call__ = real
    assert calls == [step] * len(STEPS)                                 # every decode step took it
    torch.testing.assert_close(native, _run(tiny_model.with_accelerator(PLAIN), _hooked()), rtol=1e-5, atol=1e-5)
    mine = tiny_model.accelerator.decode
    wo = ctypes.cast(step.layer_ptrs["wo"], ctypes.POINTER(ctypes.c_void_p))
    assert [wo[i] for i in range(tiny_model.config.num_layers)] == [lw.wo.data_ptr() for lw in variant.weights.layers]
    assert wo[0] == tiny_model.weights.layers[0].wo.data_ptr()             # no copy of an unchanged matrix
    assert wo[1] != tiny_model.weights.layers[1].wo.data_ptr()             # the changed one, the variant's own
    assert mine is not step
    assert all(torch.equal(a, lw.wo) for a, lw in zip(wo_before, tiny_model.weights.layers))
    assert torch.equal(_run(tiny_model), _run(tiny_model))                # the model itself decodes as before


def test_a_head_that_is_not_there_is_an_input_error(tiny_model):
    H, L = tiny_model.config.num_heads, tiny_model.config.num_layers
    for bad in [(L, 0), (0, H), (-1, 0)]:
        with pytest.raises(InputError, match="no head"):
            without_heads(tiny_model, [bad])
