"""Admission to the device: at most `max_concurrent` runs at once over the whole process; the others wait in a
first-come-first-served queue of at most `max_queue`, and each waiting user is told their place. Fair between
clients: one client (a browser, with all its tabs) has at most `per_client_running` runs generating and
`per_client_queued` waiting; its next run waits behind its own, never in front of other clients' runs.
Memory bounds the runs at once too: each run says what it will hold (`need`: its KV cache and recording at the
length it asked for, session.run_memory), and a run is admitted only while the runs generating, with it, fit
`max_bytes` (0: no such bound); a run alone is always admitted. The first in line that may start waits for room
(no smaller run overtakes it), told its place like any other waiting run.

    with shared_admission(limits).slot(on_wait=lambda n: show(f"You are number {n} in the queue")):
        ...generate...

Bounding the runs in flight, by count and by what they hold, bounds memory; a queue that is full, or a wait
longer than the timeout, is a clear ServerBusyError rather than an out-of-memory crash. The admission object
holds counters only, never a run. Nothing here knows Streamlit.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from engine import EngineError

from .limits import Limits, env_name

HEARTBEAT_S = 1.0     # a waiting run calls on_wait at least this often, so its UI can be stopped or rerun


class ServerBusyError(EngineError):
    """The queue is full, or a run waited longer than the queue timeout: try again later."""


@dataclass(frozen=True)
class AdmissionState:
    running: int
    waiting: int
    max_concurrent: int
    max_queue: int
    admitted: int          # runs admitted since the process started
    refused: int           # runs told the server is busy
    peak_running: int
    peak_waiting: int
    running_bytes: int = 0   # what the runs generating hold (their declared need)
    max_bytes: int = 0       # their budget (0: none)


_client_resolver: Callable[[], "str | None"] = lambda: None


def set_client_resolver(fn: Callable[[], "str | None"]) -> None:
    """How slot() learns which client asks when the caller does not say (the app registers one that reads
    the browser's cookie); it is called in the asking thread."""
    global _client_resolver
    _client_resolver = fn


@dataclass(eq=False)
class _Ticket:
    client: str | None
    need: int = 0            # bytes the run will hold


class Admission:
    def __init__(self, max_concurrent: int = 2, max_queue: int = 32, *, heartbeat_s: float = HEARTBEAT_S,
                 per_client_running: int = 1, per_client_queued: int = 1) -> None:
        self._cond = threading.Condition()
        self._queue: deque[_Ticket] = deque()      # one ticket per waiting run, first come first served
        self._client_running: dict[str, int] = {}
        self.per_client_running, self.per_client_queued = per_client_running, per_client_queued
        self._running = 0
        self._bytes = 0                            # what the running runs hold (their tickets' need)
        self.max_bytes = 0                         # their budget; 0: none
        self._admitted = self._refused = self._peak_running = self._peak_waiting = 0
        self.heartbeat_s = heartbeat_s
        self.max_concurrent, self.max_queue = 1, 0
        self.configure(max_concurrent, max_queue)

    def configure(self, max_concurrent: int, max_queue: int) -> None:
        """Change the bounds (runs already admitted or waiting keep their place)."""
        if max_concurrent < 1 or max_queue < 0:
            raise ValueError(f"need max_concurrent >= 1 and max_queue >= 0, got {max_concurrent}, {max_queue}")
        with self._cond:
            self.max_concurrent, self.max_queue = int(max_concurrent), int(max_queue)
            self._cond.notify_all()

    def state(self) -> AdmissionState:
        with self._cond:
            return AdmissionState(self._running, len(self._queue), self.max_concurrent, self.max_queue,
                                  self._admitted, self._refused, self._peak_running, self._peak_waiting,
                                  self._bytes, self.max_bytes)

    @contextmanager
    def slot(self, on_wait: Callable[[int], None] | None = None, timeout: float | None = None, *,
             client: str | None = None, need: int = 0) -> Iterator[None]:
        """Hold one of the device slots for the body. While waiting, on_wait(position) is called (1 = next)
        when the position changes and every heartbeat; an exception it raises leaves the queue cleanly.
        client: who asks (default: the registered resolver's answer; None = a client of its own); need: the bytes the
        run will hold (admitted while the running runs' needs and this one fit max_bytes, or when none runs)."""
        ticket = _Ticket(client if client is not None else _client_resolver(), max(0, int(need)))
        self._acquire(ticket, on_wait, timeout)
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._bytes -= ticket.need
                if ticket.client is not None:
                    self._client_running[ticket.client] -= 1
                    if not self._client_running[ticket.client]:
                        del self._client_running[ticket.client]
                self._cond.notify_all()

    def _admit(self, ticket: _Ticket) -> None:
        self._running += 1
        self._bytes += ticket.need
        self._admitted += 1
        self._peak_running = max(self._peak_running, self._running)
        if ticket.client is not None:
            self._client_running[ticket.client] = self._client_running.get(ticket.client, 0) + 1

    def _may_run(self, ticket: _Ticket) -> bool:
        return ticket.client is None or self._client_running.get(ticket.client, 0) < self.per_client_running

    def _room(self, ticket: _Ticket) -> bool:
        """A free slot, and room in the memory budget for this run (always for a run alone)."""
        return self._running < self.max_concurrent and (
            self.max_bytes <= 0 or not self._running or self._bytes + ticket.need <= self.max_bytes)

    def _next(self) -> _Ticket | None:
        """The first waiting ticket whose client may start another run now."""
        return next((t for t in self._queue if self._may_run(t)), None)

    def _refuse_client(self, ticket: _Ticket) -> None:
        if ticket.client is None:
            return
        waiting = sum(t.client == ticket.client for t in self._queue)
        running = self._client_running.get(ticket.client, 0)
        if running >= self.per_client_running and waiting >= self.per_client_queued:
            self._refused += 1
            raise ServerBusyError(
                f"You already have {running} run(s) generating and {waiting} waiting (in another tab?), the most "
                f"one browser may have ({env_name('max_running_per_client')}, {env_name('max_queued_per_client')}). "
                "Wait for them to finish.")

    def _acquire(self, ticket: _Ticket, on_wait: Callable[[int], None] | None, timeout: float | None) -> None:
        start = time.monotonic()
        with self._cond:
            self._refuse_client(ticket)
            if self._room(ticket) and self._may_run(ticket) and self._next() is None:
                self._admit(ticket)
                return
            if len(self._queue) >= self.max_queue:
                self._refused += 1
                raise ServerBusyError(
                    f"The server is busy: {self._running} runs are generating and {len(self._queue)} are "
                    f"waiting, the most this server queues ({env_name('max_queue')}={self.max_queue}). "
                    "Try again in a minute.")
            self._queue.append(ticket)
            self._peak_waiting = max(self._peak_waiting, len(self._queue))
            told, told_at = 0, 0.0
            try:
                while True:
                    position = self._queue.index(ticket) + 1
                    if self._next() is ticket and self._room(ticket):
                        self._queue.remove(ticket)
                        self._admit(ticket)
                        self._cond.notify_all()          # everyone behind moved up one place
                        return
                    now = time.monotonic()
                    if timeout is not None and now - start >= timeout:
                        self._refused += 1
                        raise ServerBusyError(
                            f"The server is busy: this run waited {timeout:.0f} s in the queue without a free slot "
                            f"({env_name('queue_timeout_s')}). Try again later.")
                    if on_wait is not None and (position != told or now - told_at >= self.heartbeat_s):
                        told, told_at = position, now
                        self._cond.release()             # never call back into the UI holding the lock
                        try:
                            on_wait(position)
                        finally:
                            self._cond.acquire()
                        continue
                    wait = self.heartbeat_s if on_wait is not None else 1.0
                    if timeout is not None:
                        wait = min(wait, max(0.0, timeout - (now - start)))
                    self._cond.wait(wait)
            except BaseException:
                if ticket in self._queue:
                    self._queue.remove(ticket)
                    self._cond.notify_all()
                raise


_shared = Admission(Limits().max_concurrent_runs, Limits().max_queue)


def shared_admission(limits: Limits | None = None, max_bytes: int | None = None) -> Admission:
    """The one admission object of this process, set to the given (or environment's) limits; max_bytes: the runs'
    memory budget (session.run_memory.runs_budget), when given."""
    limits = limits or Limits.from_env()
    if (_shared.max_concurrent, _shared.max_queue) != (limits.max_concurrent_runs, limits.max_queue):
        _shared.configure(limits.max_concurrent_runs, limits.max_queue)
    with _shared._cond:
        _shared.per_client_running = limits.max_running_per_client
        _shared.per_client_queued = limits.max_queued_per_client
        if max_bytes is not None and max_bytes != _shared.max_bytes:
            _shared.max_bytes = max_bytes
            _shared._cond.notify_all()
    return _shared


def slot(on_wait: Callable[[int], None] | None = None, *, timeout: float | None = None,
         limits: Limits | None = None, client: str | None = None):
    """shared_admission(limits).slot(...): hold a device slot of the process-wide queue for a `with` body
    (timeout: the limits' queue_timeout_s unless given)."""
    limits = limits or Limits.from_env()
    return shared_admission(limits).slot(on_wait, limits.queue_timeout_s if timeout is None else timeout,
                                         client=client)
