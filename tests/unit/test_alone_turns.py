"""tests/alone.py, the suite's own scheduling under pytest-xdist: a small suite of sleeping tests run on two workers
with the hook as a plugin; each test records when it ran. An `alone` test overlaps no other test, while the
others do run two at once (or the check would hold with one worker). Without the locks (the plugin left out) the
alone tests overlap others, so this check fails there."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]

SUITE = '''
import os, time, pytest

def rec(name, s=0.25):
    t0 = time.monotonic()
    time.sleep(s)
    with open(os.environ["TURNS_LOG"], "a") as f:
        f.write(f"{name} {t0} {time.monotonic()}\\n")

@pytest.mark.parametrize("i", range(4))
def test_alone(i):
    rec("alone")

test_alone = pytest.mark.alone(test_alone)

@pytest.mark.parametrize("i", range(8))
def test_beside(i):
    rec("beside")
'''


RELEASED = SUITE + '''
@pytest.mark.alone
def test_measures_then_checks():
    rec("timed")
    from tests.alone import done_alone
    done_alone()
    rec("tail", 1.0)

@pytest.mark.parametrize("i", range(4))
def test_beside_the_tail(i):
    rec("beside")
'''


def start(tmp_path: Path, plugin: bool, suite: str = SUITE):
    """The sleepers' suite on two workers, started (a subprocess; `rows` reads what it logged once it has ended)."""
    (tmp_path / "test_sleepers.py").write_text(suite)
    env = {**os.environ, "TURNS_LOG": str(tmp_path / "turns.log"), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-c", os.devnull, "--rootdir", str(tmp_path), "-p", "no:cacheprovider",
           "-n", "2", "--dist", "load", "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path)]
    if plugin:
        cmd[4:4] = ["-p", "tests.alone"]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def rows(proc, tmp_path: Path) -> list[tuple[str, float, float]]:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    got = [line.split() for line in (tmp_path / "turns.log").read_text().splitlines()]
    return [(name, float(a), float(b)) for name, a, b in got]


def overlaps(rows, kind_a: str, kind_b: str) -> int:
    return sum(1 for i, (na, a0, a1) in enumerate(rows) for j, (nb, b0, b1) in enumerate(rows)
               if i < j and {na, nb} == {kind_a, kind_b} and a0 < b1 and b0 < a1)


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> dict[str, list[tuple[str, float, float]]]:
    """The sleepers run twice at the same time (they mostly sleep; each run has its own locks): with the plugin
    (alone tests, one that calls done_alone, and others) and without it."""
    on, off = tmp_path_factory.mktemp("turns"), tmp_path_factory.mktemp("no-turns")
    runs = {"with": (start(on, plugin=True, suite=RELEASED), on), "without": (start(off, plugin=False), off)}
    return {k: rows(proc, path) for k, (proc, path) in runs.items()}


def test_an_alone_test_overlaps_no_other_and_the_others_run_two_at_once(both):
    rows = both["with"]
    assert len(rows) == 18
    assert overlaps(rows, "alone", "beside") == 0 and overlaps(rows, "alone", "alone") == 0, rows
    assert overlaps(rows, "alone", "timed") == 0 and overlaps(rows, "alone", "tail") == 0, rows
    assert overlaps(rows, "beside", "beside") >= 2, rows          # two workers did run at once


def test_without_the_turns_the_same_suite_overlaps(both):
    """The check above can fail: the same suite without the plugin runs alone tests beside others."""
    rows = both["without"]
    assert overlaps(rows, "alone", "beside") + overlaps(rows, "alone", "alone") > 0, rows


def test_after_done_alone_the_rest_of_the_call_runs_beside_the_others(both):
    """tests.alone.done_alone(): the measured part stays alone, the checks after it share the machine."""
    rows = both["with"]
    assert overlaps(rows, "timed", "beside") == 0, rows
    assert overlaps(rows, "tail", "beside") >= 1, rows
