"""The thread policy of every entry point (the app, `python -m engine`, bench, tests): chosen here, once, before torch
loads libgomp (engine/__init__.py imports this module first; libgomp reads its variables when it is loaded).

OpenMP threads that wait at a barrier sleep (OMP_WAIT_POLICY=PASSIVE) instead of spinning (libgomp's default spins
~300,000 times). Measured on the 2-core machine shared with other busy processes (load average 6-9, bundled model,
decode without a probe, median of 3 runs of 24 tokens): spinning 2.1-3.9 tok/s, GOMP_SPINCOUNT=100000 3.9,
GOMP_SPINCOUNT=10000 5.6, GOMP_SPINCOUNT=1000 11.2, PASSIVE 11.4-33.0. A spinning thread burns the core its partner
(or another run, session or process) needs; the batched step (engine.batch) puts a class's tokens into one OpenMP
team instead of many, so the lone user's cost of sleeping threads is paid once per step, not once per run.
A variable already set in the environment is left as it is (OMP_WAIT_POLICY=ACTIVE brings the spinning back)."""
from __future__ import annotations

import os

POLICY = {"OMP_WAIT_POLICY": "PASSIVE"}


def apply() -> dict[str, str]:
    """Set the policy's variables that the environment does not set already; the policy in force."""
    for k, v in POLICY.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in POLICY}


apply()
