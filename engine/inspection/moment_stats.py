"""The fast PyTorch row statistics (engine.inspection.row_stats: PYTORCH): four partial moments per row.

Reducing each stage separately with the obvious code would cost ~15 small kernels and a few passes through
memory per stage; at decode that is ~8,000 kernels per step on a 30-layer model, more than the forward
itself. Instead each stage tensor (positions first, [T, ...]) is reduced to four partial moments per row
(sum, norm, min, max) and everything else is derived once per flush for all stages together:

- small tensors (decode) are queued and, at a flush, stacked by shape and reduced together, so a flush costs
  a few kernels per distinct shape (about ten per model) whatever the number of stages;
- a large tensor (prefill) is reduced when offered, while it is still in cache: four plain reductions over
  every dim but the first, on the tensor as it is (a strided view such as q, k, v of the fused qkv product
  or gate / up is read in place, not copied), and nothing that waits for an accelerator. Its four (T,)
  results wait for the flush, where all of them are stacked at once;
- a stage offered as the very tensor the stage just before offered (a sampler stage that changed nothing:
  top-k 0, top-p 1, ...) reuses that stage's moments.

The variance comes from the moments (Σx²/n - mean²) and is exact to fp32 rounding unless the mean dwarfs
the spread; such stages, stages holding a NaN or Inf (whose sums are not finite) and stages with a fully
masked row are declined: the batcher gives them the reference statistics (engine.inspection.reference_stats).
So the usual case costs four reductions per stage and no host round trip before the flush.
"""
from __future__ import annotations

import bisect
import math

import torch

from engine.inspection.reference_stats import CANCELLATION

IMMEDIATE_ELEMENTS = 1 << 15   # a tensor this large is reduced to its moments when offered


class MomentsQueue:
    """One batcher's queue for the moments (see the module docstring); a StatsQueue (engine.inspection.row_stats)."""

    def __init__(self) -> None:
        self._small: dict[tuple, tuple[list[int], list[torch.Tensor]]] = {}  # (shape, dtype, masked) -> entries, xs
        self._reduced: list[tuple] = []      # (entry, x (T, ...), masked, moments): reduced when offered
        self._last: tuple | None = None      # (entry, x, masked, moments) of the last tensor reduced when offered

    def add(self, entry: int, x: torch.Tensor, masked: bool) -> int:
        """Take x (T, ...) or (n,) (one row); returns its elements (they count toward the flush bound)."""
        n = x.numel()
        if n < IMMEDIATE_ELEMENTS:
            key = (x.shape, x.dtype, masked)
            group = self._small.get(key)
            if group is None:
                group = self._small[key] = ([], [])
            group[0].append(entry)
            group[1].append(x)
        else:
            x2 = x if x.dim() > 1 else x.reshape(1, -1)
            last = self._last
            if last is not None and last[1] is x and last[0] == entry - 1 and last[2] == masked:
                part = last[3]                   # the very tensor the stage before offered: the same moments
            else:
                part = moments(x2 if x2.dtype == torch.float32 else x2.float(), masked, tuple(range(1, x2.dim())))
            self._last = (entry, x, masked, part)
            self._reduced.append((entry, x2, masked, part))
        return n

    def cut(self) -> None:
        """A replace hook is about to run (a tensor may change in place): no moments taken so far are reused."""
        self._last = None

    def finish(self, T: int) -> list[tuple]:
        """The queued stages' statistics as one block: (entries, (G, T, 7) values, declined), declined holding
        (index into values, tensor (T, ...), masked) for each stage the moments cannot give exactly."""
        reduced, small = self._reduced, self._small
        self._reduced, self._small, self._last = [], {}, None
        if not (reduced or small):
            return []
        cols, order, sources = [], [], []       # sources: (first row, tensor(s), masked, stacked)
        if reduced:
            order += [r[0] for r in reduced]
            cols.append([torch.stack([r[3][c] for r in reduced]) for c in range(4)]
                        + [_counts([r[3][4] for r in reduced], T, reduced[0][1].device)])
            sources += [(g, r[1], r[2], False) for g, r in enumerate(reduced)]
        for (_, _, masked), (idx, xs) in small.items():
            X = (torch.stack(xs) if len(xs) > 1 else xs[0][None]).reshape(len(xs), T, -1)     # (g, T, n)
            s1, norm, lo, hi, n = moments(X if X.dtype == torch.float32 else X.float(), masked)
            cols.append([s1, norm, lo, hi, n if isinstance(n, torch.Tensor) else torch.full_like(s1, n)])
            sources.append((len(order), X, masked, True))
            order += idx
        parts = [torch.cat(c) for c in zip(*cols)] if len(cols) > 1 else cols[0]
        return [(order, *_from_moments(parts, sources))]


def moments(X: torch.Tensor, masked: bool | None = False, dims: tuple[int, ...] = (-1,)) -> tuple:
    """X -> per row (reducing `dims`) Σx, ‖x‖ (squared at the flush, once for every stage), min, max and the
    count of values taken: a Python int, or a float tensor where -inf mask entries of a masked stage are left
    out. Four plain read-only reductions when nothing is masked (no out= views, no count tensor: each op
    costs microseconds of dispatch at decode sizes). A masked stage on the CPU first checks its sums: finite
    sums prove no row holds a -inf (nor any NaN or Inf), so nothing is masked and the same four suffice."""
    lead = X.shape[:X.dim() - len(dims)]
    n = math.prod(X.shape[d] for d in dims)
    rows = math.prod(lead)
    try:        # each row's n values one run (batch invariance: a row's order then does not depend on the others)
        X = X.view(rows, n)
    except RuntimeError:    # a strided view (attention maps): reduced in place, not copied (a prompt's maps are
        X = X.reshape(rows, *X.shape[len(lead):])    # T x H x S); offered with the same shape alone or in a batch
    dims = tuple(range(1, X.dim()))
    if rows == 1 and X.device.type == "cpu":
        # torch reduces a lone output by splitting its row between the threads (two-pass), several rows a row a
        # thread: a row offered alone (a lone run's decode step) would be summed in another order than the same
        # row among others (a batch's). Two rows (the second the same memory) make it the same order.
        X = X.expand(2, *X.shape[1:])
    s1, norm, lo, hi, count = _moments2(X, masked, dims)
    return tuple(v[:rows].reshape(lead) if isinstance(v, torch.Tensor) else v for v in (s1, norm, lo, hi, count))


def _moments2(X: torch.Tensor, masked: bool | None, dims: tuple[int, ...]) -> tuple:
    """moments of X (rows, ...) over dims, every row reduced alone (batch invariance, engine.batch)."""
    s1 = None
    if masked and X.device.type == "cpu":
        s1 = X.sum(dims)
        masked = not bool(torch.isfinite(s1).all())
    if not masked:
        return (X.sum(dims) if s1 is None else s1, torch.linalg.vector_norm(X, dim=dims), X.amin(dims), X.amax(dims),
                math.prod(X.shape[d] for d in dims))
    keep = X != float("-inf")
    X0 = torch.where(keep, X, 0.0)
    return (X0.sum(dims), torch.linalg.vector_norm(X0, dim=dims), torch.where(keep, X, float("inf")).amin(dims),
            X.amax(dims), keep.sum(dims, dtype=X.dtype))


def small_tensor(values: list, device, dtype=torch.long) -> torch.Tensor:
    """A small tensor of Python numbers on the device; to an accelerator through pinned memory without waiting
    (a plain copy from pageable memory would wait for the device: a host round trip per flush)."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def _counts(ns: list, T: int, device) -> torch.Tensor:
    """Counts of the stages reduced when offered, (g, T): Python ints (unmasked) or (T,) tensors (masked)."""
    if all(isinstance(n, int) for n in ns):
        return small_tensor(ns, device, torch.float32)[:, None].expand(len(ns), T)
    return torch.stack([n if isinstance(n, torch.Tensor) else torch.full((T,), float(n), device=device) for n in ns])


def _from_moments(parts: list[torch.Tensor], sources: list[tuple]) -> tuple[torch.Tensor, list[tuple]]:
    """Moments [Σx, ‖x‖, min, max, count], each (G, T) -> (G, T, 7) statistics and the stages declined: those
    with a row the moments cannot give exactly (a NaN or Inf, cancellation, nothing unmasked), as (g, tensor
    (T, ...), masked, rows (T,): the rows declined; the others keep the moments' values, so that a row's statistics
    do not depend on the rows beside it: batch invariance, engine.batch). sources holds (first row, tensor, masked, False) per tensor reduced when offered and
    (first row, stacked tensors (g, T, n), masked, True) per group reduced at the flush."""
    s1, norm, lo, hi, n = parts
    mean = s1 / n
    var = norm.square() / n - mean * mean
    exact = ~((var >= CANCELLATION * mean * mean) & (var < float("inf")))     # NaN, Inf, cancellation, n == 0
    zero = torch.zeros_like(mean)
    out = torch.stack([lo, hi, mean, var.clamp(min=0).sqrt(), torch.maximum(lo.abs(), hi.abs()), zero, zero], -1)
    declined = []
    if bool(exact.any()):
        starts = [src[0] for src in sources]
        for g in exact.any(1).nonzero().flatten().tolist():
            first, x, masked, stacked = sources[bisect.bisect_right(starts, g) - 1]
            declined.append((g, x[g - first] if stacked else x, bool(masked), exact[g]))
    return out, declined
