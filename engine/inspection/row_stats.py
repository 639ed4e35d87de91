"""Row statistics: one interface, its backends, and the one rule for what a backend declines.

A forward's stage statistics (engine.inspection.stats.StatsBatcher) and attention statistics
(engine.inspection.attention_stats) are computed by a `StatsBackend`:

- `queue(alloc)`: a `StatsQueue` for one batcher (one probe's forward calls), holding what that backend keeps
  between a stage being offered and the flush. alloc(rows) gives (rows, 7) float32 CPU tensors for results
  (StatsBatcher.rows_out, one arena).
- `attention(qh, keys, values, mask, off, want, alloc)`: the statistics of one layer's attention scores and
  pattern (engine.inspection.attention_blocks.AttentionView `want`) as a source of statistics for the
  batcher's one door (engine.inspection.stats: Given, or a PendingAttention resolved at the flush), giving
  exactly the stages `want` asks statistics of; None when declined. qh (H, T, hd), keys and values (K, S, hd);
  off: the causal offset (query t sees keys s <= off + t), None for another mask; alloc as for queue.

A `StatsQueue` has `add(entry, x, masked)` (take stage tensor x (T, ...) or (n,) as entry number `entry`:
the elements it holds toward the batcher's flush bound, or None when this backend does not take x), `cut()`
(a replace hook is about to run: nothing offered so far may be read again later) and `finish(T)` (the
statistics of every stage it took: a list of blocks (entries, values, declined), values a (G, T, 7) tensor or
a list of (T, 7) tensors, declined the (index into values, tensor (T, ...), masked[, rows]) of each stage it
could not give exactly: rows, a (T,) bool, names the rows declined, whose values alone are replaced (a row's
statistics must not depend on the rows beside it: batch invariance); without it, or None, every row).

The rule: a backend declines what it cannot give exactly (a NaN or Inf, a mean that dwarfs the spread, a row
with nothing unmasked) or has no kernel for; a stage no backend takes, or that one declines, gets REFERENCE's
statistics (the two-pass, NaN-aware engine.inspection.reference_stats), and so does an attention layer every
backend declines. The backends:

- REFERENCE: the two-pass path for every tensor, the materialised attention blocks for every layer;
- PYTORCH: the fast PyTorch path (engine.inspection.moment_stats), blocked causal attention combined at the
  flush (engine.inspection.attention_partials.PendingAttention);
- engine.native.inspect.NATIVE: one native pass (engine/native/inspect.c) for float32 CPU tensors;
- chain(a, b): a, and b for what a has no kernel for (engine.accelerator: native, then PyTorch).

Which one a model uses is chosen once, when it is built (engine.accelerator.stats_backend), and handed to each
probe at the start of a forward call; nothing else asks which one it is."""
from __future__ import annotations

from typing import Callable

import torch

from engine.inspection.attention_stats import exact_source, pending_source
from engine.inspection.moment_stats import MomentsQueue
from engine.inspection.reference_stats import exact_rows

Alloc = Callable[[int], torch.Tensor]


class StatsBackend:
    """The interface (see the module docstring); this base declines everything."""
    name = "none"

    def queue(self, alloc: Alloc) -> "StatsQueue":
        return StatsQueue()

    def attention(self, qh: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None,
                  mask: torch.Tensor | None, off: int | None, want, alloc: Alloc):
        return None


class StatsQueue:
    """A queue that takes nothing (see the module docstring for the interface)."""

    def add(self, entry: int, x: torch.Tensor, masked: bool) -> int | None:
        return None

    def cut(self) -> None:
        return None

    def finish(self, T: int) -> list[tuple]:
        return []


class _ReferenceQueue(StatsQueue):
    def __init__(self) -> None:
        self._entries: list[int] = []
        self._xs: list[tuple[torch.Tensor, bool]] = []

    def add(self, entry: int, x: torch.Tensor, masked: bool) -> int:
        self._entries.append(entry)
        self._xs.append((x if x.dim() > 1 else x.reshape(1, -1), masked))
        return x.numel()

    def finish(self, T: int) -> list[tuple]:
        entries, xs, self._entries, self._xs = self._entries, self._xs, [], []
        return [(entries, [exact_rows(x, masked) for x, masked in xs], [])] if entries else []


class _Reference(StatsBackend):
    name = "reference"

    def queue(self, alloc: Alloc) -> StatsQueue:
        return _ReferenceQueue()

    def attention(self, qh, keys, values, mask, off, want, alloc):
        return exact_source(qh, keys, mask, want)


class _PyTorch(StatsBackend):
    name = "pytorch"

    def queue(self, alloc: Alloc) -> StatsQueue:
        return MomentsQueue()

    def attention(self, qh, keys, values, mask, off, want, alloc):
        return pending_source(qh, keys, off, want)


class _ChainQueue(StatsQueue):
    def __init__(self, queues: tuple[StatsQueue, ...]) -> None:
        self._queues = queues

    def add(self, entry: int, x: torch.Tensor, masked: bool) -> int | None:
        for q in self._queues:
            held = q.add(entry, x, masked)
            if held is not None:
                return held
        return None

    def cut(self) -> None:
        for q in self._queues:
            q.cut()

    def finish(self, T: int) -> list[tuple]:
        return [block for q in self._queues for block in q.finish(T)]


class _Chain(StatsBackend):
    def __init__(self, backends: tuple[StatsBackend, ...]) -> None:
        self.backends = backends
        self.name = "+".join(b.name for b in backends)

    def queue(self, alloc: Alloc) -> StatsQueue:
        return _ChainQueue(tuple(b.queue(alloc) for b in self.backends))

    def attention(self, qh, keys, values, mask, off, want, alloc):
        for b in self.backends:
            source = b.attention(qh, keys, values, mask, off, want, alloc)
            if source is not None:
                return source
        return None


def chain(*backends: StatsBackend) -> StatsBackend:
    """A backend that gives each tensor (and attention layer) to the first of backends that takes it."""
    return _Chain(backends)


REFERENCE: StatsBackend = _Reference()
PYTORCH: StatsBackend = _PyTorch()
