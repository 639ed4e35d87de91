"""`python -m engine show` on every crafted trace: exactly one line `error: …` and exit status 2, under 5 s each,
and the process stays far below 2 GiB however large the file says its tensors are (or its JSON would grow)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import RunSettings
from engine.inspection.trace import to_bytes
from inspector.session.run import inspect_run
from tests.unit.test_hostile_traces import CASES

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parents[2]
# A launcher whose RUSAGE_CHILDREN covers only the one command it runs: the pytest process's own counter keeps
# the largest child it ever waited for (a server, a bench), which says nothing about `engine show`.
_LAUNCH = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
           "print('peak-kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
           "sys.exit(r.returncode)")


def _show(path: Path) -> tuple[subprocess.CompletedProcess, float]:
    """Run `python -m engine show PATH`; return the result (launcher line removed) and the command's peak MiB."""
    r = subprocess.run([sys.executable, "-c", _LAUNCH, sys.executable, "-m", "engine", "show", str(path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    head, _, tail = r.stderr.rpartition("peak-kib ")
    r.stderr = head
    return r, int(tail.split()[0]) / 1024


def test_show_refuses_every_crafted_trace(tiny_model, tmp_path):
    run = inspect_run(tiny_model, RunSettings(prompt="Hi there", chat=False, max_new_tokens=4))
    good = to_bytes(run)
    ok = tmp_path / "good.trace"
    ok.write_bytes(good)
    r = subprocess.run([sys.executable, "-m", "engine", "show", str(ok), "--json"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["generated_tokens"] == len(run.result.token_ids)
    t0 = time.perf_counter()           # what starting Python, torch and the engine costs on this machine now
    subprocess.run([sys.executable, "-m", "engine", "hooks", "--layers", "1"], cwd=ROOT, capture_output=True,
                   timeout=120, check=True)
    startup = time.perf_counter() - t0
    slow, peaks = [], []
    for i, (name, (craft, _words)) in enumerate(CASES.items()):
        f = tmp_path / f"crafted-{i}.trace"
        f.write_bytes(craft(good))
        t0 = time.perf_counter()
        r, peak_mib = _show(f)
        peaks.append((peak_mib, name))
        took = time.perf_counter() - t0 - startup     # the time spent on the crafted file
        assert r.returncode == 2, (name, r.stdout, r.stderr[-500:])
        assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, (name, r.stderr[-500:])
        if took >= 5:
            slow.append((name, round(took, 1)))
    assert not slow, slow
    assert max(peaks)[0] < 2048, max(peaks)
