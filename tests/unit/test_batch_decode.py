"""Batched decode across runs (engine.batch.step_together) against each run alone: runs of different prompt lengths,
seeds and sampler settings stepped together draw the same tokens, and each run's probe holds the same records (its
own rows only) as the run alone, within the rounding a matmul over several rows brings (measured: a few 1e-5 relative
on the bundled model's statistics, see docs/CLASSROOM.md); exact=True is the same arithmetic, bit for bit."""
from __future__ import annotations

import pytest
import torch

from engine import GenerationRun, SamplingParams
from engine.accelerator import PLAIN
from engine.batch import alone_reason, step_together
from engine.inspection.interventions import scale
from engine.inspection.probe import inspection_probe

pytestmark = pytest.mark.unit

SPECS = [("hello there", 0, SamplingParams(temperature=0), 6),
         ("a much longer prompt than the first one, with more positions to attend to", 3,
          SamplingParams(temperature=0.9, top_k=40), 9),
         ("x", 11, SamplingParams(temperature=1.0, top_p=0.8, repetition_penalty=1.2), 7)]


def _runs(model, specs=SPECS, probe=True):
    return [GenerationRun(model, p, params=sp, seed=s, max_new_tokens=n, ignore_eos=True,
                          probe=inspection_probe(timing=False) if probe else None) for p, s, sp, n in specs]


def _together(runs, **kw):
    while not all(r.done for r in runs):
        for o in step_together(runs, **kw):
            assert not isinstance(o, BaseException), o


def _same_records(a, b, exact: bool):
    ra, rb = a.probe.recording.stat_records(), b.probe.recording.stat_records()
    assert [(r.step, r.name, r.layer, r.pos0, tuple(r.values.shape)) for r in ra] == \
        [(r.step, r.name, r.layer, r.pos0, tuple(r.values.shape)) for r in rb]
    for x, y in zip(ra, rb):
        if exact:
            assert torch.equal(x.values.nan_to_num(), y.values.nan_to_num()), x.name
        else:
            assert torch.allclose(x.values, y.values, rtol=1e-4, atol=1e-5, equal_nan=True), x.name


def _ran_alone(model) -> list:
    """The reference: each run of SPECS run to its end on its own."""
    alone = _runs(model)
    for r in alone:
        r.run()
    return alone


def test_runs_stepped_together_match_each_alone(tiny_model):
    model = tiny_model.with_accelerator(PLAIN)       # alone on the same (PyTorch) path the batch takes
    alone = _ran_alone(model)
    together = _runs(model)
    _together(together)
    for a, b in zip(alone, together):
        assert b.token_ids == a.token_ids and b.text == a.text and b.stop_reason == a.stop_reason
        assert b.cache.get_pos() == a.cache.get_pos()
        _same_records(a, b, exact=False)
        got, want = b.probe.recording.captured("logits"), a.probe.recording.captured("logits")
        assert [c.positions for c in got] == [c.positions for c in want]


def test_exact_switch_is_each_run_alone_bit_for_bit(tiny_model):
    alone = _ran_alone(tiny_model)
    together = _runs(tiny_model)
    _together(together, exact=True)
    for a, b in zip(alone, together):
        assert b.token_ids == a.token_ids
        _same_records(a, b, exact=True)


def test_a_run_without_probe_beside_probed_runs(tiny_model):
    model = tiny_model.with_accelerator(PLAIN)
    alone = _ran_alone(model)
    together = _runs(model)
    bare = GenerationRun(model, "hello there", max_new_tokens=6, ignore_eos=True)
    _together(together + [bare])
    assert bare.token_ids == alone[0].token_ids
    for a, b in zip(alone, together):
        _same_records(a, b, exact=False)


def test_a_replace_hook_runs_apart_and_keeps_its_arithmetic(tiny_model):
    hooked = GenerationRun(tiny_model, "hello there", max_new_tokens=5, ignore_eos=True,
                           probe=inspection_probe(timing=False).replace("blocks.0.mlp_out", scale(0.0)))
    ref = GenerationRun(tiny_model, "hello there", max_new_tokens=5, ignore_eos=True,
                        probe=inspection_probe(timing=False).replace("blocks.0.mlp_out", scale(0.0)))
    ref.run()
    others = _runs(tiny_model)
    hooked.step(), [r.step() for r in others]
    assert "replace hook" in alone_reason(hooked) and all(alone_reason(r) is None for r in others)
    _together([hooked] + others)
    assert hooked.token_ids == ref.token_ids
    _same_records(ref, hooked, exact=True)


def test_runs_join_and_leave_between_steps(tiny_model):
    model = tiny_model.with_accelerator(PLAIN)
    alone = _ran_alone(model)
    runs = _runs(model)
    live = [runs[0], runs[1]]
    for n in range(12):
        if n == 3:
            live.append(runs[2])          # joins: its prefill steps alone, then it decodes with the others
        assert all(alone_reason(r) is None for r in live if r.steps and not r.done)
        step_together(live)
        live = [r for r in live if not r.done]   # leaves once it has ended (runs[0] after 6 tokens)
    assert all(r.done for r in runs)
    for a, b in zip(alone, runs):
        assert b.token_ids == a.token_ids
        _same_records(a, b, exact=False)


def test_a_failing_step_is_that_runs_own(tiny_model):
    def boom(step):
        raise RuntimeError("this run's callback")
    runs = _runs(tiny_model.with_accelerator(PLAIN), probe=False)
    runs[1].on_token = boom
    first = step_together(runs)
    assert isinstance(first[1], RuntimeError) and first[0] is not None and first[2] is not None


def test_probes_watching_different_stages_each_get_their_own_records(tiny_model):
    """The batch's statistics are computed once for all rows (engine.batch.shared_stats): a probe recording a few
    stages and capturing an attention pattern (its row then taken alone) beside full inspection and a capture-only
    probe, each holding what it holds alone, in the same order."""
    from engine.inspection.probe import Probe
    model = tiny_model.with_accelerator(PLAIN)

    def probes():
        return [inspection_probe(timing=False), Probe().record_stats("blocks.*.mlp*").capture("blocks.1.attn.pattern"),
                Probe().capture(["blocks.0.attn.q", "final_norm"])]

    def runs():
        return [GenerationRun(model, p, params=sp, seed=s, max_new_tokens=n, ignore_eos=True, probe=probe)
                for (p, s, sp, n), probe in zip(SPECS, probes())]
    alone, together = runs(), runs()
    for r in alone:
        r.run()
    _together(together)
    for a, b in zip(alone, together):
        assert b.token_ids == a.token_ids
        _same_records(a, b, exact=False)
        got, want = b.probe.recording.captures, a.probe.recording.captures
        assert [(c.step, c.name, c.positions) for c in got] == [(c.step, c.name, c.positions) for c in want]
        for x, y in zip(got, want):
            assert torch.allclose(x.value, y.value, rtol=1e-4, atol=1e-5), x.name
