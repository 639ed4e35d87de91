"""What the forward talks to: one block's view of a probe (LayerProbe, which adds the "blocks.{i}." prefix)
and the stand-in used when there is no probe (NoProbe, every stage a no-op)."""
from __future__ import annotations

import functools
from typing import Any

import torch

from engine.inspection.stages import LAYER_STAGES

# What a stage needs of its tensor (ordered): nothing; statistics only; some rows (captures limited to
# positions); the whole tensor (a replace hook, or a full capture). The forward may skip materialising a
# costly stage (attention scores / pattern) for anything short of FULL.
NONE, STATS, ROWS, FULL = 0, 1, 2, 3
_PASS, _SLOW = ("pass",), ("slow",)      # LayerProbe: a stage nothing wants; a stage the probe itself handles


@functools.lru_cache(maxsize=None)
def _layer_names(i: int) -> dict[str, str]:
    """Block i's stage names (one dict for every probe's view of block i: only read)."""
    return {stage: f"blocks.{i}.{stage}" for stage in LAYER_STAGES}


class LayerProbe:
    """One block's view of a probe (engine.inspection.stage_sink.BlockSink); the only place the "blocks.{i}." prefix
    is added to a stage name."""
    guards_nan = True    # rows must not see NaN/Inf from keys they do not attend to (the fused path checks)
    __slots__ = ("probe", "names", "quick", "needs")

    def __init__(self, probe, i: int) -> None:     # probe: engine.inspection.probe.Probe
        self.probe = probe
        self.names = _layer_names(i)
        self.quick: dict[str, tuple] = {}   # stage -> _PASS, _SLOW, or what its statistics-only plan adds
        self.needs: dict[str, int] = {}

    def __call__(self, stage: str, x: Any) -> Any:
        """A stage that only wants statistics goes straight to the batcher (~500 calls per decode step, so
        this path is a dict lookup and one call); everything else through the probe."""
        quick = self.quick.get(stage)
        if quick is None:
            quick = self._quick(stage)
        if quick is _SLOW or not self.probe.active:
            return self.probe(self.names[stage], x)
        if quick is not _PASS and isinstance(x, torch.Tensor) and x.is_floating_point():
            add, name, layer, heads_first, masked = quick
            add(name, layer, x.transpose(0, 1) if heads_first else x, masked)
        return x

    def _quick(self, stage: str) -> tuple:
        """What a call for this stage does (a view lives only as long as the probe's plans stay the same)."""
        name = self.names[stage]
        plan = self.probe.plan(name)
        if plan.need == NONE:
            quick = _PASS
        elif plan.need == STATS:
            quick = (self.probe.stats_batcher.add, name, plan.layer, plan.heads_first, plan.masked)
        else:
            quick = _SLOW
        self.quick[stage] = quick
        return quick

    def wants(self, stage: str) -> bool:
        return self.probe.wants(self.names[stage])

    def need(self, stage: str) -> int:
        need = self.needs.get(stage)
        if need is None:
            need = self.needs[stage] = self.probe.need(self.names[stage])
        return need

    def wants_stats(self, stage: str) -> bool:
        return self.probe.wants_stats(self.names[stage])

    def plan(self, stage: str):
        return self.probe.plan(self.names[stage])

    def offer_captures(self, stage: str, x: torch.Tensor) -> None:
        self.probe.offer_captures(self.names[stage], x)

    def capture_positions(self, stage: str) -> list[int] | None:
        return self.probe.capture_positions(self.names[stage])

    def offer_stats(self, stages: list[str], source) -> None:
        """Statistics of these consecutive stages from a source (see engine.inspection.probe.Probe.offer_stats)."""
        self.probe.offer_stats([self.names[s] for s in stages], source)

    def offer_rows(self, stage: str, x: torch.Tensor, positions: list[int]) -> None:
        self.probe.offer_rows(self.names[stage], x, positions)

    @property
    def pos0(self) -> int:
        return self.probe.pos0


class NoProbe:
    """What the forward talks to when no probe is given: every stage passes through unchanged, so the
    unprobed forward is the same code as the probed one at the cost of a few no-op calls per block. Both a run's
    sink and a block's (engine.inspection.stage_sink.RunSink, BlockSink)."""
    timing = False
    norm_eps = None
    guards_nan = False

    def __call__(self, name: str, x: Any) -> Any:
        return x

    def layer(self, i: int) -> "NoProbe":
        return self

    def wants(self, name: str) -> bool:
        return False

    def need(self, name: str) -> int:
        return NONE

    def weight(self, name: str, original: torch.Tensor) -> torch.Tensor:
        return original

    def layer_weights(self, i: int, lw):
        return lw

    def served_by(self, names: list[str]) -> bool:
        """Nothing to serve: a fused step computes all this forward needs."""
        return True

    def offer_step(self, names: list[str], layers: list, values, logits: torch.Tensor, marks, start: float) -> None:
        pass

    def move_to(self, pos0: int) -> None:
        pass

    def mark(self, label: str) -> None:
        pass


NO_PROBE = NoProbe()
