"""Microbench of the batched native decode step (engine/native/decode_rows.c, NativeDecoder.rows) on the bundled
model: per call, wall seconds and this process's CPU seconds over the team's threads, at 1 / 2 / 8 / 30 rows (the
products' kernel is row_product.h's product_rows). Prints one line per size: the median of `--reps` calls.

    python scripts/bench_rows.py [--dtype float32] [--reps 15] [--rows 1,2,8,30] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import engine  # noqa: F401  (first: the thread policy, before torch loads libgomp)
import torch
from engine.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", default="1,2,8,30")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = load_model(None, dtype=a.dtype)
    dec = model.accelerator.decode
    if dec is None:
        raise SystemExit("the native decode step is unavailable here")
    print(f"{model.name} {model.dtype}, {a.threads} threads, load average {os.getloadavg()[0]:.2f}")
    for B in (int(n) for n in a.rows.split(",")):
        caches = [model.new_cache(64) for _ in range(B)]
        tokens, positions = [100 + 7 * b for b in range(B)], [b % 16 for b in range(B)]
        dec.rows(tokens, caches, positions, model.config.rms_eps if hasattr(model.config, "rms_eps") else 1e-5,
                 False)
        wall, cpu = [], []
        for _ in range(a.reps):
            c0, w0 = time.process_time(), time.perf_counter()
            dec.rows(tokens, caches, positions, 1e-5, False)
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
        print(f"B={B:3d}  wall {statistics.median(wall) * 1e3:7.1f} ms  cpu/thread "
              f"{statistics.median(cpu) / a.threads * 1e3:7.1f} ms  ({statistics.median(wall) * 1e3 / B:6.2f} ms a row)")


if __name__ == "__main__":
    main()
