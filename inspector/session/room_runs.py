"""A room's run, parsed once per process: every following student's session shows the same trace bytes (the same
room run id), so they share one validated, parsed Trace instead of each parsing and holding a copy of its own
(a 23 MiB run followed by thirty sessions was thirty copies). The first session to ask fetches and parses it;
others asking meanwhile wait for that one parse and take the same object. It is held weakly: it lives while any
session keeps it, and goes with the last.

The Trace is shared read-only, as the shared memo's values are (inspector.session.memo.SHARED): nothing in the
app changes a run record after it is made. Nothing here knows Streamlit."""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Hashable

from engine import Trace


class SharedRuns:
    def __init__(self) -> None:
        self._runs: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._flights: dict[Hashable, threading.Lock] = {}
        self._lock = threading.Lock()
        self.parsed = 0                       # parses run (tests: thirty followers, one parse)

    def __len__(self) -> int:
        with self._lock:
            return len(self._runs)

    def get(self, key: Hashable, load: Callable[[], Trace]) -> Trace:
        """The run under key (the room run id and the bounds it was validated against), loading it once."""
        with self._lock:
            run = self._runs.get(key)
            if run is not None:
                return run
            flight = self._flights.setdefault(key, threading.Lock())
        with flight:
            with self._lock:
                run = self._runs.get(key)
                if run is not None:
                    return run
            try:
                run = load()
                with self._lock:
                    self._runs[key] = run
                    self.parsed += 1
            finally:
                with self._lock:
                    self._flights.pop(key, None)
        return run


ROOM_RUNS = SharedRuns()
