"""A per-session memo for derived data (attention maps, logit lens, copy attention): bounded in entries
and bytes, least recently used first out, keyed by the run it belongs to."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Hashable

import numpy as np
import pandas as pd
import torch


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
    return 0


def memo(store: "OrderedDict | dict", key: Hashable, compute: Callable[[], Any], *, max_entries: int = 8,
         max_bytes: int = 512 << 20) -> Any:
    """store[key], computing it on a miss; least recently used entries are dropped past max_entries or
    max_bytes (the newest entry is always kept, however big)."""
    if key in store:
        value = store.pop(key)
        store[key] = value                       # most recently used last
        return value
    value = compute()
    store[key] = value
    while len(store) > 1 and (len(store) > max_entries or sum(_nbytes(v) for v in store.values()) > max_bytes):
        store.pop(next(iter(store)))
    return value
