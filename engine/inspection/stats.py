"""Per-position statistics of many stage tensors, computed on the device in a handful of ops.

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
- a stage offered as the very tensor the previous stage was (a sampler stage that changed nothing: top-k 0,
  top-p 1, ...) reuses that stage's moments.

The variance comes from the moments (Σx²/n - mean²) and is exact to fp32 rounding unless the mean dwarfs
the spread; such rows, rows holding a NaN or Inf (whose sums are not finite), and fully masked rows are
recomputed at the flush by dense_stats, the two-pass, NaN-aware reference. So the usual case costs four
reductions per stage and no host round trip before the flush.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch

from engine.inspection.row_stats import PYTORCH, StatsBackend

FLUSH_ELEMENTS = 1 << 23  # flush the queue past this many queued elements, bounding the memory it holds
FLUSH_ELEMENTS_DEVICE = 1 << 25   # on an accelerator: a flush waits for the device, so fewer of them
IMMEDIATE_ELEMENTS = 1 << 15   # a tensor this large is reduced to its moments when offered
BACKEND_BYTES = 8 << 20         # on the CPU in fp32 (unmasked), any tensor is queued, until the storage the queue
                               # keeps alive reaches this, for one native call (engine/native/inspect.c) giving
                               # their statistics; a larger one goes at once
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
    """Stage tensors offered in forward order -> StatsBlocks, one per flush (see the module docstring)."""

    def __init__(self, backend: StatsBackend = PYTORCH) -> None:
        self.backend = backend               # set per forward call by the model (engine.accelerator)
        self._names: list[str] = []          # every entry since the last flush, in the order offered
        self._layers: list[int | None] = []
        self._small: dict[tuple, tuple[list[int], list[torch.Tensor]]] = {}  # (shape, dtype, masked) -> entries, xs
        self._reduced: list[tuple] = []      # (entry, x, masked, moments): reduced when offered
        self._final: list[tuple[int, torch.Tensor]] = []   # (entry, (T, 7) statistics given as they are)
        self._rows = 0
        self._queued = 0
        self._limit = 0
        self._last: tuple | None = None       # (x, masked, moments) of the last tensor reduced when offered
        self._order: tuple = ([], None, None)     # a flush's row order, its device and its index tensor
        self._pending: list[tuple[list[str], list, torch.Tensor]] = []
        self._fast: list[tuple] = []          # (entry, x, layout) waiting for _run_backend
        self._fast_bytes = 0
        self._arena: torch.Tensor | None = None   # (rows, 7) results of native passes (see rows_out)
        self._arena_used = 0

    def add(self, name: str, layer: int | None, x: torch.Tensor, masked: bool = False) -> None:
        """Queue x (T, ...) for statistics. masked: -inf entries are mask values, left out of every statistic.
        x is kept until the flush (a small one is reduced there; any may need the exact path)."""
        if x.requires_grad:
            x = x.detach()
        shape = x.shape
        rows = shape[0] if len(shape) > 1 else 1
        if rows != self._rows:
            if self._names:
                self.flush()
            self._rows = rows
        n = x.numel()
        entry = len(self._names)
        self._names.append(name)
        self._layers.append(layer)
        x2 = x if len(shape) > 1 else x.reshape(1, -1)
        lay = None if masked else self.backend.layout(x2)
        if lay is not None:                         # native statistics (engine/native/inspect.c)
            self._last = None
            self._fast.append((entry, x2, lay))   # for one pass with the next few (see _run_backend)
            self._fast_bytes += 8 * n             # what the queue keeps alive: a view's base (q of qkv, gate
            if self._fast_bytes >= BACKEND_BYTES:  # of gate_up) is about twice the view
                self._run_backend()
            return
        if n < IMMEDIATE_ELEMENTS:
            key = (shape, x.dtype, masked)
            group = self._small.get(key)
            if group is None:
                group = self._small[key] = ([], [])
            group[0].append(entry)
            group[1].append(x)
        else:
            self._reduced.append((entry, x, masked, self._moments_now(x, masked)))
        self._queued += n
        if self._queued >= (self._limit or self._set_limit(x)):
            self.flush()

    def _moments_now(self, x: torch.Tensor, masked: bool) -> tuple:
        last = self._last
        if last is not None and last[0] is x and last[1] == masked:
            return last[2]                    # the very tensor the stage before offered: the same moments
        x2 = x if x.dim() > 1 else x.reshape(1, -1)
        part = moments(x2 if x2.dtype == torch.float32 else x2.float(), masked, tuple(range(1, x2.dim())))
        self._last = (x, masked, part)
        return part

    def _set_limit(self, x: torch.Tensor) -> int:
        self._limit = FLUSH_ELEMENTS if x.device.type == "cpu" else FLUSH_ELEMENTS_DEVICE
        return self._limit

    def forget_moments(self) -> None:
        """A replace hook is about to run: a tensor may change in place, so no moments taken earlier are reused
        and the tensors queued for the native pass are reduced now, as they were offered."""
        self._last = None
        if self._fast:
            self._run_backend()

    def add_values(self, name: str, layer: int | None, values: torch.Tensor) -> None:
        """Queue statistics already computed, (T, 7) (a stage reduced without being materialised); they keep
        their place in forward order."""
        if self._names and self._rows != values.shape[0]:
            self.flush()
        self._rows = values.shape[0]
        self._final.append((len(self._names), values))
        self._names.append(name)
        self._layers.append(layer)

    def add_block(self, names: list[str], layers: list, values: torch.Tensor) -> None:
        """Statistics of several whole stages already computed, (G, T, 7) in forward order (the native decode
        step): whatever was queued before is flushed first, so the order holds."""
        self.flush()
        self._pending.append((list(names), list(layers), values))

    def add_pending(self, names: tuple[str, ...], layer: int | None, pending) -> None:
        """Queue statistics still to be combined (attention_stats.PendingAttention: pending.wanted says
        which of names it gives, pending.rows its positions; type(pending).resolve(all of them) sets each
        one's .values). They are resolved together at the flush and keep their place in forward order."""
        if self._names and self._rows != pending.rows:
            self.flush()
        self._rows = pending.rows
        for which, (name, wanted) in enumerate(zip(names, pending.wanted)):
            if wanted:
                self._final.append((len(self._names), (pending, which)))
                self._names.append(name)
                self._layers.append(layer)
        self._queued += pending.elements
        if self._queued >= (self._limit or self._set_limit(pending.q)):
            self.flush()

    def rows_out(self, rows: int) -> torch.Tensor:
        """(rows, 7) float32 on the CPU for native results: a view into an arena of at least 64 stages' rows.
        Thousands of small result tensors kept to the flush, each allocated between a forward's large
        temporaries, fragment the heap (a 2,048-token inspection grew ~20 MB a layer); a few arenas do not."""
        a, used = self._arena, self._arena_used
        if a is None or used + rows > a.shape[0]:
            a, used = torch.empty(max(64 * rows, 4096), 7), 0
            self._arena = a
        self._arena_used = used + rows
        return a[used:used + rows]

    def _run_backend(self) -> None:
        """Final statistics of the large tensors queued since the last call, in one native call (a layer's
        stages are still in the last-level cache); a tensor holding a NaN or Inf, or every tensor when the
        library is missing, takes the moments path instead."""
        queue, self._fast, self._fast_bytes = self._fast, [], 0
        values = self.backend.rows([q[1] for q in queue], self.rows_out, [q[2] for q in queue])
        for i, (entry, x, _) in enumerate(queue):
            v = None if values is None else values[i]
            if v is not None:
                self._final.append((entry, v))
            else:
                self._reduced.append((entry, x, False, moments(x, False, tuple(range(1, x.dim())))))

    def flush(self) -> None:
        if self._fast:
            self._run_backend()
        if not self._names:
            return
        names, layers, reduced, small, final = self._names, self._layers, self._reduced, self._small, self._final
        final.sort(key=lambda e: e[0])        # native results join after stages offered later (forward order)
        self._names, self._layers, self._reduced, self._small, self._final = [], [], [], {}, []
        self._queued, self._last = 0, None
        T = self._rows
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
        if order:
            parts = [torch.cat(c) for c in zip(*cols)] if len(cols) > 1 else cols[0]
            stats = _from_moments(parts, sources, T)                                           # (G', T, 7)
        given = _final_values(final) if final else None                                       # (F, T, 7)
        index = self._index(order, stats.device) if order else None
        if index is None and given is None:
            out = stats
        elif not order and len(final) == len(names):
            out = given
        else:
            out = torch.empty(len(names), T, 7, device=(stats if order else given).device)
            if order:
                out[index if index is not None else slice(0, len(order))] = stats
            if final:
                out[_on([i for i, _ in final], out.device)] = given
        self._pending.append((names, layers, out))

    def _index(self, order: list[int], device) -> torch.Tensor | None:
        """order as an index tensor, or None when it is 0, 1, 2, ... (the same order as the last flush's reuses
        its tensor: every decode step has the same one)."""
        if order == self._order[0] and device == self._order[1]:
            return self._order[2]
        index = None if order == list(range(len(order))) else _on(order, device)
        self._order = (order, device, index)
        return index

    def take(self, step: int, pos0: int) -> list[StatsBlock]:
        """Flush and move results to the CPU (one transfer per flush)."""
        self.flush()
        pending, self._pending = self._pending, []
        return [StatsBlock(step, pos0, names, layers, out.cpu()) for names, layers, out in pending]


def _final_values(final: list[tuple]) -> torch.Tensor:
    """(g, T, 7) from entries given as statistics or as (pending, which) (resolved here, all together)."""
    pending = list({id(v[0]): v[0] for _, v in final if isinstance(v, tuple) and v[0].values[v[1]] is None}.values())
    if pending:
        type(pending[0]).resolve(pending)
    return torch.stack([v[0].values[v[1]] if isinstance(v, tuple) else v for _, v in final])


def moments(X: torch.Tensor, masked: bool | None = False, dims: tuple[int, ...] = (-1,)) -> tuple:
    """X -> per row (reducing `dims`) Σx, ‖x‖ (squared at the flush, once for every stage), min, max and the
    count of values taken: a Python int, or a float tensor where -inf mask entries of a masked stage are left
    out. Four plain read-only reductions when nothing is masked (no out= views, no count tensor: each op
    costs microseconds of dispatch at decode sizes). A masked stage on the CPU first checks its sums: finite
    sums prove no row holds a -inf (nor any NaN or Inf), so nothing is masked and the same four suffice."""
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


def _on(values: list, device, dtype=torch.long) -> torch.Tensor:
    """A small tensor of Python numbers on the device; to an accelerator through pinned memory without waiting
    (a plain copy from pageable memory would wait for the device: a host round trip per flush)."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def _counts(ns: list, T: int, device) -> torch.Tensor:
    """Counts of the stages reduced when offered, (g, T): Python ints (unmasked) or (T,) tensors (masked)."""
    if all(isinstance(n, int) for n in ns):
        return _on(ns, device, torch.float32)[:, None].expand(len(ns), T)
    return torch.stack([n if isinstance(n, torch.Tensor) else torch.full((T,), float(n), device=device) for n in ns])


def _from_moments(parts: list[torch.Tensor], sources: list[tuple], T: int) -> torch.Tensor:
    """Moments [Σx, ‖x‖, min, max, count], each (G, T) -> (G, T, 7) statistics. The few rows moments cannot
    give exactly (a NaN or Inf, cancellation, nothing unmasked) come from dense_stats of the tensor they were
    taken from: sources holds (first row, tensor, masked, False) per tensor reduced when offered and (first
    row, stacked tensors (g, T, n), masked, True) per group reduced at the flush."""
    s1, norm, lo, hi, n = parts
    mean = s1 / n
    var = norm.square() / n - mean * mean
    exact = ~((var >= CANCELLATION * mean * mean) & (var < float("inf")))     # NaN, Inf, cancellation, n == 0
    zero = torch.zeros_like(mean)
    out = torch.stack([lo, hi, mean, var.clamp(min=0).sqrt(), torch.maximum(lo.abs(), hi.abs()), zero, zero], -1)
    if bool(exact.any()):
        starts = [src[0] for src in sources]
        for g in exact.any(1).nonzero().flatten().tolist():
            first, x, masked, stacked = sources[bisect.bisect_right(starts, g) - 1]
            x = x[g - first] if stacked else x
            out[g] = dense_stats(x.reshape(T, -1).float(), bool(masked))     # (a strided view is copied here)
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
