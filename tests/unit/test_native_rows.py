"""The native batched decode step (engine/native/decode_rows.c, NativeDecoder.rows), which Model.forward_batch takes
for a batch of runs (engine.batch: engine.forward_batch.Batch.rows) when the model has a native step, against the
PyTorch batched forward it stands in for (Model.with_accelerator(PLAIN)): the same logits, cache writes and every stage's statistics per row, rows of
different positions and cache lengths; tokens equal each run alone; a row that meets a NaN redoes the step on the
PyTorch path (only that run stops on it); a probe it cannot serve keeps the PyTorch path."""
from __future__ import annotations

import pytest
import torch

from engine import GenerationRun, SamplingParams
from engine.accelerator import PLAIN
from engine.batch import forward_together
from engine.inspection.probe import Probe, inspection_probe
from engine.native import build
from engine.native.step import NativeDecoder
from tests.helpers import assert_same_stats, step_together_to_the_end

pytestmark = pytest.mark.unit

SPECS = [("hello there", 0, SamplingParams(temperature=0), 6),
         ("a much longer prompt than the first one, with more positions to attend to", 3,
          SamplingParams(temperature=0.9, top_k=40), 9),
         ("x", 11, SamplingParams(temperature=1.0, top_p=0.8), 7),
         ("seven rows make two of the kernel's row blocks", 5, SamplingParams(temperature=0.7), 5),
         ("five", 1, SamplingParams(temperature=0), 8), ("six", 2, SamplingParams(temperature=0), 4),
         ("and the seventh", 9, SamplingParams(temperature=1.2), 6)]


def _native_or_skip(model) -> NativeDecoder:
    if model.accelerator.decode is None:
        pytest.skip(f"native decode step unavailable here: {build.load()[1]}")
    return model.accelerator.decode


def _runs(model, specs=SPECS, probe=True):
    return [GenerationRun(model, p, params=sp, seed=s, max_new_tokens=n, ignore_eos=True,
                          probe=inspection_probe(timing=False) if probe else None) for p, s, sp, n in specs]


def _prefilled(model, specs=SPECS):
    runs = _runs(model, specs)
    for r in runs:
        r.step()
    return runs


def _rows_calls(monkeypatch) -> list:
    calls: list = []
    real = NativeDecoder.rows
    monkeypatch.setattr(NativeDecoder, "rows", lambda self, tokens, *a, **k: calls.append(len(tokens))
                        or real(self, tokens, *a, **k))
    return calls


def test_one_native_step_equals_the_pytorch_batched_forward(tiny_model, monkeypatch):
    _native_or_skip(tiny_model)
    calls = _rows_calls(monkeypatch)
    nat, ref = _prefilled(tiny_model), _prefilled(tiny_model.with_accelerator(PLAIN))
    for _ in range(3):                     # three steps: each row's cache grows at its own position
        got, want = (torch.stack(forward_together(runs)[0]) for runs in (nat, ref))      # no row failed
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()
        for n, (a, b) in enumerate(zip(nat, ref)):
            a.step(got[n])
            b.step(want[n])
    assert calls == [len(SPECS)] * 3       # the native path took every step, all seven rows in one call
    for a, b in zip(nat, ref):
        assert a.token_ids == b.token_ids
        n = a.cache.get_pos()
        assert torch.allclose(a.cache.k[:, :, :n], b.cache.k[:, :, :n], rtol=1e-4, atol=1e-5)
        assert torch.allclose(a.cache.v[:, :, :n], b.cache.v[:, :, :n], rtol=1e-4, atol=1e-5)
        assert_same_stats(a, b, rtol=1e-4, atol=1e-4)


def test_runs_stepped_natively_together_write_what_each_writes_alone(tiny_model, monkeypatch):
    _native_or_skip(tiny_model)
    calls = _rows_calls(monkeypatch)
    alone = _runs(tiny_model)
    for r in alone:
        r.run()
    together = _runs(tiny_model)
    step_together_to_the_end(together)
    assert calls and max(calls) == len(SPECS)
    for a, b in zip(alone, together):
        assert b.token_ids == a.token_ids and b.stop_reason == "max_new_tokens"
        assert_same_stats(a, b, rtol=1e-4, atol=1e-4)


def test_a_row_that_meets_a_nan_stops_only_its_own_run_as_alone(tiny_model, monkeypatch):
    """A NaN planted in one run's cached keys: the native call reports the row, the step is redone on the PyTorch
    path, and that run stops on non-finite logits exactly as it does alone; the others go on as alone."""
    _native_or_skip(tiny_model)
    calls = _rows_calls(monkeypatch)
    specs = SPECS[:3]

    def planted(runs):
        runs[1].cache.k[-1, 0, 3, 5] = float("nan")      # the last layer's keys
        return runs
    alone = planted(_prefilled(tiny_model, specs))
    for r in alone:
        r.run()
    together = planted(_prefilled(tiny_model, specs))
    step_together_to_the_end(together)
    assert calls                            # the native call was tried (and reported the row)
    assert alone[1].stop_reason == together[1].stop_reason == "non-finite logits"
    assert together[1].token_ids == alone[1].token_ids
    for a, b in zip(alone[::2], together[::2]):
        assert b.token_ids == a.token_ids and b.stop_reason == "max_new_tokens"
    nan_a = [r for r in alone[1].probe.recording.stat_records() if r.step == 1]
    nan_b = [r for r in together[1].probe.recording.stat_records() if r.step == 1]
    assert [r.name for r in nan_a] == [r.name for r in nan_b]
    for x, y in zip(nan_a, nan_b):          # NaN and Inf counts as the PyTorch path's alone
        assert torch.equal(x.values[:, 5:].nan_to_num(), y.values[:, 5:].nan_to_num()), x.name


def test_a_probe_the_native_step_cannot_serve_keeps_the_pytorch_path(tiny_model, monkeypatch):
    _native_or_skip(tiny_model)
    calls = _rows_calls(monkeypatch)
    runs = _prefilled(tiny_model, SPECS[:2])
    runs[0].probe = Probe().capture("blocks.0.attn.q")      # a capture of a stage the native step does not keep
    rows, _ = forward_together(runs)
    assert not calls and len(rows) == 2 and all(isinstance(r, torch.Tensor) for r in rows)
