"""Memos for derived data (attention maps, sampler chains, figures): bounded in entries and bytes, least
recently used first out.

Two stores, one interface (`memo(store, key, compute)`):
  - a session's own dict (one of SessionState.memos, inspector/session/state.py: the session's typed state that
    inspector.ui.state.session() returns), keyed by the run it belongs to (run_key), dropped with the run;
  - the process's SHARED store, for a room's run: every student's session shows the same run (the same room
    run id; one parsed copy per process, inspector.session.room_runs), so what one session computes from it (a
    map, a chain, a figure) is what the others would compute. One session computes, the others wait for it and
    take the same value (a class of thirty following the teacher computes each view once per server, not thirty
    times). Values in it are never changed by their users; it has its own bounds, apart from any session's
    allowance.

`view_store(run, own)` says which of the two a page uses for a run, and `content_key(run, model)` is the
key prefix that goes with it. `styled_once(fig)` is the app's restyling of a figure, made once per figure."""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable

import numpy as np
import pandas as pd
import torch

from inspector.views.theme import styled

SHARED_ENTRIES = 256
SHARED_BYTES = 256 << 20


def run_key(run) -> tuple:
    """Identifies one run for caches (id() alone may be reused once a run is garbage-collected)."""
    return (id(run), getattr(run, "created", None))


def _nbytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, np.ndarray):
        return v.nbytes
    if isinstance(v, pd.DataFrame):
        return int(v.memory_usage(deep=False).sum())
    if isinstance(v, (tuple, list)):
        return sum(_nbytes(x) for x in v)
    if isinstance(v, dict):
        return sum(_nbytes(x) for x in v.values())
    return 0


class SharedMemo:
    """A process-wide memo that many sessions read at once: thread-safe, one computation per key at a time
    (the others wait for it; if it fails, the next waiting caller computes), bounded like memo()."""

    def __init__(self, max_entries: int = SHARED_ENTRIES, max_bytes: int = SHARED_BYTES) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._values: OrderedDict = OrderedDict()
        self._sizes: dict = {}
        self._flights: dict = {}
        self._lock = threading.Lock()
        self.computed = 0                         # computations run (tests: thirty sessions, one computation)

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._values

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)

    def _hit(self, key):
        if key in self._values:
            self._values.move_to_end(key)
            return True, self._values[key]
        return False, None

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        with self._lock:
            found, value = self._hit(key)
            if found:
                return value
            flight = self._flights.setdefault(key, threading.Lock())
        with flight:
            with self._lock:
                found, value = self._hit(key)
                if found:
                    return value
            value = compute()
            with self._lock:
                self.computed += 1
                self._values[key], self._sizes[key] = value, _nbytes(value)
                self._flights.pop(key, None)
                while len(self._values) > 1 and (len(self._values) > self.max_entries
                                                 or sum(self._sizes.values()) > self.max_bytes):
                    old = next(iter(self._values))
                    del self._values[old], self._sizes[old]
        return value

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self._sizes.clear()


SHARED = SharedMemo()


def room_run_id(run) -> str | None:
    extra = getattr(run, "extra", None)
    rid = extra.get("room_run_id") if isinstance(extra, dict) else None
    return rid if isinstance(rid, str) and rid else None


def content_key(run, model=None) -> tuple:
    """The key prefix of what is derived from this run (with this model): a room's run by its room run id (the
    same in every session that loaded it) and the model's name, dtype and device; any other run by run_key."""
    rid = room_run_id(run)
    if rid is None:
        return run_key(run)
    what = None if model is None else (model.name, str(model.dtype), model.device.type)
    return ("room-run", rid, what)


def view_store(run, own: "OrderedDict | dict | None"):
    """Where a page memoises what it derives from `run`: SHARED for a room's run, else the session's `own`
    (None: a session keeps none of it; figures, which the session budget does not weigh, are kept so)."""
    return SHARED if room_run_id(run) is not None else own


def memo(store: "OrderedDict | dict | SharedMemo | None", key: Hashable, compute: Callable[[], Any], *,
         max_entries: int = 8, max_bytes: int = 512 << 20) -> Any:
    """store[key], computing it on a miss; least recently used entries are dropped past max_entries or
    max_bytes (the newest entry is always kept, however big). A SharedMemo keeps its own bounds; with no
    store (None) the value is computed every time."""
    if store is None:
        return compute()
    if isinstance(store, SharedMemo):
        return store.get(key, compute)
    if key in store:
        value = store.pop(key)
        store[key] = value                       # most recently used last
        return value
    value = compute()
    store[key] = value
    while len(store) > 1 and (len(store) > max_entries or sum(_nbytes(v) for v in store.values()) > max_bytes):
        store.pop(next(iter(store)))
    return value


_styled: dict[tuple[int, bool], tuple] = {}        # (id(figure), projector) -> (weakref, styled copy)
_styled_lock = threading.Lock()


def styled_once(fig, *, projector: bool = False):
    """inspector.views.theme.styled(fig), made once per figure object and mode while the figure lives: a figure
    that many sessions draw (a room's view, memoised once per server in SHARED) is restyled once, not once per
    student. A figure must not be changed after it was first drawn."""
    key = (id(fig), projector)
    with _styled_lock:
        hit = _styled.get(key)
    if hit is not None and hit[0]() is fig:
        return hit[1]
    out = styled(fig, projector=projector)

    def forget(_ref, key=key) -> None:
        with _styled_lock:
            if key in _styled and _styled[key][0] is _ref:
                del _styled[key]
    with _styled_lock:
        _styled[key] = (weakref.ref(fig, forget), out)
    return out
