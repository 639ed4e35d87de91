"""The statistics batcher: stage tensors offered in forward order -> StatsBlocks, one per flush.

It only queues and orders, and everything enters through one door, `add`: each stage takes the next entry
number there, and its statistics land in that row of the flush's block (nothing is sorted afterwards). A stage
tensor goes to the probe's statistics backend (engine.inspection.row_stats, chosen once per model by
engine.accelerator) through that backend's queue; a source of statistics already computed (Given: a fused
step's block, attention statistics given whole) or still to be combined (attention_partials.PendingAttention)
takes its stages' entries in the same order. At a flush it asks the queue for what it took, gives every stage
the backend declined, or that no backend took, the reference statistics (engine.inspection.reference_stats:
the rule of engine.inspection.row_stats), and resolves the sources, each kind once for all of them. Results go
into one (G, T, 7) tensor per flush, in forward order, on the device of the stages.
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
        self._sources: list[tuple[int, object]] = []   # (first entry, a source of statistics: Given, pending)
        self._untaken: list[tuple] = []      # (entry, tensor, masked) no backend took: the reference's at the flush
        self._rows = 0
        self._queued = 0
        self._limit = 0
        self._order: tuple = ([], None, None)     # a flush's row order, its device and its index tensor
        self._done: list[tuple[list[str], list, torch.Tensor]] = []   # flushed blocks, waiting for take
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

    def add(self, name, layer, x, masked: bool = False) -> None:
        """The one door, in forward order. x is either a stage's tensor (T, ...) or (n,) (name: the stage, layer:
        its block; masked: -inf entries are mask values, left out of every statistic), kept until the flush and
        reduced by the backend's queue or the reference; or a source of statistics of several consecutive stages
        (name and layer: their lists), already computed (Given) or still to be combined
        (engine.inspection.attention_partials.PendingAttention), resolved at the flush. Each stage takes the
        next entry number; its statistics land in that row of the flush's block."""
        if not isinstance(x, torch.Tensor):
            return self._add_source(name, layer, x)
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
            if self._queued >= (self._limit or self._set_limit(x.device)):
                self.flush()

    def _add_source(self, names: list[str], layers: list, source) -> None:
        if self._names and self._rows != source.rows:
            self.flush()
        self._rows = source.rows
        self._sources.append((len(self._names), source))
        self._names += names
        self._layers += layers
        if source.elements:
            self._queued += source.elements
            if self._queued >= (self._limit or self._set_limit(source.device)):
                self.flush()

    def _set_limit(self, device) -> int:
        self._limit = FLUSH_ELEMENTS if device.type == "cpu" else FLUSH_ELEMENTS_DEVICE
        return self._limit

    def forget_moments(self) -> None:
        """A replace hook is about to run: a tensor may change in place, so the backend reads nothing offered
        so far again (what it queued is reduced now, as it was offered)."""
        self._queue.cut()

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
        final, order, stacked = [], [], []
        for entries, values, declined in self._queue.finish(T):
            for i, x, masked, *rows in declined:
                exact = exact_rows(x, masked)     # a row's are the same whatever rows are beside it (dense_stats)
                if rows and rows[0] is not None and values[i] is not None:
                    values[i][rows[0]] = exact[rows[0]].to(values[i].dtype)     # only the rows declined
                else:
                    values[i] = exact
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
        names, layers, sources = self._names, self._layers, self._sources
        self._names, self._layers, self._sources = [], [], []
        self._queued = 0
        if not (order or final) and len(sources) == 1:      # one source gave every stage (the native decode
            self._done.append((names, layers, _whole(sources[0][1])))   # step, a batched step's row)
            return
        final += _source_values(sources)
        index = self._index(order, stats.device) if order else None
        at = [i for i, _ in final]
        given = torch.stack([v for _, v in final]) if final else None                      # (F, T, 7)
        if index is None and not final:
            out = stats
        elif not order and at == list(range(len(names))):
            out = given
        else:
            out = torch.empty(len(names), T, 7, device=(stats if order else given).device)
            if order:
                out[index if index is not None else slice(0, len(order))] = stats
            if final:
                out[small_tensor(at, out.device)] = given
        self._done.append((names, layers, out))

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
        done, self._done = self._done, []
        return [StatsBlock(step, pos0, names, layers, out.cpu()) for names, layers, out in done]


def _source_values(sources: list[tuple[int, object]]) -> list[tuple[int, torch.Tensor]]:
    """(entry, (T, 7)) of every stage the sources give, each kind of source resolved once, all together."""
    kinds: dict[type, list] = {}
    for _, src in sources:
        kinds.setdefault(type(src), []).append(src)
    for kind, group in kinds.items():
        kind.resolve(group)
    return [(first + g, v) for first, src in sources for g, v in enumerate(src.stage_values())]


def _whole(source) -> torch.Tensor:
    """The (G, T, 7) values of a flush that one source fills entirely."""
    type(source).resolve([source])
    values = source.stage_values()
    return values if isinstance(values, torch.Tensor) else torch.stack(list(values))
