"""Recording: what a probe saw in one run, apart from the probe that watched (as TransformerLens keeps its hooks
apart from its ActivationCache).

A Probe (engine.inspection.probe) is a run's configuration and hook machinery: what to watch, what to replace.
It fills one Recording as the run goes: statistics blocks, captured tensors, timing marks, and what it was
asked to watch (Watched: data only; replace functions and weight overrides are code and stay with the probe).
The run record (engine.inspection.trace.Trace) keeps the Recording, never the probe, and a trace file reopens
one through this constructor.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.inspection.stat_columns import nonfinite
from engine.inspection.stats import StatRecord, StatsBlock

CaptureSpec = tuple[tuple[str, ...], "frozenset | None", "frozenset | None"]   # patterns, layers, positions


@dataclass
class Capture:
    step: int
    name: str
    layer: int | None
    positions: list[int]     # absolute positions of the rows kept
    value: Any               # tensor on the CPU (or a str / int for tokenizer and detokenizer stages)


@dataclass(frozen=True)
class Watched:
    """What a probe was asked to watch, as data: statistics patterns, capture patterns (with their layers and
    positions), timing, and a run-only RMSNorm epsilon."""
    timing: bool = False
    stats_specs: tuple[str, ...] = ()
    capture_specs: tuple[CaptureSpec, ...] = ()
    norm_eps: float | None = None


@dataclass(eq=False)
class Recording:
    """What one run's probe saw: statistics (StatsBlocks in forward order), captures, timing marks
    (step, label, seconds since the call started), what was watched, and where the last forward call stood
    (its step and first absolute position)."""
    stats: list[StatsBlock] = field(default_factory=list)
    captures: list[Capture] = field(default_factory=list)
    marks: list[tuple[int, str, float]] = field(default_factory=list)
    watched: Watched = field(default_factory=Watched)
    step: int = 0
    pos0: int = 0

    def captured(self, name: str, step: int | None = None) -> list[Capture]:
        return [c for c in self.captures if c.name == name and (step is None or c.step == step)]

    def stat_records(self, name: str | None = None) -> list[StatRecord]:
        """Statistics as one record per (call, stage), in forward order; optionally of one stage only."""
        return [StatRecord(b.step, n, layer, b.pos0, b.values[g]) for b in self.stats
                for g, (n, layer) in enumerate(zip(b.names, b.layers)) if name is None or n == name]

    def first_nonfinite(self) -> tuple[StatRecord, int] | None:
        """The first stage (in forward order) holding a NaN or Inf, and the absolute position where it is."""
        for b in self.stats:
            bad = nonfinite(b.values)                                             # (G, T)
            if bool(bad.any()):
                g, t = (int(v) for v in bad.nonzero()[0])
                return StatRecord(b.step, b.names[g], b.layers[g], b.pos0, b.values[g]), b.pos0 + t
        return None
