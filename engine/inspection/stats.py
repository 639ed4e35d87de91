"""The statistics batcher: stage tensors offered in forward order -> StatsBlocks, one per flush.

It only queues and orders. Each tensor goes to the probe's statistics backend (engine.inspection.row_stats,
chosen once per model by engine.accelerator) through that backend's queue; statistics already computed (a
fused step's block, attention statistics given whole or still pending) keep their place beside them. At a
flush it asks the queue for what it took and gives every stage the backend declined, or that no backend
took, the reference statistics (engine.inspection.reference_stats): the rule of engine.inspection.row_stats.
Results go into one (G, T, 7) tensor per flush, in forward order, on the device of the stages.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.inspection.moment_stats import small_tensor
from engine.inspection.reference_stats import exact_rows
from engine.inspection.row_stats import PYTORCH, StatsBackend

FLUSH_ELEMENTS = 1 << 23  # flush the queue past this many queued elements, bounding the memory it holds
FLUSH_ELEMENTS_DEVICE = 1 << 25   # on an accelerator: a flush waits for the device, so fewer of them


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
        self._names: list[str] = []          # every entry since the last flush, in the order offered
        self._layers: list[int | None] = []
        self._final: list[tuple[int, object]] = []   # (entry, (T, 7) statistics given, or (pending, which))
        self._untaken: list[tuple] = []      # (entry, tensor, masked) no backend took: the reference's at the flush
        self._rows = 0
        self._queued = 0
        self._limit = 0
        self._order: tuple = ([], None, None)     # a flush's row order, its device and its index tensor
        self._pending: list[tuple[list[str], list, torch.Tensor]] = []
        self._arena: torch.Tensor | None = None   # (rows, 7) results of native passes (see rows_out)
        self._arena_used = 0
        self._backend = backend
        self._queue = backend.queue(self.rows_out)

    @property
    def backend(self) -> StatsBackend:
        return self._backend

    @backend.setter
    def backend(self, backend: StatsBackend) -> None:
        """The backend for the stages offered from now on (set per forward call by the probe: the model's)."""
        if backend is not self._backend:
            self.flush()
            self._backend, self._queue = backend, backend.queue(self.rows_out)

    def add(self, name: str, layer: int | None, x: torch.Tensor, masked: bool = False) -> None:
        """Queue x (T, ...) for statistics. masked: -inf entries are mask values, left out of every statistic.
        x is kept until the flush (any may need the reference statistics)."""
        if x.requires_grad:
            x = x.detach()
        shape = x.shape
        rows = shape[0] if len(shape) > 1 else 1
        if rows != self._rows:
            if self._names:
                self.flush()
            self._rows = rows
        entry = len(self._names)
        self._names.append(name)
        self._layers.append(layer)
        held = self._queue.add(entry, x, masked)
        if held is None:
            self._untaken.append((entry, x if len(shape) > 1 else x.reshape(1, -1), masked))
            held = x.numel()
        if held:
            self._queued += held
            if self._queued >= (self._limit or self._set_limit(x)):
                self.flush()

    def _set_limit(self, x: torch.Tensor) -> int:
        self._limit = FLUSH_ELEMENTS if x.device.type == "cpu" else FLUSH_ELEMENTS_DEVICE
        return self._limit

    def forget_moments(self) -> None:
        """A replace hook is about to run: a tensor may change in place, so the backend reads nothing offered
        so far again (what it queued is reduced now, as it was offered)."""
        self._queue.cut()

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

    def _collect(self, T: int) -> tuple[list[int], torch.Tensor | None, list[tuple]]:
        """What the queue took, with the reference statistics wherever it declined: (entries, (G', T, 7)) of the
        blocks it gives stacked, and the rest added to the final entries (entry, (T, 7))."""
        final, order, stacked = self._final, [], []
        for entries, values, declined in self._queue.finish(T):
            for i, x, masked in declined:
                values[i] = exact_rows(x, masked)
            if isinstance(values, torch.Tensor):
                order += entries
                stacked.append(values)
            else:
                final += zip(entries, values)
        if self._untaken:
            final += [(entry, exact_rows(x, masked)) for entry, x, masked in self._untaken]
            self._untaken = []
        stats = None if not stacked else stacked[0] if len(stacked) == 1 else torch.cat(stacked)
        return order, stats, final

    def flush(self) -> None:
        if not self._names:
            return
        T = self._rows
        order, stats, final = self._collect(T)
        names, layers = self._names, self._layers
        final.sort(key=lambda e: e[0])        # results given whole join stages offered later (forward order)
        self._names, self._layers, self._final = [], [], []
        self._queued = 0
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
                out[small_tensor([i for i, _ in final], out.device)] = given
        self._pending.append((names, layers, out))

    def _index(self, order: list[int], device) -> torch.Tensor | None:
        """order as an index tensor, or None when it is 0, 1, 2, ... (the same order as the last flush's reuses
        its tensor: every decode step has the same one)."""
        if order == self._order[0] and device == self._order[1]:
            return self._order[2]
        index = None if order == list(range(len(order))) else small_tensor(order, device)
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
