"""The native statistics of a multi-token forward (engine/native/inspect.c) against statistics of the
materialised tensors (engine.inspection.reference_stats.dense_stats, itself checked by hand in test_stats): stage
rows in any layout the forward offers, and attention scores / pattern under a causal mask with an offset."""
from __future__ import annotations

import pytest
import torch

from engine.accelerator import NATIVE_STATS, PLAIN
from engine.inspection.probe import Probe
from engine.inspection.reference_stats import dense_stats
from engine.native import build
from engine.native.inspect import attention_stats, layout, row_stats

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _library():
    if build.load()[0] is None:
        pytest.skip(f"native library unavailable here: {build.load()[1]}")


def close(got, want):
    """Within 1e-5 of each row's magnitude (its absmax), counts exact."""
    scale = want[..., 4:5].abs().clamp(min=1e-6)
    assert float(((got[..., :5] - want[..., :5]).abs() / scale).max()) <= 1e-5
    assert torch.equal(got[..., 5:], want[..., 5:])


def test_rows_of_every_layout_the_forward_offers():
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(37, 15, 64, generator=g)          # q, k, v: views of the fused product
    gu = torch.randn(37, 2 * 96, generator=g) * 3 + 5    # gate / up: column halves, a mean far from zero
    z = torch.randn(9, 37, 64, generator=g).transpose(0, 1)   # (T, H, hd) with heads outermost in memory
    xs = [qkv[:, :9], qkv[:, 9:12], qkv[:, 12:], gu[:, :96], gu[:, 96:], z, torch.randn(1, 700, generator=g)]
    got = row_stats(xs)
    for x, v in zip(xs, got):
        close(v, dense_stats(x.reshape(x.shape[0], -1)))


def test_a_row_with_nan_or_inf_is_left_to_the_pytorch_path():
    xs = [torch.randn(4, 50), torch.randn(4, 50), torch.randn(4, 50)]
    xs[1][2, 7] = float("nan")
    xs[2][0, 0] = float("-inf")
    got = row_stats(xs)
    assert got[0] is not None and got[1] is None and got[2] is None


def test_layouts_it_cannot_take():
    assert layout(torch.randn(5, 6).t()) is None                        # last dim not contiguous
    assert layout(torch.randn(2, 3, 4, 5)) is None                      # four dims
    assert layout(torch.randn(5, 6, dtype=torch.float64)) is None
    assert layout(torch.randn(0, 6)) is None


def _materialised(qh, keys, off):
    H, T, hd = qh.shape
    K, S = keys.shape[0], keys.shape[1]
    k = keys.repeat_interleave(H // K, dim=0)
    scores = (qh @ k.transpose(1, 2)) * hd ** -0.5                                       # (H, T, S)
    allowed = torch.arange(S)[None, :] <= (off + torch.arange(T))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    pattern = torch.softmax(scores, -1)
    return (dense_stats(scores.transpose(0, 1).reshape(T, -1), masked=True),
            dense_stats(pattern.transpose(0, 1).reshape(T, -1)))


@pytest.mark.parametrize("H, K, hd, T, S", [(4, 2, 16, 7, 7), (9, 3, 64, 13, 45), (2, 1, 8, 1, 33), (6, 6, 32, 40, 40)])
def test_attention_statistics_equal_the_materialised(H, K, hd, T, S):
    g = torch.Generator().manual_seed(H * 100 + S)
    qkv = torch.randn(T, H + K, hd, generator=g) * 2
    qh = qkv[:, :H].transpose(0, 1)                      # as the forward hands it over: a strided view
    cache = torch.randn(K, S + 11, hd, generator=g) * 2
    keys = cache[:, :S]
    values = torch.randn(K, S + 11, hd, generator=g)[:, :S]
    s, p = attention_stats(qh, keys, values, S - T, True, True)
    ref_s, ref_p = _materialised(qh, keys, S - T)
    close(s, ref_s)
    close(p, ref_p)
    only_p = attention_stats(qh, keys, values, S - T, False, True)
    assert only_p[0] is None and torch.equal(only_p[1], p)


@pytest.mark.parametrize("where", ["q", "key", "value"])
def test_attention_with_a_nan_or_inf_is_left_to_the_exact_path(where):
    qh, keys, values = torch.randn(4, 5, 16), torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    assert attention_stats(qh, keys, values, 4, True, True) is not None
    {"q": qh, "key": keys, "value": values}[where][1, 3, 2] = float("nan") if where != "value" else float("inf")
    assert attention_stats(qh, keys, values, 4, True, True) is None


def test_a_forward_s_statistics_equal_the_pytorch_path(tiny_model, monkeypatch):
    ids = list(range(300, 390))
    native = Probe().record_stats("*")
    tiny_model.logits(ids, native)
    assert tiny_model.accelerator.stats is NATIVE_STATS or build.load()[0] is None
    plain = Probe().record_stats("*")
    tiny_model.with_accelerator(PLAIN).logits(ids, plain)          # the public switch: the PyTorch paths
    a = {(r.pos0, r.name): r.values for r in native.recording.stat_records()}
    b = {(r.pos0, r.name): r.values for r in plain.recording.stat_records()}
    assert a.keys() == b.keys() and len(a) == 2 + 17 * tiny_model.config.num_layers + 1
    for k in a:
        close(a[k], b[k])
