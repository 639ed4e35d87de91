"""The step barrier: runs in flight, each driven in its own thread (the app's runs: inspector.session.run), meet
before each decode step so that their steps share one forward (engine.batch.forward_together) instead of each
reading every weight on its own.

Leader and followers: the first run to arrive at a step leads it. It waits for the other runs that are decoding
(each comes back as soon as it has sampled its last token) until all have arrived, for as long as they keep coming:
each within WINDOW_S of the one before (the most a lone straggler delays the others), GATHER_S in all. Thirty runs
finishing their steps in thirty threads come back over ~0.1-0.2 s on two cores; a window from the leader alone
split them into batches of a few rows (55 forwards for a class of thirty's 32 tokens, against 34 now: `python -m
engine bench --class`, docs/CLASSROOM.md). It takes at most `max_rows` of them, runs the one forward,
and hands each run its logits row; every run then finishes its step in its own thread (sampling, detokenizing, its
stop conditions, its on_token: the Stop button, the queue's messages and the room observers behave as for a run
alone). A run alone never waits: it is the only one decoding. A run whose step cannot join (its prefill, a probe
that changes the forward) steps on its own. max_rows also follows a per-step latency bound: the batch is capped so
that the measured cost of a row keeps one step under `latency_s`.

    barrier = shared_barrier()
    result = barrier.drive(run)          # run: an engine.GenerationRun; returns its GenerationResult
"""
from __future__ import annotations

import threading
import time

from engine.batch.step import alone_reason, forward_together
from engine.generate import GenerationResult, GenerationRun

WINDOW_S = 0.03            # the longest a step's leader waits for the next decoding run to arrive
GATHER_S = 0.25            # ... and for all of them, while they keep arriving
LATENCY_S = 1.0            # a batched step should take at most this long (caps the batch by measured row cost)


class _Request:
    __slots__ = ("run", "logits", "seconds", "error", "done")

    def __init__(self, run: GenerationRun) -> None:
        self.run, self.logits, self.seconds, self.error, self.done = run, None, 0.0, None, False


class StepBarrier:
    def __init__(self, max_rows: int = 32, window_s: float = WINDOW_S, latency_s: float = LATENCY_S,
                 gather_s: float = GATHER_S) -> None:
        """max_rows: most runs in one forward (1: every run steps alone, its own arithmetic bit for bit)."""
        self._cond = threading.Condition()
        self._pending: list[_Request] = []
        self._decoding = 0               # runs driven here whose next steps are decode steps
        self._leading = False
        self.max_rows, self.window_s, self.latency_s = max_rows, window_s, latency_s
        self.gather_s = max(gather_s, window_s)
        self.row_s = 0.0                 # measured seconds per row of a batched step (moving average)
        self.steps = self.rows = 0       # batched steps taken, rows they served (rows / steps: the mean batch)

    def drive(self, run: GenerationRun) -> GenerationResult:
        """Step `run` to its end, its decode steps batched with the other runs driven at the same time."""
        decoding = False
        try:
            while not run.done:
                if self.max_rows < 2 or alone_reason(run) is not None:
                    run.step()
                    continue
                if not decoding:
                    with self._cond:
                        self._decoding += 1
                    decoding = True
                self._step(run)
        finally:
            if decoding:
                with self._cond:
                    self._decoding -= 1
                    self._cond.notify_all()
        return run.result()

    def cap(self) -> int:
        """Rows in the next batch: max_rows, fewer when the measured row cost would pass the latency bound."""
        if self.row_s <= 0:
            return self.max_rows
        return max(2, min(self.max_rows, int(self.latency_s / self.row_s)))

    def _step(self, run: GenerationRun) -> None:
        req = _Request(run)
        with self._cond:
            self._pending.append(req)
            self._cond.notify_all()
        while True:             # follow, or lead a step (which may be full before this run's turn: then again)
            with self._cond:
                while not req.done and self._leading:
                    self._cond.wait()
                if req.done:
                    break
                batch = self._lead()
            self._serve(batch)
        if req.error is not None:
            raise req.error
        run.step(req.logits, seconds=req.seconds) if req.logits is not None else run.step()

    def _lead(self) -> list[_Request]:
        """(Holding the lock) wait for the decoding runs while they keep arriving: at most window_s after the last
        one came (or the leader), and at most gather_s in all; take this step's batch."""
        self._leading = True
        start = last = time.monotonic()
        cap, arrived = self.cap(), len(self._pending)
        while len(self._pending) < min(self._decoding, cap):
            now = time.monotonic()
            if len(self._pending) > arrived:
                arrived, last = len(self._pending), now
            left = min(last + self.window_s, start + self.gather_s) - now
            if left <= 0:
                break
            self._cond.wait(left)
        batch, self._pending = self._pending[:cap], self._pending[cap:]
        return batch

    def _serve(self, batch: list[_Request]) -> None:
        """The batch's forward (outside the lock), its results to each request, leadership given back."""
        groups: dict[int, list[_Request]] = {}
        for r in batch:                       # one forward per model; a run alone steps on its own path
            groups.setdefault(id(r.run.model), []).append(r)
        try:
            for group in groups.values():
                if len(group) > 1:
                    self._forward(group)
        finally:
            with self._cond:
                for r in batch:
                    r.done = True
                self._leading = False
                self._cond.notify_all()


    def _forward(self, group: list[_Request]) -> None:
        try:
            logits, seconds = forward_together([r.run for r in group])
        except Exception as e:                # every run of this step hears why (no cache was advanced)
            for r in group:
                r.error = e
            return
        for b, r in enumerate(group):
            r.logits, r.seconds = logits[b], seconds
        row_s = seconds / len(group)
        self.row_s = row_s if not self.steps else 0.8 * self.row_s + 0.2 * row_s
        self.steps, self.rows = self.steps + 1, self.rows + len(group)


_shared: StepBarrier | None = None
_shared_lock = threading.Lock()


def shared_barrier(max_rows: int | None = None) -> StepBarrier:
    """The one step barrier of this process (max_rows: the limits' max_batch_rows, when given)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = StepBarrier()
        if max_rows is not None:
            _shared.max_rows = max_rows
        return _shared
