"""What a batched decode step does when something fails (engine.batch): a failed shared forward (memory) is every
run's error with no cache advanced, in step_together and at the step barrier (each run's own thread raises it); a
run whose own step raises (its on_token), or whose probe raises inside the shared forward, fails alone (its cache
unmoved) and the others of its step go on; runs of two models never share a forward."""
from __future__ import annotations

import pytest

from engine import GenerationRun
from engine.accelerator import PLAIN
from engine.batch import StepBarrier, forward_together, step_together
from tests.helpers import drive_together

pytestmark = pytest.mark.unit

PROMPTS = ["hello there", "a longer prompt with more words", "x"]


def _prefilled(model, **kw) -> list[GenerationRun]:
    runs = [GenerationRun(model, p, max_new_tokens=4, ignore_eos=True, seed=n, **kw) for n, p in enumerate(PROMPTS)]
    for r in runs:
        r.step()
    return runs


def _out_of_memory_when_batched(monkeypatch, model) -> None:
    """The model's forward fails for a batched decode step's rows (Batch.rows); a run's own forward goes on."""
    own = type(model).forward_batch

    def forward_batch(self, batch):
        if batch.form == "rows":
            raise MemoryError("no room for the batched forward")
        return own(self, batch)
    monkeypatch.setattr(type(model), "forward_batch", forward_batch)


def test_a_failed_shared_forward_is_every_runs_error_and_advances_no_cache(tiny_model, monkeypatch):
    runs = _prefilled(tiny_model)
    before = [r.cache.get_pos() for r in runs]
    _out_of_memory_when_batched(monkeypatch, tiny_model)
    out = step_together(runs)
    assert all(isinstance(o, MemoryError) for o in out)
    assert [r.cache.get_pos() for r in runs] == before and all(len(r.steps) == 1 for r in runs)


def test_runs_of_two_models_share_no_forward(tiny_model):
    runs = _prefilled(tiny_model)[:1] + _prefilled(tiny_model.with_accelerator(PLAIN))[:1]
    with pytest.raises(ValueError, match="share one model"):
        forward_together(runs)


def test_at_the_barrier_a_failed_forward_is_raised_in_every_runs_own_thread(tiny_model, monkeypatch):
    runs = _prefilled(tiny_model)
    _out_of_memory_when_batched(monkeypatch, tiny_model)
    out = drive_together(StepBarrier(window_s=0.5), runs)
    failed = [isinstance(o, MemoryError) for o in out]
    assert sum(failed) >= 2, out             # the runs that met in a step (a run alone steps on its own path)
    for r, f in zip(runs, failed):
        if f:       # its failed step advanced no cache
            assert r.cache.get_pos() == len(r.prompt_ids) + len(r.steps) - 1 and not r.done
        else:       # it never shared a forward: every step of it alone
            assert r.batched_steps == 0 and r.done


def test_at_the_barrier_a_runs_own_failing_step_ends_only_that_run(tiny_model):
    def planted(step):
        if step.index == 2:
            raise RuntimeError("planted in on_token")
    runs = _prefilled(tiny_model)
    runs[1].on_token = planted
    out = drive_together(StepBarrier(window_s=0.5), runs)
    assert isinstance(out[1], RuntimeError) and "planted" in str(out[1])
    assert [len(o.token_ids) for o in (out[0], out[2])] == [4, 4]


def test_a_runs_probe_failing_in_the_shared_forward_fails_that_run_alone_with_its_cache_unmoved(tiny_model):
    """Run 1's probe raises when offered a block's output in the batched forward: its step is that error and its
    cache stays where it was; the other rows' steps stand, and those runs end with the tokens they draw alone."""
    from engine.inspection.probe import inspection_probe
    alone = _prefilled(tiny_model, probe=None)
    for r in alone:
        r.run()
    runs = [GenerationRun(tiny_model, p, max_new_tokens=4, ignore_eos=True, seed=n, probe=inspection_probe())
            for n, p in enumerate(PROMPTS)]
    for r in runs:
        r.step()
    add = runs[1].probe.stats_batcher.add

    def failing(name, *a, **k):
        if "blocks.1.mlp_out" in (name if isinstance(name, list) else [name]):
            raise RuntimeError("planted in run 1's probe")
        return add(name, *a, **k)
    runs[1].probe.stats_batcher.add = failing
    before = runs[1].cache.get_pos()
    out = step_together(runs)
    assert isinstance(out[1], RuntimeError) and "planted" in str(out[1])
    assert runs[1].cache.get_pos() == before and len(runs[1].steps) == 1
    assert all(o is not None and o.index == 1 for o in (out[0], out[2]))
    for r in (runs[0], runs[2]):
        r.run()
    assert [runs[n].token_ids for n in (0, 2)] == [alone[n].token_ids for n in (0, 2)]
