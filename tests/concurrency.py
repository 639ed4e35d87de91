"""Twenty sessions on one shared model at once (imported as tests.concurrency by the concurrency tests): each
must give its single-user output, and a round that stalls fails with every thread's stack instead of hanging
the suite."""
from __future__ import annotations

import faulthandler
import os
import select
import subprocess
import sys
import threading
import time
import traceback
from contextlib import contextmanager

import pytest
import torch

from engine import Probe, RunSettings, SamplingParams
from engine.generate import generate
from engine.native import build
from inspector.session.admission import Admission
from inspector.session.limits import Limits
from inspector.session.run import inspect_run

SESSIONS = 20
PROMPTS = ["What is the capital of France?", "Write a haiku about GPUs.", "1 + 1 =", "Tell me a joke.",
           "naïve café 👋", "def f(x):\n    return", "The quick brown fox", "<|im_start|> typed by a user"]
ROUND_TIMEOUT_S = float(os.environ.get("LLM_INSPECTOR_SOAK_TIMEOUT_S", "240"))


def session_settings(i: int) -> RunSettings:
    """Twenty different users: prompts, chat on and off, greedy and sampled, filters, seeds."""
    return RunSettings(prompt=PROMPTS[i % len(PROMPTS)] + f" #{i}", chat=i % 3 != 0, max_new_tokens=6 + i % 5,
                       seed=1000 + i,
                       params=SamplingParams(temperature=0.0 if i % 4 == 0 else 0.7 + 0.1 * (i % 5),
                                             top_k=[0, 50, 5][i % 3], top_p=[1.0, 0.9][i % 2],
                                             repetition_penalty=[1.0, 1.3][i % 2]))


def fingerprint(model) -> float:
    w = model.weights
    return float(sum(t.double().sum() for t in [w.embed, w.norm, w.lm_head] + [lw.wqkv for lw in w.layers]))


@contextmanager
def native_forced(on: bool):
    """The native path on or off through its public switch (LLM_INSPECTOR_NATIVE), for models loaded inside."""
    saved = os.environ.get("LLM_INSPECTOR_NATIVE")
    os.environ["LLM_INSPECTOR_NATIVE"] = "1" if on else "0"
    build.load.cache_clear()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LLM_INSPECTOR_NATIVE", None)
        else:
            os.environ["LLM_INSPECTOR_NATIVE"] = saved
        build.load.cache_clear()


def all_stacks() -> str:
    """Every Python thread's stack, named: what a stalled round fails with."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"--- thread {names.get(ident, '?')} ({ident})\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(out)


def run_threads(fns: list, timeout: float, label: str) -> list:
    """Call each fn in a daemon thread of its own (a stalled one cannot block the process's exit); their results
    in order, or pytest.fail with every thread's stack once `timeout` seconds pass. faulthandler is armed as a
    last resort, for a stall that keeps even this thread from running."""
    results: list = [None] * len(fns)
    errors: list = []

    def call(k):
        try:
            results[k] = fns[k]()
        except BaseException as e:       # re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=call, args=(k,), daemon=True, name=f"session-{k}") for k in range(len(fns))]
    faulthandler.dump_traceback_later(timeout + 120, exit=True)
    try:
        for t in threads:
            t.start()
        end = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            pytest.fail(f"{label}: {len(stuck)} sessions still running after {timeout:.0f} s ({', '.join(stuck)});"
                        f" every thread's stack:\n{all_stacks()}", pytrace=False)
    finally:
        faulthandler.cancel_dump_traceback_later()
    if errors:
        raise errors[0]
    return results


def plain_run(model, i: int):
    """A session's generation without captures: statistics only, so each decode step may take the native step
    (and its OpenMP region) from this thread."""
    s = session_settings(i)
    probe = Probe(timing=False).record_stats("*")
    return generate(model, s.prompt, probe=probe, **s.generation_kwargs()), probe


@contextmanager
def competing_process(seconds: float):
    """Another process's OpenMP threads on the same cores for the body (a second test run, a server's other work):
    torch's matrix products in a loop with libgomp's default waiting, bounded in time and always stopped."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = ("import time, torch\na = torch.randn(512, 512)\na @ a\nprint('working', flush=True)\n"
            "end = time.time() + %f\nwhile time.time() < end:\n    a @ a\n" % seconds)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        # until torch is loaded and its threads work (it says so after its first product), at most 120 s
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        said = proc.stdout.readline().strip() if ready else ""
        assert said == "working", ("the competing process never started its matrix products within 120 s"
                                   if not ready else f"the competing process ended before working (exit {proc.poll()})")
        yield
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


def twenty_sessions(model, *, plain_share: float = 0.0, label: str = "twenty sessions",
                    timeout: float = ROUND_TIMEOUT_S) -> float:
    """Twenty sessions alone, then all at once through a four-slot admission queue (plain_share of them as plain
    runs beside it): each gives its single-user output, streamed in order, with its own probe, trace and cache;
    the queue bounds the runs on the device and tells waiters their place; no hook stays attached and the
    shared weights are unchanged. Returns the seconds it all took."""
    t0 = time.monotonic()
    limits = Limits(max_concurrent_runs=4, max_queue=SESSIONS)
    plain = {i for i in range(SESSIONS) if i % 10 < plain_share * 10}
    inspected = [i for i in range(SESSIONS) if i not in plain]
    before = fingerprint(model)
    alone = {i: inspect_run(model, session_settings(i), limits=limits, admission=Admission(1, 0))
             for i in inspected}
    alone_plain = {i: plain_run(model, i)[0] for i in plain}

    admission = Admission(limits.max_concurrent_runs, limits.max_queue, heartbeat_s=0.05)
    start = threading.Barrier(SESSIONS)
    streamed: dict[int, list[str]] = {i: [] for i in range(SESSIONS)}
    positions: dict[int, list[int]] = {i: [] for i in range(SESSIONS)}

    def session(i: int):
        start.wait(timeout)
        if i in plain:
            return plain_run(model, i)
        return inspect_run(model, session_settings(i), on_token=lambda s: streamed[i].append(s.text),
                           limits=limits, on_queue=positions[i].append, admission=admission)

    t1 = time.monotonic()
    together = dict(enumerate(run_threads([lambda i=i: session(i) for i in range(SESSIONS)], timeout, label)))
    seconds = time.monotonic() - t0
    print(f"{label}: {seconds:.1f} s ({SESSIONS} sessions alone, then together in {time.monotonic() - t1:.1f} s)",
          flush=True)

    for i in plain:
        result, probe = together[i]
        assert result.token_ids == alone_plain[i].token_ids and result.text == alone_plain[i].text, f"session {i}"
        assert {blk.step for blk in probe.recording.stats} == set(range(len(result.steps)))
    for i in inspected:
        a, b = alone[i], together[i]
        assert b.result.token_ids == a.result.token_ids, f"session {i}"
        assert b.result.text == a.result.text
        assert "".join(streamed[i]) == "".join(s.text for s in b.result.steps)   # its own stream, in order
        assert b.result.stop_reason == a.result.stop_reason
        assert [s.token_id for s in b.result.steps] == b.result.token_ids
        la, lb = a.recording.captured("logits"), b.recording.captured("logits")
        assert len(lb) == len(b.result.steps) and [c.step for c in lb] == list(range(len(lb)))
        for x, y in zip(la, lb):
            torch.testing.assert_close(y.value, x.value, rtol=1e-4, atol=1e-4)
        assert {blk.step for blk in b.recording.stats} == set(range(len(b.result.steps)))
    # every run had its own probe, trace and cache
    assert len({id(together[i].recording) for i in inspected}) == len(inspected)
    assert len({id(together[i].result.steps) for i in inspected}) == len(inspected)
    state = admission.state()
    assert state.peak_running <= limits.max_concurrent_runs and state.running == state.waiting == 0
    assert state.admitted == len(inspected) and state.refused == 0
    assert state.peak_waiting >= 1 and any(positions.values())      # some sessions really queued ...
    for seen in positions.values():                                 # ... and only moved forward
        assert seen == sorted(seen, reverse=True) and all(1 <= p <= SESSIONS for p in seen)
    assert model.live_hooks == 0
    assert fingerprint(model) == before
    return seconds
