"""What this server holds in memory, every session together, so that a teacher sees why a model was refused or
unloaded: the models (their weights' bytes by dtype, against $LLM_INSPECTOR_MAX_MODELS), the runs generating now
(their KV caches and recordings, as the admission queue admitted them), the debuggers' KV caches and the run records
alive (what the sessions keep, measured once per record). Knows nothing of Streamlit.

    held = server_memory(limits)
    held.caption()      # "This server holds 2 of at most 4 models (…), 1 run generating (…), …"
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

from inspector.views.kv_cache import human_bytes

from .admission import shared_admission
from .budget import nbytes
from .limits import Limits, env_name
from .models import Held, held
from .run import records
from .stepper import debugger_caches

_sizes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()     # run record -> its bytes, measured once
_sizes_lock = threading.Lock()


def weights_text(weight_bytes: dict[str, int]) -> str:
    """A model's weights as the sidebar says them: the total, then each dtype's share ("1.00 MiB: float32
    0.98 MiB, int8 20.00 KiB"), or one dtype alone ("1.00 MiB float32")."""
    total = human_bytes(sum(weight_bytes.values()))
    if len(weight_bytes) == 1:
        return f"{total} {next(iter(weight_bytes))}"
    return f"{total}: " + ", ".join(f"{d} {human_bytes(n)}" for d, n in weight_bytes.items())


@dataclass(frozen=True)
class ServerMemory:
    models: tuple[Held, ...]
    max_models: int
    generating: int                 # runs generating now
    generating_bytes: int           # what the admission queue counts for them (KV cache and recording at full length)
    debuggers: int                  # debuggers whose run still holds its KV cache
    debugger_bytes: int
    records: int                    # run records alive (every session's runs kept, debugger snapshots, opened files)
    record_bytes: int

    @property
    def weight_bytes(self) -> int:
        return sum(sum(m.weight_bytes.values()) for m in self.models if m.weight_bytes)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.generating_bytes + self.debugger_bytes + self.record_bytes

    def caption(self) -> str:
        loading = sum(m.weight_bytes is None for m in self.models)
        models = "; ".join(f"{m.name} {weights_text(m.weight_bytes)}" for m in self.models if m.weight_bytes)
        return (f"This server holds {human_bytes(self.total_bytes)}: {len(self.models)} of at most {self.max_models} "
                f"models ({env_name('max_models')}), {human_bytes(self.weight_bytes)} of weights"
                + (f" ({models})" if models else "") + (f", {loading} loading" if loading else "")
                + f" · {_n(self.generating, 'run')} generating ({human_bytes(self.generating_bytes)} of KV caches "
                f"and recordings) · {_n(self.debuggers, 'debugger')} with a KV cache "
                f"({human_bytes(self.debugger_bytes)}) · {_n(self.records, 'run record')} kept by the sessions "
                f"({human_bytes(self.record_bytes)}).")


def _n(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def records_in_memory() -> tuple[int, int]:
    """(run records alive in this process, the bytes they hold in tensors, arrays and strings): each record is
    measured once, the first time it is counted (a record does not change once made)."""
    alive = records()
    with _sizes_lock:
        for r in alive:
            if r not in _sizes:
                _sizes[r] = nbytes(r)
        return len(alive), sum(_sizes[r] for r in alive)


def server_memory(limits: Limits) -> ServerMemory:
    a = shared_admission(limits).state()
    debuggers, debugger_bytes = debugger_caches()
    records, record_bytes = records_in_memory()
    return ServerMemory(tuple(held()), limits.max_models, a.running, a.running_bytes, debuggers, debugger_bytes,
                        records, record_bytes)
