"""The thread policy (engine.threads) in the app's situation, measured: torch work in a worker thread while other
threads hold OpenMP teams of their own, so that libgomp manages more threads than there are cores and spins its
"throttled" count. A small parallel op (a 49,152-wide sum and isfinite: a sampler stage's size) is timed in the main
thread alone and then in a worker thread beside those teams, in a fresh interpreter per policy (libgomp reads the
variables when torch loads it). Under the engine's policy the worker's op cost 0.97x the lone thread's here; under
PASSIVE with the same GOMP_SPINCOUNT (the policy until 2026-12-05) libgomp throttles the spin to 100 and the worker's
ops took 6.9x (libgomp's defaults: 7.1x). Ratios within one process, reported by `bench --class`
(policy_worker_over_alone, throttled_worker_over_alone), never asserted by a test: a loaded machine moves them."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from engine.threads import POLICY

THROTTLED = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}
PROBE = r"""
import json, os, threading, time
import torch
x = torch.randn(49152)
def per_op():
    for _ in range(200):
        x.sum(); torch.isfinite(x)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(300):
            x.sum(); torch.isfinite(x)
        best = min(best, (time.perf_counter() - t) / 300)
    return best
alone = per_op()                # the main thread, the only OpenMP team: libgomp spins GOMP_SPINCOUNT
held = threading.Event()
def hold():                     # threads with OpenMP teams of their own, kept alive (the app's other threads)
    torch.randn(100000).sum()
    held.wait()
holders = [threading.Thread(target=hold) for _ in range(os.cpu_count() or 1)]
for h in holders:
    h.start()
time.sleep(0.2)
out = []
w = threading.Thread(target=lambda: out.append(per_op()))
w.start(); w.join()
held.set()
print(json.dumps({"alone": alone, "worker": out[0]}))
"""


def worker_over_alone(policy: dict[str, str], timeout_s: float = 120.0) -> float:
    """A worker thread's small op beside other threads' teams over the lone main thread's, in a fresh interpreter
    under `policy` (two threads a parallel region)."""
    env = {k: v for k, v in os.environ.items() if k not in POLICY}
    env.update(policy, OMP_NUM_THREADS="2")
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the thread-policy probe failed: {done.stderr[-2000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return got["worker"] / got["alone"]


def thread_policy_bench() -> dict[str, float]:
    return {"policy_worker_over_alone": worker_over_alone(POLICY),
            "throttled_worker_over_alone": worker_over_alone(THROTTLED)}
