"""`python -m engine show` on every crafted trace: exactly one line `error: …` and exit status 2, under 5 s each,
and the process stays far below 2 GiB however large the file says its tensors are (or its JSON would grow). The
real command runs on the good file and the first crafted one; every crafted file then goes through the command's
entry point in one process of its own (a Python and torch start per file made this the suite's second slowest
test: 345 s)."""
from __future__ import annotations

import json
import subprocess
import sys
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


# Every crafted file through engine.cli.main, the entry point `python -m engine` runs, one after another in one
# process of its own (one Python and torch start, not one per file): each file's exit status, output and time,
# as JSON on stdout. The process's peak memory covers every file (the largest of them is what the test bounds).
_DRIVER = """
import contextlib, io, json, sys, time
from engine.cli import main
results = []
for path in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["show", path])
        except SystemExit as e:
            code = e.code
        except BaseException as e:                  # what `python -m engine` would end with a traceback on
            code = f"{type(e).__name__}: {e}"
    results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
                    "seconds": time.perf_counter() - t0})
print(json.dumps(results))
"""


def test_show_refuses_every_crafted_trace(tiny_model, tmp_path):
    run = inspect_run(tiny_model, RunSettings(prompt="Hi there", chat=False, max_new_tokens=4))
    good = to_bytes(run)
    ok = tmp_path / "good.trace"
    ok.write_bytes(good)
    r = subprocess.run([sys.executable, "-m", "engine", "show", str(ok), "--json"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["generated_tokens"] == len(run.result.token_ids)
    files, names = [], []
    for i, (name, (craft, _words)) in enumerate(CASES.items()):
        f = tmp_path / f"crafted-{i}.trace"
        f.write_bytes(craft(good))
        files.append(str(f))
        names.append(name)
    # the real command on the first crafted file: its exit status and its one line
    r, peak_mib = _show(Path(files[0]))
    assert r.returncode == 2, (names[0], r.stdout, r.stderr[-500:])
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, (names[0], r.stderr[-500:])
    assert peak_mib < 2048, (peak_mib, names[0])
    # every crafted file through the command's entry point, in one process
    d = subprocess.run([sys.executable, "-c", _LAUNCH, sys.executable, "-c", _DRIVER, *files], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    head, _, tail = d.stderr.rpartition("peak-kib ")
    peak_mib = int(tail.split()[0]) / 1024
    assert d.returncode == 0 and head == "", head[-2000:]        # nothing else on the process's own stderr
    results = json.loads(d.stdout)
    assert len(results) == len(names)
    slow = []
    for name, res in zip(names, results):
        assert res["code"] == 2, (name, res)
        assert res["stderr"].startswith("error: ") and res["stderr"].count("\n") == 1, (name, res["stderr"][-500:])
        if res["seconds"] >= 5:
            slow.append((name, round(res["seconds"], 1)))
    assert not slow, slow
    assert peak_mib < 2048, peak_mib                # the largest any of the files made the process
