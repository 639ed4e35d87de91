"""The app's own benchmark: the server-side time to redraw the Sampling page from a run's cached logits.

    python3 -m inspector.session.bench          # bundled model
"""
from __future__ import annotations

from engine import Model, load_model
from inspector.views.sampling import redraw_seconds


def run_redraw_bench(model: Model) -> float:
    logits = model.logits(model.tokenizer.encode("The capital of France is"))[-1]
    secs = redraw_seconds(logits)
    print(f"sampling page redraw from cached logits: {secs:.3f} s (target < 0.3 s)")
    return secs


if __name__ == "__main__":
    run_redraw_bench(load_model())
