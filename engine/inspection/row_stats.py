"""The statistics backends' one interface. A forward's stage statistics (engine.inspection.stats.StatsBatcher)
and attention statistics (engine.inspection.attention_stats) ask a `StatsBackend` for a fast pass and fall
back to the PyTorch code, which stays the reference, wherever it declines:

- `layout(x)`: whether (and how) the backend takes tensor x (None: not this one);
- `rows(xs, alloc, lays)`: (T, 7) statistics per row of each tensor (None for one holding a NaN or Inf, None
  for all when unavailable), written into alloc(rows);
- `attention(p, qh, keys, values, offset, want)`: a causal layer's score / pattern statistics offered to the
  probe view p; False when not done.

`PYTORCH` declines everything (the PyTorch paths: moments at the flush, the exact two-pass path). The native
backend is engine.native.inspect.NATIVE. Which one a model uses is chosen once, when the model is built
(engine.accelerator.choose), and handed to each probe at the start of a forward call."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class StatsBackend:
    name: str
    layout: Callable
    rows: Callable
    attention: Callable


PYTORCH = StatsBackend("pytorch", layout=lambda x: None, rows=lambda xs, alloc=None, lays=None: None,
                       attention=lambda p, qh, keys, values, off, want: False)
