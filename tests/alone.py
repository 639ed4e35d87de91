"""Tests marked `alone` measure time, latency, a schedule or a load (a p95 delay, a ratio of two speeds, who waited
in a queue); under pytest-xdist (`-n 2`, pytest.ini) each runs with no other test at once and with every core for
its threads and its servers, as on one process. Every other test runs beside the other worker's.

Two file locks in the run's temporary folder, shared by its workers: a test that is not alone passes through the
turnstile and holds the room shared; an alone test holds the turnstile (no new test enters) and then the room
alone (the other worker's test has ended). An alone test waits at most for the other worker's current test; the
tests that follow wait for it. conftest orders the alone tests first, so they run one after another, not each
after a wait. Without xdist (one process, `-n 0`) nothing is locked."""
from __future__ import annotations

import fcntl
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

_files: dict[str, object] = {}


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
def turn(item):
    """The whole of one test (setup, call, teardown) in its turn: alone, or beside the other worker's test."""
    run = getattr(item.config, "workerinput", {}).get("testrunuid")
    if run is None:
        yield
        return
    turnstile, room = _lock(run, "turnstile"), _lock(run, "room")
    if item.get_closest_marker("alone"):
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(room, fcntl.LOCK_EX)
            try:
                with _every_core():
                    yield
            finally:
                fcntl.flock(room, fcntl.LOCK_UN)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
    else:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(room, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The hook (tests/conftest.py imports it; `-p tests.alone` for another suite): each test in its turn."""
    with turn(item):
        return (yield)


def alone_first(items: list) -> None:
    """The alone tests' modules first, in their order, then the rest in theirs (a module is not split)."""
    alone = {i.nodeid.split("::")[0] for i in items if i.get_closest_marker("alone")}
    items.sort(key=lambda i: i.nodeid.split("::")[0] not in alone)       # a stable sort
