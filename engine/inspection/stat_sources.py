"""Sources of statistics: what the statistics batcher's one door (engine.inspection.stats.StatsBatcher.add)
takes besides a stage's tensor, for stages whose statistics were computed without materialising them.

A source gives the statistics of one or more consecutive stages in forward order. It has `rows` (T), `elements`
(what it holds toward the batcher's flush bound; with `device` when not 0), `stage_values()` (each stage's
(T, 7) statistics, a sequence or a (G, T, 7) tensor, once resolved) and a static `resolve(sources)` that the
batcher calls once per flush with every source of that kind, so that they are combined together. Given is the
source of statistics already computed; engine.inspection.attention_partials.PendingAttention is one still to
be combined.
"""
from __future__ import annotations


class Given:
    """A source of statistics already computed: values (G, T, 7), or a list of G (T, 7) tensors, in forward order."""
    elements = 0                     # holds nothing toward the flush bound

    def __init__(self, values) -> None:
        self.values = values
        self.rows = values[0].shape[0]

    def stage_values(self):
        return self.values

    @staticmethod
    def resolve(sources: list["Given"]) -> None:
        return None
