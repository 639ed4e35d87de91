"""Tests marked `alone` measure time, latency, a schedule or a load (a p95 delay, a ratio of two speeds, who waited
in a queue); under pytest-xdist (`-n 2`, pytest.ini) the call of each runs with no other test's phase at once and
with every core for its threads and its servers, as on one process. Its setup and teardown (starting and stopping
its servers, loading its models), and every other test, run beside the other worker's tests.

Two file locks in the run's temporary folder, shared by its workers: a phase that is not an alone call passes through
the turnstile and holds the room shared; an alone call holds the turnstile (no new phase enters) and then the room
alone (the other worker's phase has ended). An alone call waits at most for the other worker's current phase; the
phases that follow wait for it, or until the test calls done_alone() (what it measures is over). conftest orders the
alone tests' modules first, so that their calls follow one another.
Without xdist (one process, `-n 0`) nothing is locked."""
from __future__ import annotations

import fcntl
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

_files: dict[str, object] = {}
_held: list = []                          # an alone call's (turnstile, room) while it holds them
WAITED = pytest.StashKey[dict]()          # item -> {phase: seconds it waited for its turn}


def done_alone() -> None:
    """Called by an alone test once what it measures is over: the rest of its call (checks of texts, records,
    counts; nothing timed) runs beside the other worker's phases. The room goes from exclusive to shared (the
    turnstile still held, so no other alone call slips in between: flock converts by unlocking first), then the
    turnstile opens. A no-op outside an alone call or without xdist."""
    if _held:
        turnstile, room = _held.pop()
        fcntl.flock(room, fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)


def waited(item, when: str) -> float:
    """Seconds the phase `when` of this test waited for its turn (not its own time: conftest takes it off)."""
    return item.stash.get(WAITED, {}).get(when, 0.0)


def _wait(item, when: str, lock, how) -> None:
    t0 = time.monotonic()
    fcntl.flock(lock, how)
    record = item.stash.setdefault(WAITED, {})
    record[when] = record.get(when, 0.0) + time.monotonic() - t0


def _lock(run: str, name: str):
    if name not in _files:
        _files[name] = open(Path(tempfile.gettempdir()) / f"llm-inspector-tests-{run}.{name}", "a+")
    return _files[name]


@contextmanager
def _every_core():
    """The worker's share of the cores (tests/conftest.py's OMP_NUM_THREADS) raised to all of them, for the test's
    own threads and for the servers it starts; put back afterwards. (torch, when the worker has imported it.)"""
    torch = sys.modules.get("torch")
    env, threads = os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads() if torch else None
    cores = os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(cores)
    if torch:
        torch.set_num_threads(cores)
    try:
        yield
    finally:
        if torch:
            torch.set_num_threads(threads)
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env


@contextmanager
def turn(item, when: str):
    """One phase of a test ("setup", "call", "teardown") in its turn: an alone call by itself, any other phase
    beside the other worker's; every phase of an alone test with every core."""
    run = getattr(item.config, "workerinput", {}).get("testrunuid")
    if run is None:
        yield
        return
    turnstile, room = _lock(run, "turnstile"), _lock(run, "room")
    alone = item.get_closest_marker("alone") is not None
    if alone and when == "call":
        _wait(item, when, turnstile, fcntl.LOCK_EX)
        try:
            _wait(item, when, room, fcntl.LOCK_EX)
            _held.append((turnstile, room))
            try:
                with _every_core():
                    yield
            finally:
                _held.clear()
                fcntl.flock(room, fcntl.LOCK_UN)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        return
    _wait(item, when, turnstile, fcntl.LOCK_EX)
    fcntl.flock(turnstile, fcntl.LOCK_UN)
    _wait(item, when, room, fcntl.LOCK_SH)
    try:
        if alone:
            with _every_core():
                yield
        else:
            yield
    finally:
        fcntl.flock(room, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    """The hooks (tests/conftest.py imports them; `-p tests.alone` for another suite): each phase in its turn."""
    with turn(item, "setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with turn(item, "call"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with turn(item, "teardown"):
        return (yield)


def pytest_sessionfinish(session, exitstatus):
    """The worker's lock files closed and removed from the temporary folder (a worker still running keeps its own
    open: it has nobody left to wait for)."""
    for f in _files.values():
        try:
            os.unlink(f.name)
        except FileNotFoundError:
            pass
        f.close()
    _files.clear()


def alone_first(items: list) -> None:
    """The alone tests' modules first, in their order, then the rest in theirs (a module is not split)."""
    alone = {i.nodeid.split("::")[0] for i in items if i.get_closest_marker("alone")}
    items.sort(key=lambda i: i.nodeid.split("::")[0] not in alone)       # a stable sort
