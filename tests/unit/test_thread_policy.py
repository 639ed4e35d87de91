"""The thread policy (engine/threads.py) in the app's situation: torch work in a worker thread while other threads
hold OpenMP teams of their own, so that libgomp manages more threads than there are cores and spins its "throttled"
count. Under the engine's policy a small parallel op (a 49,152-wide sum and isfinite: a sampler stage's size) costs
in a worker thread beside other threads' teams about what it costs the main thread alone (0.97x here); under
PASSIVE with the same GOMP_SPINCOUNT (the policy until 2026-12-05) libgomp throttles the spin to 100 and the worker
thread's ops took 6.9x as long here (libgomp's defaults: 7.1x). Both in fresh interpreters, since libgomp reads the
variables when torch loads it (started in the tests' setups, measuring in their calls). A ratio within one process,
not a time."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.threads import POLICY

pytestmark = [pytest.mark.unit, pytest.mark.alone]     # it times ops against each other: by itself (tests/alone.py)

PROBE = r"""
import json, os, sys, threading, time
import torch
x = torch.randn(49152)
print("ready", flush=True)      # torch imported (the test's setup); it measures once told to (its call, alone)
sys.stdin.readline()
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


def _started(policy: dict[str, str]):
    """A fresh interpreter under `policy`, torch imported, waiting to measure; stopped after the test."""
    env = {k: v for k, v in os.environ.items() if k not in POLICY}
    env.update(policy, OMP_NUM_THREADS="2")         # parallel regions of two threads, whatever the tests' share
    proc = subprocess.Popen([sys.executable, "-c", PROBE], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ready = proc.stdout.readline().strip()
        assert ready == "ready", proc.stderr.read()[-2000:] if proc.poll() is not None else ready
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _ratio(proc) -> float:
    out, err = proc.communicate("go\n", timeout=120)
    assert proc.returncode == 0, err[-2000:]
    got = json.loads(out)
    return got["worker"] / got["alone"]


@pytest.fixture
def under_the_policy():
    yield from _started(POLICY)


@pytest.fixture
def throttled():
    yield from _started({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"})


def test_a_worker_threads_small_ops_cost_what_a_lone_thread_pays_under_the_policy(under_the_policy):
    assert POLICY == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "1000"}
    ratio = _ratio(under_the_policy)
    assert ratio < 2.0, (f"a worker thread's small ops beside other threads' teams took {ratio:.1f}x the lone main "
                         "thread's under the engine's policy")


def test_the_check_fails_under_the_throttled_policy(throttled):
    """The same probe under PASSIVE + 1,000 spins: the worker thread beside the other teams is slow (so the check
    above can fail)."""
    ratio = _ratio(throttled)
    assert ratio > 2.5, f"the throttled policy's worker thread took only {ratio:.1f}x the lone main thread's"
