"""The reference row statistics: two passes, NaN-aware, any mask (engine.inspection.row_stats: REFERENCE).

Every faster path (the moments of engine.inspection.moment_stats, the native kernels of engine/native/inspect.c,
the blocked attention statistics) is held to these numbers in the tests, and hands back to them the rows it
cannot give exactly: a NaN or Inf, a mean that dwarfs the spread (CANCELLATION), a row with nothing unmasked.
"""
from __future__ import annotations

import torch

CANCELLATION = 1e-2       # var < this * mean²: moments (Σx²/n - mean²) lost too many digits; take the two-pass path


def exact_rows(x: torch.Tensor, masked: bool = False) -> torch.Tensor:
    """A stage tensor x (T, ...) -> its (T, 7) statistics over everything but the first dim (a strided view is
    copied here)."""
    return dense_stats(x.reshape(x.shape[0], -1).float(), bool(masked))


def dense_stats(X: torch.Tensor, masked: bool = False) -> torch.Tensor:
    """X (..., n) -> (..., 7) statistics over the last axis.

    Kernel choice matters on the CPU: sum / amax / amin / vector_norm vectorise, while std_mean and
    aminmax ran 10-30x slower on these shapes. A finite sum of a row proves every value of it is finite
    (any NaN or Inf would poison it), so the common case costs four reductions and one subtraction.

    Batch invariance (engine.batch): a row's statistics are the same whatever rows come with it. Each row takes
    the fast path or the NaN-aware one by its own sum, and a lone row on the CPU is reduced as one of two rows
    (torch splits a lone output's reduction between the threads, several rows a row a thread)."""
    lead, n = X.shape[:-1], X.shape[-1]
    X = X.reshape(-1, n)
    rows = X.shape[0]
    if rows == 1 and X.device.type == "cpu":
        X = X.expand(2, n)
    return _rows_stats(X, masked)[:rows].reshape(*lead, 7)


def _rows_stats(X: torch.Tensor, masked: bool) -> torch.Tensor:
    """dense_stats of X (rows, n), rows >= 2 on the CPU."""
    out, ok = _masked_fast(X) if masked else _fast(X)
    if not bool(ok.all()):
        bad = (~ok).nonzero().flatten()
        Xb = X[bad]
        if bad.numel() == 1 and X.device.type == "cpu":
            Xb = Xb.expand(2, -1)
        out[bad] = _nan_aware(Xb, masked)[:bad.numel()]
    return out


def _fast(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(statistics, which rows they hold exactly: those whose sum is finite)."""
    s1 = X.sum(-1)
    mean = s1 / X.shape[-1]
    std = torch.linalg.vector_norm(X - mean.unsqueeze(-1), dim=-1) / X.shape[-1] ** 0.5
    lo, hi = X.amin(-1), X.amax(-1)
    zero = torch.zeros_like(mean)
    return torch.stack([lo, hi, mean, std, torch.maximum(lo.abs(), hi.abs()), zero, zero], dim=-1), torch.isfinite(s1)


def _nan_aware(X: torch.Tensor, masked: bool) -> torch.Tensor:
    """Statistics of rows holding a NaN or an Inf (-inf mask entries of a masked stage left out, no fault)."""
    nan, isinf = torch.isnan(X), torch.isinf(X)
    neg_mask = (X == float("-inf")) if masked else torch.zeros_like(nan)
    inf = isinf & ~neg_mask                      # -inf in a masked stage (attention mask, sampler cut) is no fault
    excluded = nan | neg_mask
    finite = ~(nan | isinf)
    n_fin = finite.sum(-1)
    Xf = torch.where(finite, X, 0.0)
    mean = Xf.sum(-1) / n_fin.clamp(min=1)
    std = (torch.where(finite, Xf - mean.unsqueeze(-1), 0.0) ** 2).sum(-1).div(n_fin.clamp(min=1)).sqrt()
    none = n_fin == 0
    mean, std = mean.masked_fill(none, float("nan")), std.masked_fill(none, float("nan"))
    lo = torch.where(excluded, float("inf"), X).amin(-1)
    hi = torch.where(excluded, float("-inf"), X).amax(-1)
    return torch.stack([lo, hi, mean, std, torch.maximum(lo.abs(), hi.abs()),
                        nan.sum(-1).float(), inf.sum(-1).float()], dim=-1)


def _masked_fast(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Statistics of a masked stage (attention scores, sampler cuts), the -inf mask entries left out, and which
    rows they hold exactly: those whose only non-finite values are mask entries."""
    mask = X == float("-inf")
    X0 = X.masked_fill(mask, 0.0)
    s1 = X0.sum(-1)
    n = (~mask).sum(-1)
    none = n == 0
    mean = s1 / n.clamp(min=1)
    std = torch.linalg.vector_norm((X0 - mean.unsqueeze(-1)).masked_fill(mask, 0.0), dim=-1) / n.clamp(min=1).sqrt()
    lo, hi = X.masked_fill(mask, float("inf")).amin(-1), X.amax(-1)
    mean, std = mean.masked_fill(none, float("nan")), std.masked_fill(none, float("nan"))
    zero = torch.zeros_like(mean)
    out = torch.stack([lo, hi, mean, std, torch.maximum(lo.abs(), hi.abs()), zero, zero], dim=-1)
    return out, torch.isfinite(s1)
