"""Quantization damage on the bundled model: the gguf package's own quantizers, token-aligned against the
float32 (dequantized Q4_1) weights on a fixed text."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from engine import RunSettings
from engine.tools.quant import MATRICES, compare_formats, quant_report, requantize

pytestmark = pytest.mark.model
TEXT = ("The printing press was invented in the fifteenth century. It changed how books were made, how ideas "
        "travelled and who could read them. Before it, every copy of a book was written out by hand.")


@pytest.fixture(scope="module")
def report(bundled_model):
    ids = bundled_model.tokenizer.encode(TEXT)
    return compare_formats(bundled_model, ids, 1, ["F32", "Q8_0", "Q4_1", "Q4_0"])


def test_q8_0_diverges_less_than_q4_0_and_keeps_95_percent_of_top_tokens(report):
    q8, q4 = report.result("Q8_0"), report.result("Q4_0")
    assert q8.kld_mean < q4.kld_mean and q8.same_top >= 0.95
    assert q8.first_layer_over is None and q4.first_layer_over is not None
    assert report.steps == len(q8.kld) > 30


def test_float32_against_itself_is_zero_at_every_stage(report):
    f32 = report.result("F32")
    assert f32.per_stage and all(r["rel_err"] == 0.0 for r in f32.per_stage)
    assert f32.kld_mean == 0.0 and f32.same_top == 1.0 and f32.first_layer_over is None


def test_requantizing_with_the_files_own_q4_1_reproduces_the_bundled_weights(bundled_model, report):
    """Bound, per block of 32 weights with minimum m and step d = (max - min) / 15: Q4_1 stores d and m in
    float16, so a second pass can at most move each once more to a neighbouring float16 value, which moves a
    weight by at most 2^-11 * (15 |d| + |m|); float32 rounding in the dequantization adds 2^-22 * max |w|."""
    worst = 0.0
    for lw in bundled_model.weights.layers:
        for name in MATRICES:
            w = getattr(lw, name)
            if w is None:         # a slot this family's block does not have (experts, on a dense model)
                continue
            back = requantize(w, "Q4_1")
            blocks, moved = w.t().reshape(-1, 32), (back - w).t().reshape(-1, 32).abs()
            lo, hi = blocks.min(1).values, blocks.max(1).values
            d = (hi - lo) / 15
            bound = 2.0 ** -11 * (15 * d.abs() + lo.abs()) + 2.0 ** -22 * blocks.abs().max(1).values
            assert bool((moved <= bound[:, None]).all()), name
            worst = max(worst, float(moved.max()))
    print(f"\nQ4_1 round trip: largest change {worst:g}")
    assert report.result("Q4_1").kld_mean < 1e-9                      # the same weights run the same


def test_q4_1_bytes_of_a_file_tensor_are_reproduced_exactly(bundled_model, bundled_gguf_file):
    """ffn_down of layer 0 is stored unpermuted: (576 rows out, 1536 in); our quantization of the engine's
    (in, out) matrix, transposed back, gives the file's bytes (the bundled file, opened once per session)."""
    import gguf
    from gguf.quants import quantize

    t = next(t for t in bundled_gguf_file.tensors if t.name == "blk.0.ffn_down.weight")
    rows = bundled_model.weights.layers[0].w_down.t().contiguous().numpy()
    assert np.array_equal(quantize(rows, gguf.GGMLQuantizationType.Q4_1), np.asarray(t.data))


def test_the_cli_shaped_report_for_two_formats(bundled_model):
    t0 = time.perf_counter()
    rep = quant_report(bundled_model, RunSettings(prompt="The history of printing begins", chat=False,
                                                  max_new_tokens=64), ["Q8_0", "Q4_0"])
    print(f"\nquant, 2 formats, {rep.positions} positions: {time.perf_counter() - t0:.1f} s")
    d = rep.as_dict()
    assert list(d["formats"]) == ["Q8_0", "Q4_0"] and d["steps"] == 64
    for r in d["formats"].values():
        assert {"kld_mean", "same_top", "first_layer_over", "per_stage"} <= set(r)
        assert torch.isfinite(torch.tensor(r["kld"])).all()
