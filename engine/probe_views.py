"""What the forward talks to: one block's view of a probe (LayerProbe, which adds the "blocks.{i}." prefix)
and the stand-in used when there is no probe (NoProbe, every stage a no-op)."""
from __future__ import annotations

from typing import Any

import torch

from .stages import LAYER_STAGES

# What a stage needs of its tensor (ordered): nothing; statistics only; some rows (captures limited to
# positions); the whole tensor (a replace hook, or a full capture). The forward may skip materialising a
# costly stage (attention scores / pattern) for anything short of FULL.
NONE, STATS, ROWS, FULL = 0, 1, 2, 3


class LayerProbe:
    """One block's view of a probe; the only place the "blocks.{i}." prefix is added to a stage name."""
    guards_nan = True    # rows must not see NaN/Inf from keys they do not attend to (the fused path checks)
    __slots__ = ("probe", "names", "quick")

    def __init__(self, probe, i: int) -> None:     # probe: engine.probe.Probe
        self.probe = probe
        self.names = {stage: f"blocks.{i}.{stage}" for stage in LAYER_STAGES}
        self.quick: dict[str, tuple | None] = {}   # stage -> its plan when that is statistics only, else None

    def __call__(self, stage: str, x: Any) -> Any:
        """A stage that only wants statistics goes straight to the batcher (~500 calls per decode step);
        everything else through the probe."""
        quick = self.quick.get(stage, False)
        if quick is False:
            plan = self.probe.plan(self.names[stage])
            quick = self.quick[stage] = (self.names[stage], plan) if plan.need in (NONE, STATS) else None
        if quick is None or not self.probe.active:
            return self.probe(self.names[stage], x)
        name, plan = quick
        if plan.need == STATS and isinstance(x, torch.Tensor) and x.is_floating_point():
            self.probe.stats_batcher.add(name, plan.layer, x.transpose(0, 1) if plan.heads_first else x, plan.masked)
        return x

    def wants(self, stage: str) -> bool:
        return self.probe.wants(self.names[stage])

    def need(self, stage: str) -> int:
        return self.probe.need(self.names[stage])

    def wants_stats(self, stage: str) -> bool:
        return self.probe.wants_stats(self.names[stage])

    def capture_positions(self, stage: str) -> list[int] | None:
        return self.probe.capture_positions(self.names[stage])

    def offer_stats(self, stage: str, values: torch.Tensor) -> None:
        self.probe.offer_stats(self.names[stage], values)

    def offer_rows(self, stage: str, x: torch.Tensor, positions: list[int]) -> None:
        self.probe.offer_rows(self.names[stage], x, positions)

    @property
    def pos0(self) -> int:
        return self.probe.pos0


class NoProbe:
    """What the forward talks to when no probe is given: every stage passes through unchanged, so the
    unprobed forward is the same code as the probed one at the cost of a few no-op calls per block."""
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

    def move_to(self, pos0: int) -> None:
        pass

    def mark(self, label: str) -> None:
        pass


NO_PROBE = NoProbe()
