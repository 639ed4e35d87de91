"""The step barrier: runs in flight, each driven in its own thread (the app's runs: inspector.session.run), meet
before each decode step so that their steps share one forward (engine.batch.forward_together) instead of each
reading every weight on its own.

Leader and followers: the first run to arrive leads this step. It takes the decoding runs waiting at the barrier
(those that are still arriving: each within WINDOW_S of the one before, GATHER_S in all), at most `max_rows` of them,
runs the one forward and then each run's step up to its token (sampling, detokenizing, the stop conditions), one
after another in its own thread: thirty runs sampling in thirty threads took 0.1-0.2 s to come back on two cores
(4.5 ms of CPU each, against 1.2 ms one after another in one thread; `python -m engine bench --class`,
docs/CLASSROOM.md). Then every run of the step is woken and calls its own on_token in its own thread (the Stop
button, the queue's messages and the room observers: the calls of a run alone, in the run's own thread), and comes
back for its next step; the first back leads it. A run alone never waits: it is the only one decoding, and steps on
its own path (a CPU's native one-token step). Prefills meet at the barrier's PrefillGate (engine.batch.prefill):
those that wait at the same moment go through one forward. max_rows also follows a per-step latency bound: the batch
is capped so that the measured cost of a row (its share of the forward and its own step) keeps one step under
`latency_s`; runs beyond the cap take the next step, in turn.

No run holds up the others (issue 49). One run's own failure in a shared forward (its probe, its on_progress, its
sampler, its on_token) is raised in its own thread only (engine.batch.step, engine.batch.prefill). A run that is not
back at the barrier within WINDOW_S of the last one to come (a slow on_token, a slow prefill) is left out of the
step, and from then on it is late: the steps go on without waiting for it until it comes back, and it joins the next
step after it arrives. The most a step waits on one run's callback is that window (GATHER_S while runs keep coming),
or PREFILL_WAIT_S for a prefill under way (a slow progress callback in it), after which its runs are late too.

    barrier = shared_barrier()
    result = barrier.drive(run)          # run: an engine.GenerationRun; returns its GenerationResult
"""
from __future__ import annotations

import threading
import time

from engine.batch.prefill import PREFILL_WAIT_S, PrefillGate, prefill_reason
from engine.batch.step import alone_reason, forward_together
from engine.generate import GenerationRun
from engine.results import GenerationResult

WINDOW_S = 0.03            # the longest a step's leader waits for the next decoding run to arrive (a run not back
                           # by then is late: no step waits for it until it comes back)
GATHER_S = 0.25            # ... and for all of them, while they keep arriving
LATENCY_S = 1.0            # a batched step should take at most this long (caps the batch by measured row cost)


class _Request:
    """A run waiting at the barrier for one step: done (its step was taken: its thread goes on, tells it and comes
    back for the next), step (what the step drew, for its on_token), error (what its step raised), wake (set when
    done or handed the lead)."""
    __slots__ = ("run", "step", "error", "done", "wake")

    def __init__(self, run: GenerationRun) -> None:
        self.run, self.step, self.error, self.done, self.wake = run, None, None, False, threading.Event()


class StepBarrier:
    def __init__(self, max_rows: int = 32, window_s: float = WINDOW_S, latency_s: float = LATENCY_S,
                 gather_s: float = GATHER_S, prefill_wait_s: float = PREFILL_WAIT_S) -> None:
        """max_rows: most runs in one decode forward (1: every run prefills and steps alone; on the CPU a batched run's
        arithmetic is its own alone, bit for bit, either way: engine.batch.step)."""
        self._cond = threading.Condition()     # the lock; only a gathering leader waits on it
        self._pending: list[_Request] = []     # runs waiting for a step, in turn
        self._decoding: set[GenerationRun] = set()   # runs driven here whose next steps are (packed prefill and)
                                                     # decode steps: a gathering leader waits for them
        self._late: set[GenerationRun] = set()       # ... but for these: not back within a window (see the docstring)
        self._leader: _Request | None = None
        self.max_rows, self.window_s, self.latency_s = max_rows, window_s, latency_s
        self.gather_s, self.prefill_wait_s = max(gather_s, window_s), prefill_wait_s
        self._passed_serve = -1          # the gate's serve (PrefillGate.serves) no step waits for any more: a step
                                         # waits prefill_wait_s at most for one, then goes on (its runs late)
        self.row_s = 0.0                 # measured seconds per row of a batched step (moving average)
        self.steps = self.rows = 0       # batched steps taken, rows they served (rows / steps: the mean batch)
        self.prefills = PrefillGate(wait_s=prefill_wait_s)   # the runs' prefills, packed when they wait together

    def drive(self, run: GenerationRun) -> GenerationResult:
        """Step `run` to its end, its decode steps batched with the other runs driven at the same time."""
        decoding = False
        try:
            while not run.done:
                packed = self.max_rows >= 2 and prefill_reason(run) is None
                if not packed and (self.max_rows < 2 or alone_reason(run) is not None):
                    run.step()
                    continue
                if not decoding:             # from its packed prefill on, its decode steps are awaited
                    with self._cond:
                        self._decoding.add(run)
                    decoding = True
                if packed:
                    self.prefills.prefill(run)          # packed with the prefills waiting beside it
                else:
                    self._wait_at_barrier(run)
        finally:
            if decoding:
                with self._cond:
                    self._decoding.discard(run)
                    self._late.discard(run)
                    self._cond.notify_all()
        return run.result()

    def cap(self) -> int:
        """Rows in the next batch: max_rows, fewer when the measured row cost would pass the latency bound."""
        if self.row_s <= 0:
            return self.max_rows
        return max(2, min(self.max_rows, int(self.latency_s / self.row_s)))

    def _wait_at_barrier(self, run: GenerationRun) -> None:
        """`run`'s next step, stepped with the others by whoever leads (this thread when it is handed the lead);
        then its on_token, here in its own thread."""
        req = _Request(run)
        with self._cond:
            self._late.discard(run)            # back: the next step waits for it again
            self._pending.append(req)
            if self._leader is None:
                self._leader = req
            self._cond.notify_all()            # a gathering leader hears of it
        while True:
            with self._cond:
                if req.done:
                    break
                batch = self._gather() if self._leader is req else None
            if batch is None:
                req.wake.wait()
                req.wake.clear()
                continue
            self._serve(req, batch)
        if req.error is not None:
            raise req.error
        run.tell_token(req.step)

    def _gather(self) -> list[_Request]:
        """(Holding the lock, leading) wait for the decoding runs that are not late while they keep arriving: at most
        window_s after the last one came (or the leader began), and at most gather_s in all; and while a prefill is
        under way at the gate (its runs join this step: decoding beside a packed prefill would only slow it), at most
        prefill_wait_s for one prefill. The runs still away then are late. Take this step's batch."""
        start = last = time.monotonic()
        cap, arrived, prefill_since = self.cap(), len(self._pending), None
        while len(self._pending) < min(len(self._decoding) - len(self._late), cap):
            now = time.monotonic()
            if len(self._pending) > arrived:
                arrived, last = len(self._pending), now
            if self.prefills.serving and self.prefills.serves != self._passed_serve:
                prefill_since = prefill_since or now
                start = last = now
                if now - prefill_since < self.prefill_wait_s:
                    self._cond.wait(self.window_s)
                    continue
                self._passed_serve = self.prefills.serves     # too long (a slow callback in it): go on without it
            left = min(last + self.window_s, start + self.gather_s) - now
            if left <= 0:
                here = {r.run for r in self._pending}
                self._late |= {run for run in self._decoding if run not in here}
                break
            self._cond.wait(left)
        batch, self._pending = self._pending[:cap], self._pending[cap:]
        return batch

    def _serve(self, leader: _Request, batch: list[_Request]) -> None:
        """The batch's step (outside the lock): one forward per model for its runs (a model's single run steps on
        its own path), then each run's own step up to its token; then every request is done (its thread tells its
        step and comes back) and the lead passes to the first run waiting, if any."""
        served: list[_Request] = []
        try:
            groups: dict[int, list[_Request]] = {}
            for r in batch:
                groups.setdefault(id(r.run.model), []).append(r)
            for group in groups.values():
                self._step_group(group)
                served.extend(group)
        finally:
            with self._cond:
                for r in batch:
                    if r not in served and r.error is None:       # the leader itself failed (an interrupt)
                        r.error = RuntimeError("the batched step was interrupted before this run's turn")
                    r.done = True
                    if r.error is not None or r.run.done:     # it takes no next step: no leader waits for it
                        self._decoding.discard(r.run)
                    if r is not leader:
                        r.wake.set()
                self._leader = self._pending[0] if self._pending else None
                if self._leader is not None:
                    self._leader.wake.set()

    def _step_group(self, group: list[_Request]) -> None:
        """One model's runs of this step: a forward over their rows, then each run's step with its row."""
        if len(group) == 1:
            r = group[0]
            try:
                r.step = r.run.step(tell=False)
            except Exception as e:            # its thread raises it
                r.error = e
            return
        t0 = time.perf_counter()
        try:
            rows, seconds = forward_together([r.run for r in group])
        except Exception as e:                # every run of this step hears why (no cache was advanced)
            for r in group:
                r.error = e
            return
        for r, row in zip(group, rows):
            if isinstance(row, BaseException):     # its own code failed in the forward: its thread raises it
                r.error = row
                continue
            try:
                r.step = r.run.step(row, seconds=seconds, tell=False)
            except Exception as e:
                r.error = e
        row_s = (time.perf_counter() - t0) / len(group)
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
