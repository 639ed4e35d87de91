"""The engine's one progress protocol, for every long computation: a callback on_progress(Progress) that hears
where the work stands and may answer STOP (engine.generate holds the record and the answer; this module the
ways a computation tells them).

    def on_progress(p: Progress):
        bar.progress(p.fraction, text=p.what)
        return STOP if asked_to_stop else None

- A prefill (engine.generate) and a one-off forward (an attention map, the entropy overview, the logit lens,
  the copy attention, the report's maps: LayerProgress) tell a record per block as it starts, chunk by
  chunk of positions. Model.forward's on_layer passes the answer back: a STOP ends the forward
  before its next block (Model.forward raises Stopped; nothing raises from inside a hook).
- A job of many units (the why-loop's and the rescue's reruns, the patching grid's and head scan's packed
  forwards, input attribution, each quantised format, the precision comparison's layers: tell_units) tells
  Progress.units(done, total, what) before each unit and done == total at its end. A STOP raises Stopped
  from the job's own loop, between two units, never through model code: the job returns nothing (no half
  result) and the caller shows "stopped".

Without a callback nothing is called: the work is exactly the plain one.
"""
from __future__ import annotations

from typing import Callable

from engine.generate import STOP, Progress, Stopped

__all__ = ["STOP", "LayerProgress", "OnProgress", "Progress", "Stopped", "tell_units"]

OnProgress = Callable[[Progress], object]      # returns STOP to stop, anything else to go on


def tell_units(on_progress: OnProgress | None, done: int, total: int, what: str) -> None:
    """A job's progress between two units of work: done of total finished, `what` the next one. A STOP answer
    raises Stopped here, in the job's own loop (no forward is under way), so no further unit runs."""
    if on_progress is not None and on_progress(Progress.units(done, max(total, done), what)) is STOP:
        raise Stopped


class LayerProgress:
    """Tells on_progress(Progress(done, chunk_end, total, layer, layers)) as each of a forward's first `layers`
    blocks finishes, chunk by chunk of positions: layer = blocks finished in this chunk (1 .. layers). The
    forward's on_layer hears block i start (i >= 1: block i-1 finished); chunk_done() reports the last block,
    after any stop_after the caller asked for."""

    def __init__(self, on_progress: OnProgress | None, total: int, layers: int) -> None:
        self.on_progress, self.total, self.layers = on_progress, total, layers

    def on_layer(self, a: int, b: int) -> Callable[[int], object] | None:
        """Model.forward's on_layer for the forward over positions [a, b): None without a callback (the forward
        is then the plain one)."""
        if self.on_progress is None:
            return None
        return lambda i: self._block_starts(i, a, b)

    def chunk_done(self, a: int, b: int) -> None:
        """After the forward over [a, b): the caller's loop, between two forwards; a STOP raises Stopped."""
        if self.on_progress is not None and self._tell(Progress(a, b, self.total, self.layers, self.layers)) is STOP:
            raise Stopped

    def _block_starts(self, i: int, a: int, b: int) -> object:
        if 0 < i < self.layers:
            return self._tell(Progress(a, b, self.total, i, self.layers))     # STOP ends the forward there
        return None

    def _tell(self, p: Progress) -> object:
        return self.on_progress(p)
