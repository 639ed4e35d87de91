"""The thread policy of every entry point (the app, `python -m engine`, bench, tests): chosen here, once, before torch
loads libgomp (engine/__init__.py imports this module first; libgomp reads its variables when it is loaded).

OpenMP threads that wait at a barrier spin 1,000 times, then sleep (GOMP_SPINCOUNT=1000 with OMP_WAIT_POLICY=PASSIVE;
libgomp's default spins ~300,000 times). Measured on this 2-core machine (2026-12-04, bundled model, 40-token decodes
without a probe, the median of three; "beside" = beside one competing torch process that multiplies matrices with
libgomp's default spin; tok/s):

    policy                        alone   beside one busy process (separate trials)
    libgomp default spin (ACTIVE)  53.7    7.9
    PASSIVE (sleep at once)        27.8    37.1 39.2 33.1 40.6
    spin 30,000 then sleep         52.8    26.4 27.4 27.0 38.4 33.9 8.5
    spin 10,000 then sleep         48.3    37.6 32.2 8.7 6.0 7.4 23.8
    spin 1,000 then sleep          51.3    21.1 31.4 24.1 22.9

Sleeping at once halves the lone user's decode (each of a token's many parallel regions pays a wake-up); spinning
long stalls beside another busy process (both spin on the cores the other needs). 1,000 spins keep the lone decode
within noise of spinning and never stalled in these trials (the batched step, engine.batch, puts a class's tokens
into one OpenMP team, so the app's runs do not add teams). Earlier, at load average 6-9 (many busy processes):
spin 100,000 3.9 tok/s, 10,000 5.6, 1,000 11.2, PASSIVE 11.4-33.0.
A variable already set in the environment is left as it is (OMP_WAIT_POLICY=ACTIVE with GOMP_SPINCOUNT=300000 brings
libgomp's default spinning back)."""
from __future__ import annotations

import os

POLICY = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}


def apply() -> dict[str, str]:
    """Set the policy's variables that the environment does not set already; the policy in force."""
    for k, v in POLICY.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in POLICY}


apply()
