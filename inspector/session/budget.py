"""A memory budget per browser session (LLM_INSPECTOR_MAX_SESSION_MB): what a session keeps — runs with their
probes, the debugger's live run and KV cache, page memos (attention maps, logit lens, copy attention),
trace files' bytes, opened uploads, doctor reports — is measured, and past the budget the oldest derived
data goes first, then earlier runs, never the run on screen. The server-wide total is then bounded by
sessions × budget + the loaded models.

The budget is of the process's memory: the data it counts fills at most DATA_SHARE of it.
Works on any mutable mapping (st.session_state in the app, a dict in tests); knows nothing of Streamlit.
"""
from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np
import pandas as pd
import torch

RUNS_KEY, RUN_KEY, DEBUGGER_KEY = "runs", "run", "dbg"
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
    if dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
        return sum(nbytes(v, seen, depth + 1) for v in vars(obj).values()) if hasattr(obj, "__dict__") else 0
    return 0


@dataclasses.dataclass
class Holding:
    """One thing a session keeps that the budget may drop."""
    key: str                 # session-state key
    item: Any                # within a dict store: the entry's key; otherwise None (the whole value)
    bytes: int
    rank: int                # drop order: lower first (derived data 0, uploads 1, debugger 2, earlier runs 3)
    label: str


def holdings(state: Mapping) -> list[Holding]:
    """What the session holds, in the order the budget drops it: memo entries oldest first, then uploads, opened
    trace files and trace bytes, then the debugger's run, then earlier runs oldest first. The current run and the
    app's own state (keys starting with "_") are never listed; everything else is, dict entry by dict entry or
    as a whole value."""
    current = state.get(RUN_KEY)
    seen: set = set() if current is None else {id(current)}
    nbytes(current, seen)              # what the current run holds is never counted as droppable
    out: list[Holding] = []
    for key in list(state.keys()):
        value = state[key]
        if key in (RUNS_KEY, RUN_KEY, DEBUGGER_KEY) or str(key).startswith("_"):
            continue       # "_..." keys are the app's own state (a live run, a room seat): counted, never dropped
        rank = 1 if str(key).startswith("tf_") else 0
        label = "a trace file" if rank else f"a cached view ({key})"
        if not isinstance(value, dict):          # a whole value: an opened upload, a report, a widget's file
            n = nbytes(value, seen)
            if n:
                out.append(Holding(key, None, n, rank, label))
            continue
        for k in list(value.keys()):
            n = nbytes(value[k], seen)
            if n:
                out.append(Holding(key, k, n, rank, label))
    dbg = state.get(DEBUGGER_KEY)
    if dbg is not None and getattr(dbg, "published", None) is not current:
        out.append(Holding(DEBUGGER_KEY, None, nbytes(dbg, seen), 2, "the debugger's run"))
    for run in state.get(RUNS_KEY, []):
        if run is not current:
            out.append(Holding(RUNS_KEY, run, nbytes(run, seen), 3, f"an earlier run ({len(run.ids)} positions)"))
    return sorted(out, key=lambda h: h.rank)      # stable: oldest first within a rank


def session_bytes(state: Mapping) -> int:
    return nbytes({k: state[k] for k in list(state.keys())})


def enforce(state: MutableMapping, budget_bytes: int) -> list[str]:
    """Drop what holdings() lists, in order, until the session fits its budget. Returns what was dropped."""
    used = session_bytes(state)
    dropped: list[str] = []
    for h in holdings(state):
        if used <= budget_bytes:
            break
        if h.key == RUNS_KEY:
            state[RUNS_KEY] = [r for r in state[RUNS_KEY] if r is not h.item]
        elif h.item is None:
            del state[h.key]
        else:
            state[h.key].pop(h.item, None)
        used -= h.bytes
        dropped.append(f"{h.label}, {h.bytes / 2**20:.1f} MiB")
    return dropped
