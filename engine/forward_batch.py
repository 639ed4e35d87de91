"""What one forward computes, declared: a Batch (flat token ids at their absolute positions, the Cache they attend
against, the probe that sees them, which rows' logits are wanted), as a serving engine's forward takes flat tokens
and positions. Model.forward_batch computes any Batch; its three forms are made here:

    batch = Batch.run(ids, cache, probe, pos0=cache.get_pos())   # a lone run's chunk at its cache's position
    batch = Batch.rows(ids, positions, rows, probe)               # one token of each of B runs (engine.batch.rows)
    batch = Batch.packed(ids, positions, segments, probe)         # the prompts of several runs (engine.batch.segments)

A lone run is the trivial batch: one run, its rows at consecutive positions from its cache's. The form says which
native step could compute the batch (a lone run's one token: the native decode step; one token of each run: the
native batched step); Model.forward_batch chooses between them and the PyTorch forward in one place."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

from engine.cache_protocol import Cache
from engine.inspection.probe_views import NO_PROBE
from engine.inspection.stage_sink import RunSink
from engine.inspection.stop_points import StopPoint

Form = Literal["run", "rows", "packed"]


@dataclass(frozen=True)
class Batch:
    """One forward's input. ids (T,) and positions (T,) on the model's device: row t is token ids[t] at absolute
    position positions[t]. cache: what the rows attend against (engine.cache_protocol.Cache: a run's KVCache, a
    batch's Rows or Segments). probe: the rows' sink (NO_PROBE: none; a batch's fan-out probe tells run b its rows).
    last_only: keep logits of the rows cache.last_rows(T) (a run's last, or each run's) instead of every row.
    on_layer(i): asked before block i (engine.progress.STOP ends the forward). pos0: the first row's position
    (the probe's call begins there). caches: the runs' own KVCaches, one a run, read by the native steps.
    stop, grad: a lone run's early stop (engine.inspection.stop_points) and gradient forward (Model.forward)."""
    form: Form
    ids: torch.Tensor
    positions: torch.Tensor
    cache: Cache
    probe: RunSink
    pos0: int
    caches: list
    last_only: bool = False
    on_layer: Callable[[int], object] | None = None
    stop: StopPoint | None = None
    grad: bool = False

    @property
    def contiguous(self) -> bool:
        """Whether the rows are one run's consecutive positions pos0 .. pos0 + T - 1 (the rotary tables are then
        one slice, and the causal mask is implicit)."""
        return self.form == "run"

    @property
    def native_rows(self) -> int:
        """How many one-token runs a native step would compute: 1 for a lone run's single token, B for one token
        of each of B runs, 0 where no native step applies (a chunk of several tokens, a packed prefill, an early
        stop, a gradient or a progress callback)."""
        if self.stop is not None or self.grad or self.on_layer is not None:
            return 0
        if self.form == "rows":
            return len(self.caches)
        return 1 if self.form == "run" and self.ids.shape[0] == 1 else 0

    @staticmethod
    def run(ids: torch.Tensor, cache, probe: RunSink | None = None, *, pos0: int, last_only: bool = False,
            on_layer: Callable[[int], object] | None = None, stop: StopPoint | None = None,
            grad: bool = False) -> "Batch":
        """A lone run's chunk: ids (T,) on the model's device at positions pos0 .. pos0 + T - 1 of its KVCache
        `cache` (the trivial batch)."""
        positions = pos0 + torch.arange(ids.shape[0], device=ids.device)
        return Batch("run", ids, positions, cache, NO_PROBE if probe is None else probe, pos0, [cache], last_only,
                     on_layer, stop, grad)

    @staticmethod
    def rows(ids: torch.Tensor, positions: list[int], rows, probe: RunSink, device: torch.device) -> "Batch":
        """One token of each of B runs: ids (B,), token b at positions[b] of run b's cache; rows the batch's Cache
        (engine.batch.rows.Rows: row b against run b's KVCache, rows.caches[b]), probe its fan-out; logits of
        every row."""
        return Batch("rows", ids.to(device), torch.tensor(positions, device=device), rows, probe, positions[0],
                     list(rows.caches))

    @staticmethod
    def packed(ids: torch.Tensor, positions: torch.Tensor, segments, probe: RunSink, device: torch.device
               ) -> "Batch":
        """The prompts of several runs one after another: ids (T,) at positions (T,) (each run's from its cache's
        position), segments the batch's Cache (engine.batch.segments.Segments: each run's rows against its own
        KVCache, segments.caches), probe its fan-out; logits of each run's last row; segments.on_layer asked before
        each block."""
        return Batch("packed", ids.to(device), positions.to(device), segments, probe, int(positions[0]),
                     list(segments.caches), True, segments.on_layer)
