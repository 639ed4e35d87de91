"""Admission sized by memory (issue 32, item 2): a run's need (session.run_memory.run_bytes: its KV cache and its
recording at the length it asked for) measured against a real run's, and the runs at once bounded by a budget of
what they hold as well as by their count: the run that would pass the budget waits, told its place, and starts when
a running run leaves."""
from __future__ import annotations

import threading
import time

import pytest

from engine import GenerationRun, RunSettings, inspection_probe
from engine.bench.inspection import retained_bytes
from inspector.session.admission import Admission
from inspector.session.limits import Limits
from inspector.session.run import inspect_run
from inspector.session.run_memory import run_bytes, runs_budget

pytestmark = pytest.mark.unit


def test_a_runs_need_is_what_a_real_run_holds(tiny_model):
    run = GenerationRun(tiny_model, "hello there, how are you", max_new_tokens=12, ignore_eos=True,
                        probe=inspection_probe(timing=False))
    n_prompt = len(run.prompt_ids)
    cache = run.cache.bytes_allocated                   # allocated whole at the start, for prompt + new tokens
    run.run()
    held = cache + retained_bytes(run.probe)           # its cache and what its probe recorded
    need = run_bytes(tiny_model, n_prompt, 12)
    assert held <= need <= 1.1 * held, (need, held)


def test_the_run_past_the_memory_budget_waits_with_its_place_and_starts_when_one_leaves(tiny_model):
    settings = RunSettings(prompt="hello there", max_new_tokens=4, ignore_eos=True)
    limits = Limits(queue_timeout_s=30)
    need = run_bytes(tiny_model, len(tiny_model.tokenizer.encode("hello there")), 4)
    adm = Admission(max_concurrent=8, max_queue=8, heartbeat_s=0.05)
    adm.max_bytes = 3 * need + need // 2                 # room for three such runs, not four
    release, held = threading.Event(), []

    def hold() -> None:
        with adm.slot(need=need):
            held.append(1)
            release.wait(30)
    holders = [threading.Thread(target=hold) for _ in range(3)]
    for t in holders:
        t.start()
    while len(held) < 3:
        time.sleep(0.01)
    assert adm.state().running_bytes == 3 * need          # three slots of eight taken, the budget nearly full
    told, done = [], []
    fourth = threading.Thread(target=lambda: done.append(inspect_run(tiny_model, settings, limits=limits,
                                                                       on_queue=told.append, admission=adm)))
    fourth.start()
    time.sleep(0.5)
    assert not done and told and set(told) == {1}        # it waits, first in line, though five slots are free
    assert adm.state().waiting == 1 and adm.state().running == 3
    release.set()
    fourth.join(30)
    for t in holders:
        t.join(10)
    assert done and len(done[0].result.token_ids) == 4 and adm.state().running == 0 and adm.state().running_bytes == 0


def test_a_run_alone_is_admitted_whatever_its_need_and_the_budget_follows_the_limit(tiny_model):
    adm = Admission(max_concurrent=2, max_queue=2)
    adm.max_bytes = 10
    with adm.slot(need=1 << 30):
        assert adm.state().running == 1
    assert runs_budget(Limits(max_runs_mb=64), tiny_model.device) == 64 << 20
    assert runs_budget(Limits(), tiny_model.device) > 0          # half the memory available, measured once
