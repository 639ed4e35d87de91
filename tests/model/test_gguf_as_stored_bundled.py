"""The bundled SmolLM2 Q4_1 GGUF loaded "as stored" (its matrices as QuantMatrix in the file's blocks) against the
same file dequantised to float32 (the import, gguf.quants.dequantize, and the float forward with its native step).

Tolerance: both compute with identical weight values; only float32 summation orders differ (the native quantised
kernel's per-block sums vs MKL's / the native decode step's). gamma_K for the longest product (K = 1536, the MLP's
down projection) is K u = 9.2e-5 of sum |x w| in the worst case, the typical error sqrt(K) u ~ 2e-6; over 30 layers
errors of that typical size add up in quadrature. Held: relative L2 of the logits <= 1e-4 (measured 2.0e-6 on this
prompt), the same top token at every position."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import load_model
from engine.gguf_file import open_gguf
from engine.quant_matrix import QuantMatrix
from engine.sources import bundled_gguf

pytestmark = pytest.mark.model

REL_L2 = 1e-4


@pytest.fixture(scope="module")
def stored():
    return load_model(None, quant="stored")


def test_the_bundled_model_as_stored_matches_its_dequantised_run(stored, bundled_model):
    ids = torch.tensor(bundled_model.tokenizer.encode("The capital of France is Paris, and the capital of Italy is"))
    a, b = stored.logits(ids), bundled_model.logits(ids)
    diff = a - b
    rel = (diff.norm() / b.norm()).item()
    print(f"bundled as stored vs dequantised fp32: max |diff| {diff.abs().max().item():.3g} "
          f"(max |logit| {b.abs().max().item():.3g}), relative L2 {rel:.3g}")
    assert rel <= REL_L2
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_the_bundled_model_as_stored_holds_the_files_block_bytes(stored, bundled_model):
    w = stored.weights
    assert all(isinstance(lw.wqkv, QuantMatrix) and isinstance(lw.w_down, QuantMatrix) for lw in w.layers)
    assert w.tied() and isinstance(w.embed, QuantMatrix)
    by_format = {}
    for t in open_gguf(bundled_gguf()).tensors:
        if t.tensor_type.name != "F32":
            by_format[t.tensor_type.name] = by_format.get(t.tensor_type.name, 0) + int(np.asarray(t.data).nbytes)
    held = w.nbytes_by_dtype()
    assert {k: v for k, v in held.items() if isinstance(k, str)} == by_format
    assert w.nbytes() < bundled_model.weights.nbytes() / 4
    assert stored.accelerator.decode is not None and stored.accelerator.why_not == ""    # decode.c reads the blocks


def test_the_bundled_file_as_stored_against_its_dequantised_self_stays_within_the_tolerance(stored, bundled_model):
    """The tool (engine.tools.quant_stored) on the bundled file: every stage within the stated tolerance (relative L2
    1e-4, the bound above), the same tokens chosen; its logits figure is this file's own hand figure."""
    from engine import RunSettings, SamplingParams
    from engine.tools.quant_stored import TOLERANCE, stored_report

    settings = RunSettings(prompt="The capital of France is", max_new_tokens=8, params=SamplingParams(temperature=0))
    r = stored_report(stored, bundled_model, settings)
    worst = max(r.per_stage, key=lambda x: x["rel_l2"])
    print(f"bundled as stored vs dequantised ({r.positions} positions, {r.steps} steps): logits max |Δ| "
          f"{r.logits_max_abs:.3g}, relative L2 {r.logits_rel_l2:.3g}, KL mean {r.kl_mean:.3g} max {r.kl_max:.3g}; "
          f"largest stage {worst['stage']} max |Δ| {worst['max_abs']:.3g} relative L2 {worst['rel_l2']:.3g}")
    assert r.first_stage_over is None and worst["rel_l2"] <= TOLERANCE
    assert r.same_top == 1.0 and r.own_first_divergence is None
    assert r.stored_bytes == {str(k).removeprefix("torch."): v for k, v in stored.weights.nbytes_by_dtype().items()}
    assert sum(r.stored_bytes.values()) < 100e6 < 500e6 < sum(r.dequantized_bytes.values())
