"""The statistics of a batched step, computed once for all its rows (engine.batch.rows.FanProbe).

A batched forward's stage tensors hold one row per run (B, ...). Every stage that some run's probe records
statistics of is reduced once, over all B rows, by one statistics batcher (engine.inspection.stats.StatsBatcher:
the model's statistics backend, row by row as for any tensor), instead of B times on each run's own row with its
many small ops. Each run gets its row's values through its own probe's one door for statistics (Probe.offer_stats
with a RowSource: a source of statistics in the sense of engine.inspection.stat_sources), in forward order, as if its
own row's tensors had been offered.

    shared = SharedStats()
    entry = shared.add(name, layer, x, masked)     # x (B, ...): its statistics are entry `entry` of every row
    source = RowSource(shared, b, b + 1)           # row b's values of the entries appended to source.entries
"""
from __future__ import annotations

import torch

from engine.inspection.stats import StatsBatcher


class SharedStats:
    """One batcher over a batched forward's rows: stage tensors (B, ...) in, (entries, B, 7) values out."""

    def __init__(self) -> None:
        self.batcher = StatsBatcher()
        self.count = 0                            # entries added
        self._blocks: list[torch.Tensor] = []     # flushed values (G, B, 7), in entry order
        self._have = 0                            # entries flushed
        self._values: torch.Tensor | None = None

    def add(self, name: str, layer: int | None, x: torch.Tensor, masked: bool) -> int:
        """Queue stage x (B, ...) (masked: -inf entries are left out); its entry number."""
        self.batcher.add(name, layer, x, masked)
        self.count += 1
        return self.count - 1

    def values(self) -> torch.Tensor:
        """(count, B, 7): every entry added so far, reduced (flushing what is still queued)."""
        if self._have < self.count:
            self._blocks += [block.values for block in self.batcher.take(0, 0)]
            self._have = self.count
            self._values = self._blocks[0] if len(self._blocks) == 1 else torch.cat(self._blocks)
        return self._values


class RowSource:
    """Rows [start, end) of some entries of a SharedStats (one run's: a decode step's row, a packed prefill's
    prompt), as one source of consecutive stages for one probe."""
    elements = 0                     # holds nothing toward the probe's flush bound (the shared batcher holds it)

    def __init__(self, shared: SharedStats, start: int, end: int) -> None:
        self.shared, self.start, self.end, self.rows = shared, start, end, end - start
        self.names: list[str] = []
        self.entries: list[int] = []
        self._values: torch.Tensor | None = None

    def stage_values(self) -> torch.Tensor:
        return self._values

    @staticmethod
    def resolve(sources: list["RowSource"]) -> None:
        for s in sources:
            values = s.shared.values()
            first, n = s.entries[0], len(s.entries)
            if s.entries[-1] - first == n - 1:                       # consecutive entries: a slice
                s._values = values[first:first + n, s.start:s.end]
            else:
                s._values = values[torch.tensor(s.entries), s.start:s.end]
