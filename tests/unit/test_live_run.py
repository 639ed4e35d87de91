"""The sidebar's background run (inspector.session.live_run): Stop ends it where it is and keeps what it made, a Stop
while queued leaves the queue, the prefill is heard by chunk and layer, and the estimate's fit is exact on
data it can represent."""
from __future__ import annotations

import importlib
import threading
import time

import pytest

from engine import RunSettings
from engine.model import Model
from inspector.session.admission import shared_admission
from inspector.session.estimate import fit_prefill
from inspector.session.limits import Limits
from inspector.session.live_run import Cancelled, LiveRun, Rates


def slow(monkeypatch, seconds: float) -> None:
    forward = Model.forward

    def slow_forward(self, *a, **kw):
        time.sleep(seconds)
        return forward(self, *a, **kw)
    monkeypatch.setattr(Model, "forward", slow_forward)


def wait_for(cond, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_stop_ends_the_run_after_the_current_token_and_keeps_it(tiny_model, monkeypatch):
    slow(monkeypatch, 0.1)
    live = LiveRun(RunSettings(prompt="count with me", max_new_tokens=40, ignore_eos=True), tiny_model.name, 0)
    live.start(tiny_model, Limits())
    wait_for(lambda: live.tokens >= 3)
    live.stop()
    assert live.wait(30) and live.error is None
    r = live.record.result
    assert r.stop_reason == "stopped" and 3 <= len(r.token_ids) < 40
    assert len(r.token_ids) == live.tokens and r.text.startswith(live.text)     # what was shown is what is kept
    assert live.waited_s is None and live.admitted_at is not None and tiny_model.live_hooks == 0


def hold_the_slot(limits: Limits, client: str) -> tuple[threading.Thread, threading.Event]:
    """A thread holding the only device slot for `client` until the returned event is set."""
    held, leave = threading.Event(), threading.Event()

    def hold():
        with shared_admission(limits).slot(client=client):
            held.set()
            leave.wait(20)
    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(10)
    return t, leave


def test_stop_while_queued_leaves_the_queue(tiny_model):
    limits = Limits(max_concurrent_runs=1)
    t, leave = hold_the_slot(limits, "someone else")
    try:
        live = LiveRun(RunSettings(prompt="hello", max_new_tokens=3), tiny_model.name, 0).start(tiny_model, limits)
        wait_for(lambda: live.queue_position == 1)
        live.stop()
        assert live.wait(5) and isinstance(live.error, Cancelled) and live.record is None
        assert shared_admission(limits).state().waiting == 0 and live.first_position == 1
    finally:
        leave.set()
        t.join(10)


def test_the_prefill_is_heard_by_chunk_and_layer(tiny_model, monkeypatch):
    progress = importlib.import_module("engine.progress")     # where the prefill's chunk size lives
    monkeypatch.setattr(progress, "PREFILL_CHUNK", 8)
    seen = []
    live = LiveRun(RunSettings(prompt="one two three four five six seven eight nine ten", chat=False,
                               max_new_tokens=2), tiny_model.name, 0)
    orig = type(live).admitted

    def spy(self):
        if self.prefill is not None:
            seen.append((self.prefill.done, self.prefill.layer))
        orig(self)
    monkeypatch.setattr(LiveRun, "admitted", spy)
    live.start(tiny_model, Limits())
    assert live.wait(30) and live.error is None
    n = len(live.record.result.prompt_ids)
    assert n > 8 and {d for d, _ in seen} == set(range(0, n, 8))          # every chunk was heard
    assert {lay for _, lay in seen} == set(range(tiny_model.config.num_layers + 1))
    assert live.prefill.fraction == 1.0


def test_prefill_fit_recovers_a_linear_plus_quadratic_cost():
    a, b = 2e-3, 5e-7
    samples = [(n, a * n + b * n * n) for n in (100, 400, 1600)]
    assert fit_prefill(samples).seconds(3750) == pytest.approx(a * 3750 + b * 3750 ** 2, rel=1e-9)
    assert fit_prefill([(100, 0.5)]).seconds(400) == pytest.approx(2.0)              # one length: proportional
    assert fit_prefill([(100, 1.0), (200, 2.0)]).seconds(300) == pytest.approx(3.0)   # linear data stays linear


def test_rates_estimate_from_kept_runs(tiny_model):
    from inspector.session.run import inspect_run
    rec = inspect_run(tiny_model, RunSettings(prompt="hello there", max_new_tokens=5, ignore_eos=True))
    r = Rates()
    assert r.forecast(10, 5) is None
    r.add(rec)
    est = r.forecast(len(rec.result.prompt_ids), 5)
    pre, dec = est.prefill, est.decode
    assert pre == pytest.approx(rec.result.timings["prefill"]) and dec == pytest.approx(rec.result.timings["decode"])


def test_runs_started_from_one_browser_queue_as_that_browser(tiny_model):
    """The app resolves the browser in the script thread and hands it to the run: the worker thread itself
    sees no browser cookie, and a third run from the same browser (one running, one waiting) is refused."""
    limits = Limits(max_concurrent_runs=1)
    t, leave = hold_the_slot(limits, "browser:tabs")
    try:
        settings = RunSettings(prompt="hello", max_new_tokens=2)
        waiting = LiveRun(settings, tiny_model.name, 0, client="browser:tabs").start(tiny_model, limits)
        wait_for(lambda: waiting.queue_position is not None)
        third = LiveRun(settings, tiny_model.name, 0, client="browser:tabs").start(tiny_model, limits)
        assert third.wait(10)
        assert "You already have 1 run(s) generating and 1 waiting" in str(third.error)
        other = LiveRun(settings, tiny_model.name, 0, client="browser:other").start(tiny_model, limits)
        wait_for(lambda: other.queue_position is not None)          # another browser waits its turn
    finally:
        leave.set()
        t.join(10)
    assert waiting.wait(30) and other.wait(30) and waiting.error is None and other.error is None
