"""The probe a forward offers its stages to, declared: StageSink (what every probe form answers), BlockSink (one
block's view: engine.inspection.probe_views.LayerProbe, a batch's FanLayer, NoProbe) and RunSink (what a forward
call is handed: engine.inspection.probe.Probe, NoProbe, a batch's FanProbe and SegmentProbe). The forward asks no
form what it is (tests/unit/test_cache_forms.py holds each form to its protocol)."""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class StageSink(Protocol):
    """A stage offered by name: the tensor the forward goes on with (a replace hook's, or x itself), and what the
    stage needs of it (engine.inspection.probe_views: NONE, STATS, ROWS, FULL), so a costly one is made only when
    asked for."""

    def __call__(self, name: str, x: Any) -> Any: ...

    def need(self, name: str) -> int: ...


@runtime_checkable
class BlockSink(StageSink, Protocol):
    """One block's view (stage names without the "blocks.{i}." prefix). guards_nan: rows must not see a NaN or an
    Inf of keys they do not read (the fused attention then checks; engine.attention.fused)."""
    guards_nan: bool


@runtime_checkable
class RunSink(StageSink, Protocol):
    """What one forward call is handed: its blocks' views, the weights and epsilon it runs with, whether a fused
    native step serves it (and that step's values), its position, its timing marks."""
    timing: bool
    norm_eps: float | None

    def layer(self, i: int) -> BlockSink: ...

    def weight(self, name: str, original: torch.Tensor) -> torch.Tensor: ...

    def layer_weights(self, i: int, lw): ...

    def served_by(self, names: list[str]) -> bool: ...

    def offer_step(self, names: list[str], layers: list, values, logits: torch.Tensor, marks, start: float) -> None:
        ...

    def move_to(self, pos0: int) -> None: ...

    def mark(self, label: str) -> None: ...
