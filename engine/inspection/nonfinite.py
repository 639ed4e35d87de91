"""The first non-finite value of a run, read from what the probe's statistics recorded (no rerun): the stage
(forward order, earliest step) holding a NaN or Inf, and every stage's statistics at that position. The run
record (engine.inspection.trace) keeps it; the NaN doctor (engine.tools.doctor) builds on it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.inspection.plans import split_name
from engine.inspection.recording import Recording
from engine.inspection.stat_columns import STAT_NAMES


@dataclass
class FirstNonFinite:
    step: int
    stage: str                 # the hook name, e.g. "blocks.17.mlp.act"
    layer: int | None
    position: int              # absolute position
    stats: dict[str, float]    # STAT_NAMES at that position

    @property
    def stage_in_layer(self) -> str:
        return split_name(self.stage)[1]

    def as_dict(self) -> dict:
        return {"step": self.step, "stage": self.stage, "layer": self.layer, "position": self.position,
                "stage_in_layer": self.stage_in_layer, "stats": self.stats}


def _stats_dict(row: torch.Tensor) -> dict[str, float]:
    return {k: float(v) for k, v in zip(STAT_NAMES, row.tolist())}


def locate_nonfinite(recording: Recording) -> FirstNonFinite | None:
    """The first stage (forward order, earliest step) holding a NaN or Inf, and where."""
    if (hit := recording.first_nonfinite()) is None:
        return None
    rec, pos = hit
    return FirstNonFinite(rec.step, rec.name, rec.layer, pos, _stats_dict(rec.values[pos - rec.pos0]))


def stage_profile(recording: Recording, step: int, position: int) -> list[dict]:
    """Every stage's statistics at one position of one step, in forward order (rows: step, stage, layer, *STATS)."""
    return [{"step": b.step, "stage": name, "layer": layer, **dict(zip(STAT_NAMES, row))}
            for b in recording.stats if b.step == step and b.pos0 <= position < b.pos0 + b.values.shape[1]
            for name, layer, row in zip(b.names, b.layers, b.values[:, position - b.pos0].tolist())]


def lead_up(recording: Recording, nf: FirstNonFinite, k: int = 10) -> list[dict]:
    """The k stages before the first non-finite one (same step and position) and that stage itself."""
    rows = stage_profile(recording, nf.step, nf.position)
    i = next(j for j, r in enumerate(rows) if r["stage"] == nf.stage)
    return rows[max(0, i - k): i + 1]
