"""Progress by layer for the one-off forwards the pages compute on demand (an attention map, the entropy
overview, the logit lens, the copy attention of a loop, the report's maps): the prefill's own mechanism
(engine.generate: Progress records, the STOP answer, the probe wrapper that hears each block start), so a
caller follows both the same way.

    def on_progress(p: Progress):               # once per block as it finishes: p.layer of p.layers
        bar.progress(p.fraction)
        return STOP if asked_to_stop else None   # ends the computation: LayerProgress raises Stopped

Without a callback nothing is wrapped and nothing is called: the forward is exactly the plain one.
"""
from __future__ import annotations

from typing import Callable

from .generate import STOP, Progress, Reporting


class Stopped(Exception):
    """on_progress answered STOP: the computation ended before its result (nothing half-done is returned)."""


class LayerProgress:
    """Tells on_progress(Progress(done, chunk_end, total, layer, layers)) as each of a forward's first `layers`
    blocks finishes, chunk by chunk of positions: layer = blocks finished in this chunk (1 .. layers). The
    wrapper hears block i start (i >= 1: block i-1 finished); chunk_done() reports the last block, after any
    early stop the caller's own hook made."""

    def __init__(self, on_progress: Callable[[Progress], object] | None, total: int, layers: int) -> None:
        self.on_progress, self.total, self.layers = on_progress, total, layers

    def probe(self, probe, a: int, b: int):
        """The probe for the forward over positions [a, b): the probe itself without a callback."""
        if self.on_progress is None:
            return probe
        return Reporting(probe, lambda i: self._block_starts(i, a, b))

    def chunk_done(self, a: int, b: int) -> None:
        if self.on_progress is not None:
            self._tell(Progress(a, b, self.total, self.layers, self.layers))

    def _block_starts(self, i: int, a: int, b: int) -> None:
        if 0 < i < self.layers:
            self._tell(Progress(a, b, self.total, i, self.layers))

    def _tell(self, p: Progress) -> None:
        if self.on_progress(p) is STOP:
            raise Stopped
