"""The thread policy of every entry point (the app, `python -m engine`, bench, tests): chosen here, once, before torch
loads libgomp (engine/__init__.py imports this module first; libgomp reads its variables when it is loaded).

OpenMP threads that wait at a barrier spin 1,000 times, then sleep: GOMP_SPINCOUNT=1000 with OMP_WAIT_POLICY=ACTIVE.
ACTIVE matters when libgomp manages more threads than there are cores, which is the app's usual state: every Python
thread that runs torch work (each run's thread, the Streamlit script threads, the step barrier's leader) gets an
OpenMP team of its own. libgomp then uses its "throttled" spin count instead of GOMP_SPINCOUNT: 1,000 under ACTIVE,
but 100 under PASSIVE or with no policy set (libgomp's env.c), so a waiting thread sleeps almost at once and every
parallel region of a small op pays a futex wake-up. Measured here (2026-12-05): a 49,152-wide sum and isfinite in a
worker thread took 340-360 us under PASSIVE + 1,000 (and under libgomp's default), 50-58 us under ACTIVE + 1,000, as
in the main thread; the bundled model's 40-token decode with a second thread holding a team (the app's case), tok/s:

    policy                          main thread: alone / beside one busy process    a worker thread: alone / beside
    ACTIVE + spin 1,000 (this one)   42.6 / 18.5-19.0                                42.0 / 18.4-19.5
    PASSIVE + spin 1,000 (before)    25.4 / 10.4-13.6                                25.7 / 10.2-21.8

and the app's path for one user (`python -m engine bench --class`, a 32-token answer with full inspection in its
own thread) 1.50 s before, 0.99 s after. Earlier measurements in the main thread alone (2026-12-04, no second
team, so no throttling; 40-token decodes without a probe, median of three, tok/s alone / beside one busy process in
separate trials):

    libgomp default spin (ACTIVE)  53.7    7.9
    PASSIVE (sleep at once)        27.8    37.1 39.2 33.1 40.6
    spin 30,000 then sleep         52.8    26.4 27.4 27.0 38.4 33.9 8.5
    spin 10,000 then sleep         48.3    37.6 32.2 8.7 6.0 7.4 23.8
    spin 1,000 then sleep          51.3    21.1 31.4 24.1 22.9

Sleeping at once halves the lone user's decode (each of a token's many parallel regions pays a wake-up); spinning
long stalls beside another busy process (both spin on the cores the other needs). 1,000 spins keep the lone decode
within noise of spinning and never stalled in these trials. Earlier, at load average 6-9 (many busy processes):
spin 100,000 3.9 tok/s, 10,000 5.6, 1,000 11.2, PASSIVE 11.4-33.0.
A variable already set in the environment is left as it is (GOMP_SPINCOUNT=300000 brings libgomp's long spin back).

One variable is set whatever the environment says, because a result depends on it: OMP_DYNAMIC=false (FIXED).
Every parallel reduction here splits its sum by the team it actually gets (decode.c's products: one block of rows
a thread, then the blocks' partial sums added; torch's at::parallel_for chunks by omp_get_num_threads()), so the
team's size decides the order of the additions. With dynamic adjustment on, libgomp sizes each team as the cores
less the 15-minute load average (its proc.c), so a run's numbers would move with the machine's load. Measured here
(2026-12-07, load average 9-10 on two cores, the bundled model's decode statistics of three steps, 6,688 of them):
with OMP_DYNAMIC=true, two threads asked for, every step ran on a team of one and its statistics were bit for bit
those of OMP_NUM_THREADS=1, and 6,688 of them differed from those of a team of two; with dynamic adjustment off,
repeated runs beside a busy process were bit for bit equal. A different thread count asked for (OMP_NUM_THREADS,
torch.set_num_threads) still gives different rounding, as it should: that is a setting, not the load."""
from __future__ import annotations

import contextlib
import ctypes
import os

POLICY = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "1000"}
FIXED = {"OMP_DYNAMIC": "false"}     # set over the environment's: a team's size must not follow the load


def apply() -> dict[str, str]:
    """Set the policy's variables that the environment does not set already, and FIXED's whatever it sets; the
    policy in force."""
    for k, v in POLICY.items():
        os.environ.setdefault(k, v)
    os.environ.update(FIXED)
    return {k: os.environ[k] for k in (*POLICY, *FIXED)}


apply()


@contextlib.contextmanager
def one_thread():
    """This thread's torch and OpenMP work on one thread for the block; other threads keep their teams. For a run of
    small ops (a sampler's 49,152-wide stages: each a few tens of microseconds), where a second thread of the team
    costs a wake-up per op (it spins 1,000 times, then sleeps): thirty runs' steps in one thread (engine.batch's
    leader) took 65-70 ms on two threads, 41 ms on one (2026-12-05). It sets this thread's OpenMP thread count in the
    libgomp torch loaded (omp_set_num_threads is per thread; torch.set_num_threads would also change the count every
    thread started meanwhile takes); a no-op where that libgomp is not found or torch does not follow it."""
    lib = _gomp()
    if lib is None:
        yield
        return
    before = lib.omp_get_max_threads()
    lib.omp_set_num_threads(1)
    try:
        yield
    finally:
        lib.omp_set_num_threads(before)


_GOMP: list = []


def _gomp():
    """The libgomp torch uses (None if there is none, or torch's thread count does not follow it)."""
    if not _GOMP:
        lib = None
        try:
            import torch
            torch.get_num_threads()             # torch's OpenMP initialised in this thread before the check
            cand = ctypes.CDLL("libgomp.so.1")
            before = cand.omp_get_max_threads()
            cand.omp_set_num_threads(max(1, before - 1) if before > 1 else before)
            follows = before == 1 or torch.get_num_threads() == before - 1
            cand.omp_set_num_threads(before)
            lib = cand if follows else None
        except (OSError, AttributeError):
            lib = None
        _GOMP.append(lib)
    return _GOMP[0]
