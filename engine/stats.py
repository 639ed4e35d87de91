"""Per-position statistics of many stage tensors, computed on the device in a handful of ops.

Reducing each stage separately with the obvious code would cost ~15 small kernels and a few passes through
memory per stage; at decode that is ~8,000 kernels per step on a 30-layer model, more than the forward
itself. Instead each stage tensor (positions first, [T, ...]) is reduced to four partial moments per row
(sum, sum of squares, min, max) and everything else is derived once per flush for all stages together:

- small tensors (decode) are queued and, at a flush, stacked by shape and reduced together, so a flush costs
  a few kernels per distinct shape (about ten per model) whatever the number of stages;
- a large tensor (prefill) is reduced when offered, while it is still in cache (four read-only passes, no
  copy, nothing that waits for an accelerator); its row results wait for the flush like the rest.

The variance comes from the moments (Σx²/n - mean²) and is exact to fp32 rounding unless the mean dwarfs
the spread; such rows, rows holding a NaN or Inf (whose sums are not finite), and fully masked rows are
recomputed at the flush by dense_stats, the two-pass, NaN-aware reference. So the usual case costs four
reductions per stage and no host round trip before the flush.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

STAT_NAMES = ("min", "max", "mean", "std", "absmax", "nan", "inf")
FLUSH_ELEMENTS = 1 << 22  # flush the queue past this many queued elements, bounding the memory it holds
FLUSH_ELEMENTS_DEVICE = 1 << 25   # on an accelerator: a flush waits for the device, so fewer of them
IMMEDIATE_ELEMENTS = 1 << 15   # a tensor this large is reduced to its moments when offered
CANCELLATION = 1e-2       # var < this * mean²: the moments lost too many digits; take the two-pass path


@dataclass
class StatsBlock:
    """Statistics of several stages from one forward call: values[g, t] is stage g at position pos0 + t."""
    step: int
    pos0: int
    names: list[str]
    layers: list[int | None]
    values: torch.Tensor        # (G, T, 7) float32 on the CPU, columns STAT_NAMES


@dataclass
class StatRecord:
    """One stage of one call (a view into a StatsBlock)."""
    step: int
    name: str
    layer: int | None
    pos0: int
    values: torch.Tensor        # (T, 7)


class StatsBatcher:
    # queue entries: [name, layer, x, masked, part]. x: the (T, ...) tensor, kept until the flush (for the
    # exact path); masked None: part holds final statistics (T, 7); else part is None (reduced at the flush)
    # or the tensor's moments (5, T), taken when it was offered.
    def __init__(self) -> None:
        self._queue: list[list] = []
        self._rows = 0
        self._queued = 0
        self._pending: list[tuple[list[str], list, torch.Tensor]] = []
        self._parents: dict[tuple, torch.Tensor] = {}     # moments per piece of a parent, until the flush
        self._parent_refs: list[torch.Tensor] = []         # (kept alive so their addresses stay theirs)

    def add(self, name: str, layer: int | None, x: torch.Tensor, masked: bool = False) -> None:
        """Queue x (T, ...) for statistics. masked: -inf entries are mask values, left out of every statistic."""
        if x.requires_grad:
            x = x.detach()
        shape = x.shape
        rows = shape[0] if len(shape) > 1 else 1
        if rows != self._rows and self._queue:
            self.flush()
        self._rows = rows
        n = math.prod(shape)
        if n >= IMMEDIATE_ELEMENTS:          # reduced over all dims but the first: a strided view is not copied
            x = x if x.dim() > 1 else x.reshape(1, -1)
            part = None if masked else self._from_parent(x)
            if part is None:
                part = moments(x.float(), masked, tuple(range(1, x.dim())))
            self._queue.append([name, layer, x, masked, part])
        else:
            self._queue.append([name, layer, x, masked, None])
        self._queued += n
        if self._queued >= (FLUSH_ELEMENTS if x.device.type == "cpu" else FLUSH_ELEMENTS_DEVICE):
            self.flush()

    def _from_parent(self, x: torch.Tensor) -> torch.Tensor | None:
        """Moments of a view that takes a contiguous piece of each row of a larger tensor (q, k, v of the fused
        qkv product; gate and up; q_rot and k_rot), combined from the whole tensor's moments per piece: one set
        of reductions over the parent instead of one per view. None when x is not such a view. (The parent is
        found through the storage: views made in inference mode do not keep their base.)"""
        T, L = x.shape[0], x.stride(0)
        c, width = x.shape[-1], x[0].numel()
        storage = x.untyped_storage()
        if width >= L or x.dtype != torch.float32 or storage.nbytes() != T * L * 4 or x.stride(-1) != 1 \
                or x.dim() > 3 or (x.dim() == 3 and x.stride(1) != c) or x.storage_offset() % c or L % c:
            return None
        key = (storage.data_ptr(), c)            # (inference tensors keep no version counter)
        part = self._parents.get(key)
        if part is None:
            parent = torch.as_strided(x, (T, L // c, c), (L, c, 1), 0)
            part = self._parents[key] = moments(parent, False)                               # (5, T, pieces)
            self._parent_refs.append(parent)
        o = x.storage_offset() // c
        p = part[:, :, o:o + width // c]
        return torch.stack([p[0].sum(-1), p[1].sum(-1), p[2].amin(-1), p[3].amax(-1), p[4].sum(-1)])

    def forget_parents(self) -> None:
        """A replace hook ran: a tensor may have changed in place, so no cached parent moments are reused."""
        self._parents, self._parent_refs = {}, []

    def add_values(self, name: str, layer: int | None, values: torch.Tensor) -> None:
        """Queue statistics already computed, (T, 7) (a stage reduced without being materialised); they keep
        their place in forward order."""
        if self._queue and self._rows != values.shape[0]:
            self.flush()
        self._rows = values.shape[0]
        self._queue.append([name, layer, None, None, values])

    def flush(self) -> None:
        if not self._queue:
            return
        queue, self._queue, self._queued = self._queue, [], 0
        self._parents, self._parent_refs = {}, []
        T = self._rows
        groups: dict[tuple, list[int]] = {}
        reduced, final = [], []
        for i, (_, _, x, masked, part) in enumerate(queue):
            if masked is None:
                final.append(i)
            elif part is not None:
                reduced.append(i)
            else:
                groups.setdefault((x.shape, x.dtype, masked), []).append(i)
        order, parts, tensors = list(reduced), [], [(queue[i][2], queue[i][3]) for i in reduced]
        if reduced:
            parts.append(torch.stack([queue[i][4] for i in reduced], 1))                      # (5, g, T)
        for (_, _, masked), idx in groups.items():
            xs = [queue[i][2] for i in idx]
            X = (torch.stack(xs) if len(xs) > 1 else xs[0][None]).reshape(len(idx), T, -1)       # (g, T, n)
            parts.append(moments(X.float(), masked))
            order += idx
            tensors += [(X, masked, j) for j in range(len(idx))]
        out = torch.empty(len(queue), T, 7, device=(parts[0] if parts else queue[final[0]][4]).device)
        if order:
            stats = _from_moments(torch.cat(parts, 1) if len(parts) > 1 else parts[0], tensors, T)   # (G', T, 7)
            if len(order) == len(queue) and order == sorted(order):
                out = stats
            else:
                out[torch.tensor(order, device=out.device)] = stats
        for i in final:
            out[i] = queue[i][4]
        self._pending.append(([q[0] for q in queue], [q[1] for q in queue], out))

    def take(self, step: int, pos0: int) -> list[StatsBlock]:
        """Flush and move results to the CPU (one transfer per flush)."""
        self.flush()
        pending, self._pending = self._pending, []
        return [StatsBlock(step, pos0, names, layers, out.cpu()) for names, layers, out in pending]


def moments(X: torch.Tensor, masked: bool | None = False, dims: tuple[int, ...] = (-1,)) -> torch.Tensor:
    """X -> (5, ...): per row (reducing `dims`) Σx, Σx², min, max and the count of values taken (-inf mask
    entries of a masked stage are left out). Four vectorised read-only passes when nothing is masked."""
    shape = [s for d, s in enumerate(X.shape) if d not in {i % X.dim() for i in dims}]
    out = torch.empty((5, *shape), device=X.device, dtype=X.dtype)
    if masked:
        keep = X != float("-inf")
        X0 = torch.where(keep, X, 0.0)
        torch.amin(torch.where(keep, X, float("inf")), dims, out=out[2])
        torch.sum(keep, dims, out=out[4])
    else:
        X0 = X
        torch.amin(X, dims, out=out[2])
        out[4] = math.prod(X.shape[d] for d in dims)
    torch.sum(X0, dims, out=out[0])
    torch.linalg.vector_norm(X0, dim=dims, out=out[1])
    torch.amax(X, dims, out=out[3])
    out[1].square_()
    return out


def _from_moments(part: torch.Tensor, tensors: list[tuple], T: int) -> torch.Tensor:
    """(5, G, T) moments -> (G, T, 7) statistics; the few rows moments cannot give exactly (a NaN or Inf,
    cancellation, nothing unmasked) from dense_stats of the tensor they came from (tensors[g])."""
    s1, s2, lo, hi, n = part
    mean = s1 / n
    var = s2 / n - mean * mean
    exact = ~torch.isfinite(s2) | (var < CANCELLATION * mean * mean) | (n == 0)
    zero = torch.zeros_like(mean)
    out = torch.stack([lo, hi, mean, var.clamp(min=0).sqrt(), torch.maximum(lo.abs(), hi.abs()), zero, zero], -1)
    if bool(exact.any()):
        for g in exact.any(1).nonzero().flatten().tolist():
            src = tensors[g]
            x = src[0] if len(src) == 2 else src[0][src[2]]
            out[g] = dense_stats(x.reshape(T, -1).float(), bool(src[1]))     # (a strided view is copied here)
    return out


def dense_stats(X: torch.Tensor, masked: bool = False) -> torch.Tensor:
    """X (..., n) -> (..., 7) statistics over the last axis.

    Kernel choice matters on the CPU: sum / amax / amin / vector_norm vectorise, while std_mean and
    aminmax ran 10-30x slower on these shapes. A finite sum of every row proves every value is finite
    (any NaN or Inf would poison it), so the common case costs four reductions and one subtraction."""
    if masked:
        out = _masked_fast(X)
        if out is not None:
            return out
    s1 = X.sum(-1)
    if bool(torch.isfinite(s1).all()):
        mean = s1 / X.shape[-1]
        std = torch.linalg.vector_norm(X - mean.unsqueeze(-1), dim=-1) / X.shape[-1] ** 0.5
        lo, hi = X.amin(-1), X.amax(-1)
        zero = torch.zeros_like(mean)
        return torch.stack([lo, hi, mean, std, torch.maximum(lo.abs(), hi.abs()), zero, zero], dim=-1)
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


def _masked_fast(X: torch.Tensor) -> torch.Tensor | None:
    """Statistics of a masked stage (attention scores, sampler cuts) whose only non-finite values are the
    -inf mask entries, which are left out. None when other non-finite values are present."""
    mask = X == float("-inf")
    X0 = X.masked_fill(mask, 0.0)
    s1 = X0.sum(-1)
    if not bool(torch.isfinite(s1).all()):
        return None
    n = (~mask).sum(-1)
    none = n == 0
    mean = s1 / n.clamp(min=1)
    std = torch.linalg.vector_norm((X0 - mean.unsqueeze(-1)).masked_fill(mask, 0.0), dim=-1) / n.clamp(min=1).sqrt()
    lo, hi = X.masked_fill(mask, float("inf")).amin(-1), X.amax(-1)
    mean, std = mean.masked_fill(none, float("nan")), std.masked_fill(none, float("nan"))
    zero = torch.zeros_like(mean)
    return torch.stack([lo, hi, mean, std, torch.maximum(lo.abs(), hi.abs()), zero, zero], dim=-1)
