"""Decode speed of a GGUF file kept in its blocks in both arithmetics, against its memory floor: quant="stored" (the
file's exact weights times an fp32 x) and quant="stored-int8" (llama.cpp's: x rounded to 8 bits, integer dots),
turn by turn on one load (the int8 model's matrices with their arithmetic set back to "float" share its blocks: one
copy of the file in memory), each turn `--tokens` native decode steps of each, then the floor: the blocks' bytes
over a large torch read's speed (a sum over a float32 tensor of `--read-mb` MB) measured in the same turn. Prints
each turn and the medians (tokens a second, and their ratio to the floor's).

    PYTHONPATH=. python3 scripts/bench_int8.py [FILE.gguf] [--tokens 16] [--turns 5] [--read-mb 1024]

Without FILE: the bench's 8B-shaped Q4_K file ($LLM_INSPECTOR_CACHE or ~/.cache/llm-inspector, bench-sizes/).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path

import engine  # noqa: F401  (first: the thread policy, before torch loads libgomp)
import torch
from engine.loader import load_model
from engine.model import Model
from engine.quant_matrix import QuantMatrix


def default_file() -> Path:
    root = Path(os.environ.get("LLM_INSPECTOR_CACHE") or Path.home() / ".cache" / "llm-inspector")
    return root / "bench-sizes" / "llama-3.1-8b.Q4_K.v2.gguf"


def in_arithmetic(model: Model, arithmetic: str) -> Model:
    """The same model, its int8 matrices multiplied in `arithmetic` instead (the blocks shared, not copied)."""
    def f(t):
        return t.with_arithmetic(arithmetic) if isinstance(t, QuantMatrix) and t.arithmetic == "int8" else t
    w = model.weights
    layers = [dataclasses.replace(lw, **{x.name: f(getattr(lw, x.name)) for x in dataclasses.fields(lw)})
              for lw in w.layers]
    embed = f(w.embed)
    head = embed if w.lm_head is w.embed else f(w.lm_head)
    return Model(model.config, dataclasses.replace(w, embed=embed, layers=layers, lm_head=head), model.tokenizer,
                 device=model.device, dtype=model.dtype, name=f"{model.name} ({arithmetic})", path=model.path,
                 native_decode=True)


def decode_seconds(model: Model, tokens: int) -> float:
    """Seconds a token of `tokens` native decode steps after a 4-token prompt."""
    kv = model.new_cache(tokens + 8)
    model.forward(torch.tensor([1, 2, 3, 4]), kv, last_only=True)
    start = time.perf_counter()
    for i in range(tokens):
        model.forward(torch.tensor([5 + i]), kv)
    return (time.perf_counter() - start) / tokens


def read_gb_s(t: torch.Tensor) -> float:
    start = time.perf_counter()
    t.sum()
    return t.numel() * 4 / (time.perf_counter() - start) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file", nargs="?", default=None)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--read-mb", type=int, default=1024)
    a = ap.parse_args()
    path = Path(a.file) if a.file else default_file()
    int8 = load_model(path, quant="stored-int8")
    exact = in_arithmetic(int8, "float")
    for m in (int8, exact):
        if m.accelerator.decode is None:
            raise SystemExit(f"no native decode step: {m.accelerator.why_not}")
    held = sum(t.nbytes for t in int8.weights.all() if isinstance(t, QuantMatrix))
    held += sum(t.numel() * t.element_size() for t in int8.weights.all() if isinstance(t, torch.Tensor))
    big = torch.ones(a.read_mb * 250_000)
    print(f"{path.name}: {held / 1e9:.2f} GB held; notes: {int8.weights.notes or 'none'}; threads "
          f"{torch.get_num_threads()}; load {os.getloadavg()[0]:.1f}")
    decode_seconds(int8, 2), decode_seconds(exact, 2), read_gb_s(big)          # warm
    rows = []
    for turn in range(a.turns):
        order = [("stored", exact), ("stored-int8", int8)][:: 1 if turn % 2 == 0 else -1]
        got = {name: 1 / decode_seconds(m, a.tokens) for name, m in order}
        floor = held / (max(read_gb_s(big) for _ in range(3)) * 1e9)          # seconds a token at the floor
        rows.append({**got, "floor": 1 / floor})
        print(f"turn {turn}: stored {got['stored']:.2f} tok/s ({got['stored'] * floor:.2f} of the floor), "
              f"stored-int8 {got['stored-int8']:.2f} tok/s ({got['stored-int8'] * floor:.2f}), floor "
              f"{1 / floor:.2f} tok/s; load {os.getloadavg()[0]:.1f}")
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    ratio = {k: statistics.median(r[k] / r["floor"] for r in rows) for k in ("stored", "stored-int8")}
    print(f"median: stored {med['stored']:.2f} tok/s ({ratio['stored']:.2f} of the floor), stored-int8 "
          f"{med['stored-int8']:.2f} tok/s ({ratio['stored-int8']:.2f}), floor {med['floor']:.2f} tok/s; int8 / "
          f"stored {statistics.median(r['stored-int8'] / r['stored'] for r in rows):.2f}")


if __name__ == "__main__":
    main()
