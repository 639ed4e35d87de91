"""Every row-statistics backend (engine.inspection.row_stats) gives the reference's statistics on the same
tensors: finite rows, rows with a NaN or Inf, masked rows (one fully masked), rows whose mean dwarfs their
spread, another dtype; through the batcher's one rule (what a backend declines or does not take gets the
reference's), and for whole forwards, attention included, through the accelerator's public switch."""
from __future__ import annotations

import pytest
import torch

from engine import Probe, plant
from engine.accelerator import Accelerator, stats_backend
from engine.inspection.reference_stats import exact_rows
from engine.inspection.row_stats import PYTORCH, REFERENCE, chain
from engine.inspection.stats import StatsBatcher
from engine.native import build
from engine.native.inspect import NATIVE
from tests.helpers import reference_stats

NAN, INF = float("nan"), float("inf")
IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2683, 359, 253, 1345, 2114, 28, 731]
NATIVE_BUILT = build.load()[0] is not None
BACKENDS = pytest.mark.parametrize("backend", [
    REFERENCE, PYTORCH,
    pytest.param(NATIVE, marks=pytest.mark.skipif(not NATIVE_BUILT, reason="native library not built")),
    pytest.param(chain(NATIVE, PYTORCH), marks=pytest.mark.skipif(not NATIVE_BUILT, reason="native library not built")),
    stats_backend(torch.device("cpu"))], ids=["reference", "pytorch", "native", "native+pytorch", "chosen"])


def _tensors() -> list[tuple[str, torch.Tensor, bool]]:
    g = torch.Generator().manual_seed(11)
    T = 6
    big = torch.randn(T, 6000, generator=g) * 3 - 1                  # reduced when offered (moments)
    nan = torch.randn(T, 6000, generator=g)
    nan[2, 17], nan[4, 3], nan[4, 9] = NAN, INF, -INF
    small_nan = torch.randn(T, 9, generator=g)
    small_nan[1, 0] = NAN
    masked = torch.randn(T, 7000, generator=g)
    masked[1, ::3] = -INF
    masked[3] = -INF                                                  # nothing left unmasked in row 3
    cancel = 100.0 + torch.randn(T, 6000, generator=g)                # Σx²/n - mean² loses every digit
    cancel[0] = torch.randn(6000, generator=g)
    qkv = torch.randn(T, 12, 16, generator=g)
    return [("big", big, False), ("small", torch.randn(T, 7, generator=g), False), ("nan", nan, False),
            ("small_nan", small_nan, False), ("masked", masked, True), ("masked_small", masked[:, :40].clone(), True),
            ("clean_masked", big.clone(), True), ("cancel", cancel, False), ("cancel_small", cancel[:, :50], False),
            ("view", qkv[:, 2:6], False), ("bf16", big.to(torch.bfloat16), False),
            ("row", torch.randn(6000, generator=g), False)]


def close(got: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> None:
    """Equal to fp32 rounding relative to each row's magnitude (absmax); NaN/Inf counts and NaN places exact."""
    assert torch.equal(got[:, 5:], ref[:, 5:]), (got[:, 5:], ref[:, 5:])
    assert torch.equal(got[:, :5].isnan(), ref[:, :5].isnan())
    scale = ref[:, 4:5].abs().clamp(min=1e-30)
    ok = torch.isfinite(ref[:, :5])
    assert torch.equal(got[:, :5][~ok].nan_to_num(7.0), ref[:, :5][~ok].nan_to_num(7.0))   # ±inf, NaN in place
    err = ((got[:, :5] - ref[:, :5]).abs() / scale)[ok]
    assert err.numel() == 0 or float(err.max()) <= rtol, float(err.max())


@BACKENDS
def test_each_backend_gives_the_reference_statistics(backend):
    tensors = _tensors()
    b = StatsBatcher(backend)
    for name, x, masked in tensors:
        if name == "row":
            b.flush()                                               # one row: a block of its own
        b.add(name, None, x, masked)
    blocks = b.take(0, 0)
    got = {n: v for blk in blocks for n, v in zip(blk.names, blk.values)}
    assert list(got) == [n for n, _, _ in tensors]
    for name, x, masked in tensors:
        x2 = x if x.dim() > 1 else x[None]
        ref = exact_rows(x2, masked)
        if backend is REFERENCE:
            assert torch.equal(got[name].nan_to_num(7.0), ref.nan_to_num(7.0)), name
        close(got[name], ref)
        close(got[name], reference_stats(x2.float(), masked), rtol=2e-5)   # and the slow oracle in float64
    assert float(got["cancel"][1, 3]) > 0.5                          # the std, not what the moments leave of it
    assert got["masked"][3, :4].isnan().tolist() == [False, False, True, True]


@BACKENDS
def test_whole_forwards_with_each_backend_give_the_reference_statistics(tiny_model, backend):
    """Every stage of a prefill, a chunk after it (another mask) and a decode step, once with a NaN planted in
    a query: the attention statistics, too, equal the reference backend's."""
    def run(b, nan: bool) -> dict:
        model = tiny_model.with_accelerator(Accelerator(None, b))
        probe = Probe().record_stats("*")
        if nan:
            probe.replace("blocks.1.attn.q_rot", plant(NAN, position=6, index=3))
        cache = model.new_cache(len(IDS))
        for chunk in (IDS[:9], IDS[9:13], IDS[13:]):
            model.forward(torch.tensor(chunk), cache, probe)
        return {(r.pos0, r.name): r.values for r in probe.recording.stat_records()}
    for nan in (False, True):
        got, ref = run(backend, nan), run(REFERENCE, nan)
        assert list(got) == list(ref)
        assert any(name.endswith("attn.pattern") for _, name in got)
        for key in ref:
            close(got[key], ref[key], rtol=2e-5)
        assert float(ref[(0, "blocks.1.attn.scores")][6, 5]) > 0 if nan else True
