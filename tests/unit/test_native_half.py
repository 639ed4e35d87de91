"""The native decode steps (decode.c, decode_rows.c) in bfloat16 and float16 against the PyTorch forward in the same
dtype, on the tiny random model: the same greedy tokens, logits, KV cache (in the cache's dtype) and statistics of
every stage; a float16 stage that overflows to inf on the PyTorch path makes the native step hand the step back to
the PyTorch forward, which then reports the same inf.

The bounds. Both paths round each stage to the dtype at the same points (the native kernels at exactly the stages
where the PyTorch forward holds a tensor of that dtype) and sum products in float32, so they differ by zero
roundings; what differs is the order of the float32 sums (and the last float32 bit of an exp or a square root),
relative ~2^-20, which rounds a value to the neighbouring representable number only when the sum lies that close to
a rounding boundary: one ulp, at most 2u |x| (u = 2^-8 for bfloat16's 8-bit significand, 2^-11 for float16's 11).
Such an element then flows on through the step's later stages (and, from the cache, into later steps), each of
which may round one more value the other way. Measured on this model over 12 steps: bfloat16's cache is
bit-identical and its logits within 0.4 u absmax; float16, eight times finer, 94% of the cache bit-identical,
logits within 1.6 u absmax and statistics within 2.2 u absmax. The asserted bounds: the cache within one ulp of its
absmax (2u) and at least 85% bit-identical, logits within two ulps (4u), statistics within four (8u) of the stage's
absmax. A native step that computed in float32 without the dtype's roundings fails the bit-identical share (35-44%
of the cache, 0.0008% of bfloat16's logits identical), and its float16 step overflows to inf nowhere.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import GenerationRun, SamplingParams, load_model
from engine.accelerator import PLAIN
from engine.batch import forward_together
from engine.inspection.probe import Probe
from engine.native import build
from engine.native.step import NativeDecoder

pytestmark = pytest.mark.unit

PROMPT = [1, 400, 2000, 31, 77, 1234, 9000, 15]
STEPS = 12
UNIT = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}     # u: relative error of one rounding to nearest


def _model_or_skip(path, dtype: str):
    if build.load()[0] is None:
        pytest.skip(f"native decode step unavailable here: {build.load()[1]}")
    return load_model(path, device="cpu", dtype=dtype)


def _greedy(model, probe):
    """The prompt (PyTorch prefill), then STEPS greedy tokens one at a time -> (tokens, logits (1 + STEPS, V),
    cache)."""
    cache = model.new_cache(32)
    out = [model.forward(torch.tensor(PROMPT), cache, probe, last_only=True)[-1]]
    tokens = []
    for _ in range(STEPS):
        tokens.append(int(out[-1].float().argmax()))
        out.append(model.forward(torch.tensor([tokens[-1]]), cache, probe)[-1])
    return tokens, torch.stack(out), cache


def _statuses(monkeypatch) -> list:
    """The status of every native step called (0: done natively; 1: met a NaN or Inf, redone by PyTorch)."""
    got: list = []
    real = NativeDecoder.__call__

    def spy(self, *a, **k):
        out = real(self, *a, **k)
        got.append(out[2])
        return out
    monkeypatch.setattr(NativeDecoder, "__call__", spy)
    return got


def _by_stage(probe) -> dict:
    return {(b.step, b.pos0, n): b.values[g] for b in probe.recording.stats for g, n in enumerate(b.names)}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_decodes_natively_as_the_pytorch_forward_in_its_dtype(tiny_model_dir, dtype, monkeypatch):
    model = _model_or_skip(tiny_model_dir, dtype)
    u = UNIT[dtype]
    statuses = _statuses(monkeypatch)
    pa, pb = Probe().record_stats("*"), Probe().record_stats("*")
    ta, a, ca = _greedy(model, pa)
    assert statuses == [0] * STEPS                  # every decode step native, none handed back
    tb, b, cb = _greedy(model.with_accelerator(PLAIN), pb)
    assert len(statuses) == STEPS
    assert ta == tb
    assert a.dtype == b.dtype == getattr(torch, dtype)
    assert ca.k.dtype == cb.k.dtype == getattr(torch, dtype)
    a, b = a.float(), b.float()
    assert (a - b).abs().max() <= 4 * u * b.abs().max()
    decode = slice(len(PROMPT), len(PROMPT) + STEPS)
    for x, y in ((ca.k, cb.k), (ca.v, cb.v)):
        x, y = x[:, :, decode].float(), y[:, :, decode].float()
        assert (x - y).abs().max() <= 2 * u * y.abs().max()
        assert (x == y).float().mean() >= 0.85
    sa, sb = _by_stage(pa), _by_stage(pb)
    assert sa.keys() == sb.keys()
    for k in (k for k in sa if k[1] >= len(PROMPT)):
        scale = sb[k][0, 4]                         # the stage's absmax
        assert (sa[k][0, :5] - sb[k][0, :5]).abs().max() <= 8 * u * scale, (k, sa[k], sb[k])
        assert sa[k][0, 5:].tolist() == sb[k][0, 5:].tolist() == [0.0, 0.0]


def _runs(model):
    specs = [("hello there", 0, SamplingParams(temperature=0), 5), ("x", 3, SamplingParams(temperature=0), 5),
             ("a longer prompt with more positions to attend to", 5, SamplingParams(temperature=0), 5)]
    return [GenerationRun(model, p, params=sp, seed=s, max_new_tokens=n, ignore_eos=True)
            for p, s, sp, n in specs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_rows_decode_natively_as_the_pytorch_batched_forward(tiny_model_dir, dtype, monkeypatch):
    model = _model_or_skip(tiny_model_dir, dtype)
    u = UNIT[dtype]
    calls: list = []
    real = NativeDecoder.rows
    monkeypatch.setattr(NativeDecoder, "rows", lambda self, tokens, *a, **k: calls.append(len(tokens))
                        or real(self, tokens, *a, **k))
    nat, ref = _runs(model), _runs(model.with_accelerator(PLAIN))
    for r in nat + ref:
        r.step()
    for _ in range(4):
        got, want = (torch.stack(forward_together(runs)[0]) for runs in (nat, ref))      # no row failed
        assert got.dtype == want.dtype == getattr(torch, dtype)
        assert (got.float() - want.float()).abs().max() <= 4 * u * want.float().abs().max()
        for n, (a, b) in enumerate(zip(nat, ref)):
            a.step(got[n])
            b.step(want[n])
    assert calls == [3] * 4                          # each step native, the three rows in one call
    for a, b in zip(nat, ref):
        assert a.token_ids == b.token_ids
        n = a.cache.get_pos()
        x, y = a.cache.k[:, :, :n].float(), b.cache.k[:, :, :n].float()
        assert (x - y).abs().max() <= 2 * u * y.abs().max()


def test_a_float16_overflow_is_handed_back_and_reported_as_the_pytorch_forward_reports_it(tiny_model_dir,
                                                                                         monkeypatch):
    """Layer 1's attention norm weights set to 60,000 (a float16 number): the normed row, of RMS 1 before the weight,
    has elements past 65504 / 60000 = 1.09, which overflow to inf in float16 (in float32 they are finite). The
    native step rounds the stage to float16 where the PyTorch forward does, meets the inf, and hands every step
    back; the statistics are then the PyTorch forward's, infs counted."""
    model = _model_or_skip(tiny_model_dir, "float16")
    lw = model.weights.layers[1]
    model.weights.layers[1] = dataclasses.replace(lw, attn_norm=torch.full_like(lw.attn_norm, 60000.0))
    statuses = _statuses(monkeypatch)
    pa, pb = Probe().record_stats("*"), Probe().record_stats("*")
    _greedy(model, pa)
    assert statuses == [1] * STEPS                   # each native step met the inf and handed the step back
    _greedy(model.with_accelerator(PLAIN), pb)
    sa, sb = _by_stage(pa), _by_stage(pb)
    assert sa.keys() == sb.keys()
    key = (0, len(PROMPT), "blocks.1.attn_norm")
    assert sa[key][0, 6] > 0                         # the infs counted, as the PyTorch path counts them
    assert sb[(0, len(PROMPT), "blocks.0.attn_norm")][0, 6] == 0
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, equal_nan=True)
