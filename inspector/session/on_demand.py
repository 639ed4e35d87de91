"""What a page's on-demand computation (an attention map, the entropy overview, the logit lens, the copy
attention, the report) says while it runs: its progress line, and the time it should take, measured from the
previous computation of the same kind with the same model in this process (nothing is said before one
finished). The kind is the computation's description with its numbers taken out ("layer N's attention over N
positions"): a map that materialises one layer's pattern and a forward that keeps the fused kernel throughout
run at different speeds per position-layer."""
from __future__ import annotations

import re
import threading

from engine.progress import Progress

_rates: dict[tuple, float] = {}        # (model name, device, dtype, kind) -> seconds per position-layer, the latest
_lock = threading.Lock()


def _key(model, what: str) -> tuple:
    return (model.name, model.device.type, str(model.dtype), re.sub(r"\d[\d,]*", "N", what))


def record_rate(model, what: str, seconds: float, last: Progress | None) -> None:
    """Remember how fast a finished computation went: seconds over the positions × layers it ran (its last
    progress record says how many). Nothing is learnt from a computation that reported no progress."""
    if last is None or last.total <= 0 or last.layers <= 0 or seconds <= 0:
        return
    with _lock:
        _rates[_key(model, what)] = seconds / (last.total * last.layers)


def estimate(model, what: str, positions: int, layers: int) -> float | None:
    """Seconds a computation over positions × layers should take at the measured rate; None before any."""
    with _lock:
        rate = _rates.get(_key(model, what))
    return None if rate is None else rate * positions * layers


def about(seconds: float | None) -> str:
    """'about 12 s' (or '' when nothing was measured)."""
    if seconds is None:
        return ""
    return f"about {seconds:,.0f} s" if seconds >= 1 else "under a second"


def progress_text(p: Progress) -> str:
    """'layer 12 of 30 · 1,024 positions', or with chunks 'layer 12 of 30 · positions 512–1,023 of 2,000'."""
    where = (f"{p.total:,} positions" if p.done == 0 and p.chunk_end >= p.total
             else f"positions {p.done:,}–{p.chunk_end - 1:,} of {p.total:,}")
    return f"layer {p.layer} of {p.layers} · {where}"
