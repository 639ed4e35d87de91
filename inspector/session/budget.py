"""A memory budget per browser session (LLM_INSPECTOR_MAX_SESSION_MB): what a session keeps — runs with their
probes, the debugger's live run and KV cache, page memos (attention maps, logit lens, copy attention),
trace files' bytes, opened uploads, doctor reports — is measured, and past the budget the oldest derived
data goes first, then earlier runs, never the run on screen. The server-wide total is then bounded by
sessions × budget + the loaded models.

The budget is of the process's memory: the data it counts fills at most DATA_SHARE of it.
Reads the session's SessionState by field, and its widget values (any mapping); knows nothing of Streamlit.
"""
from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np
import pandas as pd
import torch

from inspector.session.state import SessionState

MAX_DEPTH = 8
# The share of a session's budget its counted data (tensors, arrays, tables, bytes, strings) may fill. The rest
# is for what nbytes does not see: the Python objects around that data, Streamlit's own per-session state and
# the allocator's slack. Measured in the 30-session room test (tests/browser/test_classroom_load.py): sessions
# holding 54 MiB of counted data each grew the server by 62-65 MiB each.
DATA_SHARE = 0.8


def data_allowance(budget_mb: int) -> int:
    """Bytes of counted data a session with a budget of budget_mb MiB may keep."""
    return int(budget_mb * 2**20 * DATA_SHARE)


def trace_file_limit(limits) -> int:
    """Bytes of the largest trace file a session may open: half its data allowance, since the parsed run takes
    about as much again as the file while it is read (serve.sh sets Streamlit's upload limit to the same)."""
    return data_allowance(limits.max_session_mb) // 2


def nbytes(obj: Any, seen: set | None = None, depth: int = 0) -> int:
    """Bytes an object holds in tensors, arrays, frames and byte strings (each storage counted once)."""
    seen = set() if seen is None else seen
    if depth > MAX_DEPTH or id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        key = ("storage", obj.untyped_storage().data_ptr()) if obj.device.type != "meta" else None
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, pd.DataFrame):
        return int(obj.memory_usage(deep=True).sum())
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return len(obj)
    if isinstance(obj, io.BytesIO):           # an uploaded file (Streamlit's UploadedFile) or any in-memory file
        return obj.getbuffer().nbytes
    if isinstance(obj, str):
        return len(obj)
    if isinstance(obj, Mapping):
        return sum(nbytes(k, seen, depth + 1) + nbytes(v, seen, depth + 1) for k, v in list(obj.items()))
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(nbytes(v, seen, depth + 1) for v in list(obj))
    if hasattr(obj, "__dict__"):
        return sum(nbytes(v, seen, depth + 1) for v in vars(obj).values())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):      # a slotted one (SessionState, RoomSeat)
        return sum(nbytes(getattr(obj, f.name), seen, depth + 1) for f in dataclasses.fields(obj))
    return 0


@dataclasses.dataclass
class Holding:
    """One thing a session keeps that the budget may drop."""
    key: str                 # where: a SessionState field ("memos", "compared", "determinism", "steered", "qk", "opened", "debugger", "runs"), or
                             # "widgets" (a widget's value in st.session_state)
    name: str | None         # the memo's name (memos), the widget's key (widgets); otherwise None
    item: Any                # within a memo store: the entry's key; within runs: the run; otherwise None (whole)
    bytes: int
    rank: int                # drop order: lower first (derived data 0, uploads 1, debugger 2, earlier runs 3)
    label: str


def _whole(key: str, name: str | None, value: Any, rank: int, label: str, seen: set) -> list[Holding]:
    n = nbytes(value, seen)
    return [Holding(key, name, None, n, rank, label)] if n else []


def holdings(session: SessionState, widgets: Mapping | None = None) -> list[Holding]:
    """What the session holds, in the order the budget drops it: page memo entries oldest first, the last
    comparison and widget values (a long prompt), then opened trace files, trace bytes and uploaded files, then
    the debugger's run, then earlier runs oldest first. The current run and the app's own state (a live run, a
    room seat, the flags) are never listed."""
    current, seen = session.run, set()
    nbytes(current, seen)              # what the current run holds is never counted as droppable
    out: list[Holding] = []
    for name, store in list(session.memos.items()):
        rank = 1 if name.startswith("tf_") else 0
        label = "a trace file" if rank else f"a cached view ({name})"
        for k in list(store.keys()):
            n = nbytes(store[k], seen)
            if n:
                out.append(Holding("memos", name, k, n, rank, label))
    out += _whole("compared", None, session.compared, 0, "a cached view (comparison)", seen)
    out += _whole("determinism", None, session.determinism, 0, "a cached view (determinism check)", seen)
    out += _whole("steered", None, session.steered, 0, "a cached view (steering)", seen)
    out += _whole("qk", None, session.qk, 0, "a cached view (score split)", seen)
    out += _whole("opened", None, session.opened, 1, "a trace file", seen)
    for key in list((widgets or {}).keys()):
        value = widgets[key]
        if not isinstance(value, SessionState):    # a widget's value: an uploaded file, a long prompt
            rank = 1 if str(key).startswith("tf_") else 0
            out += _whole("widgets", key, value, rank, "a trace file" if rank else f"a cached view ({key})", seen)
    dbg = session.debugger
    if dbg is not None and getattr(dbg, "published", None) is not current:
        out.append(Holding("debugger", None, None, nbytes(dbg, seen), 2, "the debugger's run"))
    for run in session.runs:
        if run is not current:
            out.append(Holding("runs", None, run, nbytes(run, seen), 3, f"an earlier run ({len(run.ids)} positions)"))
    return sorted(out, key=lambda h: h.rank)      # stable: oldest first within a rank


def session_bytes(session: SessionState, widgets: Mapping | None = None) -> int:
    """Bytes of counted data the session holds: its SessionState and its widget values."""
    seen: set = set()
    return nbytes(session, seen) + nbytes({k: v for k, v in (widgets or {}).items() if v is not session}, seen)


def enforce(session: SessionState, budget_bytes: int, widgets: MutableMapping | None = None) -> list[str]:
    """Drop what holdings() lists, in order, until the session fits its budget. Returns what was dropped."""
    used = session_bytes(session, widgets)
    dropped: list[str] = []
    for h in holdings(session, widgets):
        if used <= budget_bytes:
            break
        if h.key == "runs":
            session.runs = [r for r in session.runs if r is not h.item]
        elif h.key == "memos":
            session.memos[h.name].pop(h.item, None)
        elif h.key == "widgets":
            del widgets[h.name]
        else:
            setattr(session, h.key, None)
        used -= h.bytes
        dropped.append(f"{h.label}, {h.bytes / 2**20:.1f} MiB")
    return dropped
