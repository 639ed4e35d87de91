"""OpenMP's dynamic team sizes stay off under the engine's thread policy (engine/threads.py: FIXED) whatever the
environment says. With them on, libgomp gives each parallel region the cores less the 15-minute load average, and
the native step's products (engine/native/decode.c) and torch's reductions split their sums by the team they get:
measured here beside a load of 9-10, a decode's statistics under OMP_DYNAMIC=true were those of one thread, not two.
In a fresh interpreter, since libgomp reads the variable when torch loads it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PROBE = ("import ctypes, engine, torch; torch.ones(4).sum(); "
         "print(ctypes.CDLL('libgomp.so.1').omp_get_dynamic(), torch.get_num_threads())")


def test_dynamic_team_sizes_are_off_even_when_the_environment_turns_them_on():
    env = dict(os.environ, OMP_DYNAMIC="true", OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    dynamic, threads = out.stdout.split()[-2:]
    assert (dynamic, threads) == ("0", "2"), out.stdout       # off, and the thread count asked for is kept
