"""The native decode step (engine/native) on the bundled model against transformers: every decoded position's
logits, and the statistics of every stage against the PyTorch forward's, at 300 positions of context."""
from __future__ import annotations

import pytest
import torch

from engine.accelerator import PLAIN
from engine.inspection.probe import Probe
from engine.native.step import NativeDecoder
from tests.reference.test_fidelity import LONG_TEXT, hf_logits, rel_err

pytestmark = pytest.mark.filterwarnings("ignore")


def _counting(monkeypatch) -> list:
    calls, real = [], NativeDecoder.__call__
    monkeypatch.setattr(NativeDecoder, "__call__", lambda self, *a: calls.append(a[2]) or real(self, *a))
    return calls


def test_decoded_logits_equal_transformers(bundled_model, hf_reference, monkeypatch):
    if bundled_model.accelerator.decode is None:
        pytest.skip("no native decode step here (no C compiler)")
    ids = bundled_model.tokenizer.encode(LONG_TEXT * 3)[:96]
    calls = _counting(monkeypatch)
    cache = bundled_model.new_cache(len(ids))
    parts = [bundled_model.forward(torch.tensor(ids[:64]), cache)]
    parts += [bundled_model.forward(torch.tensor([t]), cache) for t in ids[64:]]
    assert calls == list(range(64, 96))
    ours, ref = torch.cat(parts).float(), hf_logits(hf_reference, ids)
    for t in range(64, 96):
        assert rel_err(ours[t], ref[t]) <= 1e-4, t
        assert int(ours[t].argmax()) == int(ref[t].argmax()), t


def test_statistics_at_300_positions_equal_the_pytorch_forward(bundled_model):
    if bundled_model.accelerator.decode is None:
        pytest.skip("no native decode step here (no C compiler)")
    ids = bundled_model.tokenizer.encode(LONG_TEXT * 6)[:300]
    out = []
    for model in (bundled_model, bundled_model.with_accelerator(PLAIN)):     # native, then the public switch off
        probe, cache = Probe().record_stats("*"), model.new_cache(305)
        model.forward(torch.tensor(ids), cache, last_only=True)
        for t in (5, 900, 33):
            model.forward(torch.tensor([t]), cache, probe)
        out.append({(b.pos0, n): b.values[g] for b in probe.recording.stats for g, n in enumerate(b.names)})
    a, b = out
    assert a.keys() == b.keys() and len(a) == 3 * (1 + 17 * 30 + 2)
    for k in a:   # relative to each row's scale (a mean near zero is compared to its row's spread)
        scale = b[k][0, :5].abs().max().clamp(min=1e-6)
        assert float((a[k] - b[k]).abs().max() / scale) <= 1e-5, (k, a[k], b[k])
