"""The thread policy (engine/threads.py) is in force in every entry point's interpreter before torch loads libgomp,
and the benchmark that measures what it buys (engine/bench/thread_policy.py, reported by `bench --class`) runs. The
speed ratios themselves are a benchmark's figures, not asserted here: a loaded machine moves them (README,
Benchmark)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from engine.bench.thread_policy import THROTTLED, worker_over_alone
from engine.threads import FIXED, POLICY

pytestmark = pytest.mark.unit
SHOW = ("import json, os, sys; {imp}; print(json.dumps({{'env': {{k: os.environ.get(k) for k in {keys!r}}}, "
        "'torch_first': {torch_first}}}))")


@pytest.mark.parametrize("imp", ["import engine", "import engine.cli", "import inspector.session.run"])
def test_every_entry_point_sets_the_policy_before_torch_loads(imp):
    """A fresh interpreter with none of the variables set: importing the entry point sets POLICY and FIXED, and
    engine.threads ran before torch was imported (libgomp reads the variables when torch loads it)."""
    keys = (*POLICY, *FIXED)
    env = {k: v for k, v in os.environ.items() if k not in keys}
    code = SHOW.format(imp=("import builtins; _seen = []; _imp = builtins.__import__\n"
                            "def _watch(name, *a, **k):\n"
                            "    if name == 'torch' and not _seen: _seen.append('threads' if 'engine.threads' in "
                            "sys.modules else 'torch')\n"
                            "    return _imp(name, *a, **k)\n"
                            f"builtins.__import__ = _watch\n{imp}"),
                       keys=keys, torch_first="_seen[:1] == ['torch']")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["env"] == {**POLICY, **FIXED}
    assert got["torch_first"] is False, f"{imp} imported torch before engine.threads set the policy"


def test_a_set_environment_wins_over_the_policy_but_not_over_fixed():
    env = {k: v for k, v in os.environ.items() if k not in (*POLICY, *FIXED)}
    env.update(OMP_WAIT_POLICY="PASSIVE", OMP_DYNAMIC="true")
    code = "import os, engine; print(os.environ['OMP_WAIT_POLICY'], os.environ['OMP_DYNAMIC'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["PASSIVE", "false"]


def test_the_policy_benchmark_measures_both_policies():
    """The probe runs under each policy in a fresh interpreter and gives a ratio (its size is the bench's)."""
    assert THROTTLED["OMP_WAIT_POLICY"] != POLICY["OMP_WAIT_POLICY"]
    for policy in (POLICY, THROTTLED):
        r = worker_over_alone(policy)
        assert math.isfinite(r) and r > 0
