"""The debugger's run gives its KV cache back when it ends: the session keeps the steps and the record, whose
KV-cache figures are those of the cache it had, not the cache's memory."""
from __future__ import annotations

import gc
import weakref

import pytest

from engine import RunSettings
from engine.generate import ReleasedCache
from inspector.session.budget import nbytes
from inspector.session.stepper import Debugger

pytestmark = pytest.mark.unit


def test_a_finished_debugger_run_releases_its_cache(tiny_model):
    dbg = Debugger(tiny_model, RunSettings(prompt="one two three", chat=False, max_new_tokens=5))
    cache = dbg.run.cache
    keys, values = weakref.ref(cache.k), weakref.ref(cache.v)
    dbg.step()
    assert dbg.run.cache is cache                       # still stepping: the cache stays
    before = dbg.record().result.cache
    dbg.run_to_end()
    want = {"bytes_allocated": cache.bytes_allocated, "bytes_used": cache.bytes_used,
            "bytes_per_token": cache.bytes_per_token}
    del cache
    gc.collect()
    assert dbg.done and isinstance(dbg.run.cache, ReleasedCache) and nbytes(dbg.run.cache) == 0
    assert keys() is None and values() is None           # nothing holds the cache's tensors any more
    after = dbg.record().result.cache
    assert after == want and after["bytes_allocated"] == before["bytes_allocated"]
    assert dbg.step() == [] and len(dbg.steps) == 5      # an ended run steps no more
