"""The step barrier (engine.batch.barrier): runs driven in their own threads batch their decode steps and
each ends as it would alone (tokens; statistics within engine.batch's rounding), a Stop ends only its own run,
max_rows=1 is each run alone bit for bit; and the app's run path (inspect_run) goes through it."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from engine import GenerationRun, RunSettings, SamplingParams
from engine.accelerator import PLAIN
from engine.batch import StepBarrier, shared_barrier
from engine.inspection.probe import inspection_probe
from engine.progress import STOP
from inspector.session.admission import Admission
from inspector.session.limits import Limits
from inspector.session.run import inspect_run
from tests.helpers import drive_together

pytestmark = [pytest.mark.unit, pytest.mark.alone]      # its barrier waits in milliseconds: by itself (tests/alone.py)

PROMPTS = ["hello there", "a longer prompt with some more words in it", "x", "one two three four five six"]


def _run(model, n: int, **kw) -> GenerationRun:
    return GenerationRun(model, PROMPTS[n % 4], seed=n, max_new_tokens=5 + n, ignore_eos=True,
                         params=SamplingParams(temperature=0.7 + 0.1 * n, top_k=30), probe=inspection_probe(), **kw)


def _close(a, b, exact: bool) -> None:
    ra, rb = a.recording.stat_records(), b.recording.stat_records()
    assert [(r.step, r.name, r.pos0) for r in ra] == [(r.step, r.name, r.pos0) for r in rb]
    for x, y in zip(ra, rb):
        same = torch.equal(x.values.nan_to_num(), y.values.nan_to_num()) if exact else \
            torch.allclose(x.values, y.values, rtol=1e-4, atol=1e-5, equal_nan=True)
        assert same, (x.name, x.step)


def test_threads_batch_their_steps_and_each_ends_as_alone(tiny_model):
    model = tiny_model.with_accelerator(PLAIN)
    alone = [_run(model, n) for n in range(4)]
    for r in alone:
        r.run()
    barrier = StepBarrier(window_s=0.5)
    results = drive_together(barrier, [_run(model, n) for n in range(4)])
    assert barrier.steps > 0 and barrier.rows / barrier.steps > 1.5     # they did step together
    for a, r in zip(alone, results):
        assert r.token_ids == a.token_ids and r.stop_reason == "max_new_tokens"
        _close(a.result(), r, exact=False)


def test_one_row_at_a_time_is_each_run_alone_bit_for_bit(tiny_model):
    alone = [_run(tiny_model, n) for n in range(3)]
    for r in alone:
        r.run()
    barrier = StepBarrier(max_rows=1)
    results = drive_together(barrier, [_run(tiny_model, n) for n in range(3)])
    assert barrier.steps == 0
    for a, r in zip(alone, results):
        assert r.token_ids == a.token_ids
        _close(a.result(), r, exact=True)


def test_stop_ends_only_its_own_run(tiny_model):
    model = tiny_model.with_accelerator(PLAIN)
    stop_after = {"n": 0}

    def stopper(step):
        stop_after["n"] += 1
        return STOP if stop_after["n"] == 2 else None
    runs = [_run(model, 0, on_token=stopper), _run(model, 1), _run(model, 2)]
    results = drive_together(StepBarrier(window_s=0.5), runs)
    assert results[0].stop_reason == "stopped" and len(results[0].token_ids) == 2
    assert [len(r.token_ids) for r in results[1:]] == [6, 7]


def test_the_apps_run_path_batches_and_matches_alone(tiny_model):
    settings = [RunSettings(prompt=PROMPTS[n], max_new_tokens=6, seed=n, ignore_eos=True,
                            params=SamplingParams(temperature=0.8)) for n in range(4)]
    alone = [inspect_run(tiny_model, s, limits=Limits(max_batch_rows=1), admission=Admission(4, 8))
             for s in settings]
    barrier = shared_barrier()
    before, rows_before, packed_before = barrier.steps, barrier.rows, barrier.prefills.packed
    admission, out = Admission(4, 8), [None] * 4
    gate = threading.Barrier(4)

    def work(n):
        gate.wait()
        out[n] = inspect_run(tiny_model, settings[n], limits=Limits(), admission=admission, client=f"student-{n}")
    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert barrier.steps > before
    assert [t.result.token_ids for t in out] == [t.result.token_ids for t in alone]
    # each run says whether and how often its forward was shared: the rows the barrier served, run by run
    assert not any("shared one forward" in n for t in alone for n in t.notes)
    said = [[int(n.split(" of this run's decode steps")[0]) for n in t.notes if "shared one forward" in n] for t in out]
    assert all(len(s) <= 1 for s in said)
    assert sum(sum(s) for s in said) == barrier.rows - rows_before > 0
    prefilled = sum("its prompt was prefilled in one forward with other runs'" in n for t in out for n in t.notes)
    assert prefilled == barrier.prefills.packed - packed_before


def test_bench_class_measures_a_class_that_batched(tiny_model):
    from engine.bench.class_run import class_bench
    before = shared_barrier().steps
    out = class_bench(tiny_model, sizes=(1, 3), new_tokens=4, rounds=1, say=lambda *_: None)
    assert shared_barrier().steps > before         # the class's decode steps went through the batched forward
    assert out["class_3_s"] > 0 and out["class_last_over_alone_3"] > 0 and out["class_tokens_per_s_3"] > 0
    assert out["lone_app_over_cli_decode"] > 0 and out["cli_beside_busy_over_alone"] > 0


def test_a_class_larger_than_one_step_is_served_in_turns(tiny_model):
    """Six runs, at most two rows a step: every run is in exactly one step at a time and ends as alone."""
    model = tiny_model.with_accelerator(PLAIN)
    alone = [_run(model, n) for n in range(6)]
    for r in alone:
        r.run()
    barrier = StepBarrier(max_rows=2, window_s=0.2)
    results = drive_together(barrier, [_run(model, n) for n in range(6)])
    assert barrier.steps > 0 and barrier.rows / barrier.steps <= 2
    for a, r in zip(alone, results):
        assert r.token_ids == a.token_ids
        _close(a.result(), r, exact=False)


def test_runs_that_come_back_one_after_another_still_share_each_step(tiny_model):
    """Four runs whose on_token takes 0, 35, 70, 105 ms after each decoded token (the last past the window: a
    class's runs finishing their steps one after another) share their steps: with a window of 100 ms the leader
    waits while they keep coming (the window after each), not the window after itself, which split them into steps
    of two or three rows."""
    model = tiny_model.with_accelerator(PLAIN)

    def slow(n: int):
        return lambda step: time.sleep(0.035 * n) if step.index > 0 else None
    runs = [GenerationRun(model, PROMPTS[n], seed=n, max_new_tokens=6, ignore_eos=True, probe=inspection_probe(),
                          on_token=slow(n)) for n in range(4)]
    barrier = StepBarrier(window_s=0.1)
    drive_together(barrier, runs)
    assert barrier.rows / barrier.steps > 3.5, (barrier.rows, barrier.steps)
