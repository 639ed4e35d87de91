"""The engine's one progress protocol, for every long computation: a callback on_progress(Progress) that hears
where the work stands and may answer STOP. This module holds the record (Progress), the answer (STOP), the
exception a stopped computation raises (Stopped) and the ways a computation tells them; it sits below the model
(engine.model raises Stopped from its forward), so nothing here imports the generation loop.

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

from dataclasses import dataclass
from typing import Callable

__all__ = ["PREFILL_CHUNK", "STOP", "LayerProgress", "OnProgress", "Progress", "Stopped", "tell_units"]

# Prompts longer than this are prefilled this many positions at a time (engine.generate; a chunk after the first
# pays for its mask and reads the weights again: 2,048 positions in 4 chunks of 512 took 1.2x one forward here).
# Here, not in the loop, because Progress.chunks numbers a prefill's chunks by it; read it as
# engine.progress.PREFILL_CHUNK at the time of use (tests set it smaller).
PREFILL_CHUNK = 2048


class _Stop:
    def __repr__(self) -> str:
        return "STOP"


STOP = _Stop()               # returned by on_token / on_progress: end the run here (stop reason "stopped")


class Stopped(Exception):
    """A job's on_progress answered STOP: raised by Model.forward when its on_layer answers STOP (before the
    next block; the cache is not advanced), or by a job's own loop between two units (engine.progress)."""


@dataclass(frozen=True)
class Progress:
    """Where a long computation stands: the one progress record of the engine. A prefill or a
    one-off forward tells it before each block of each chunk and once at its end; a job of many units (reruns,
    packed forwards: Progress.units) before each unit and once at its end (done == total). The callback may
    answer STOP."""
    done: int            # prompt positions prefilled before this chunk (a job: units finished)
    chunk_end: int       # this chunk covers positions [done, chunk_end) (a job: == done)
    total: int           # prompt positions (a job: units in all, an upper bound until the end)
    layer: int           # the block about to run; == layers once the chunk's forward is done
    layers: int
    what: str = ""       # a job's unit under way, in words ("rerun 3: zero the top-1 copy head")

    @classmethod
    def units(cls, done: int, total: int, what: str) -> Progress:
        """A job's record: `done` of `total` units finished, `what` the next (or the end)."""
        return cls(done, done, total, 1, 1, what)

    @property
    def fraction(self) -> float:
        if self.total <= 0:
            return 1.0
        return (self.done + (self.chunk_end - self.done) * self.layer / self.layers) / self.total

    @property
    def chunks(self) -> tuple[int, int]:
        """(this chunk's number from 1, how many chunks)."""
        n = -(-self.total // PREFILL_CHUNK) if self.total > PREFILL_CHUNK else 1
        return min(n, self.done // PREFILL_CHUNK + 1), n


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
