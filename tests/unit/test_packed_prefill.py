"""Packed prefills (engine.batch.prefill) against each run alone: runs of different prompt lengths, seeds and
samplers prefilled in one forward then run on draw the tokens each draws alone, and each run's probe holds the same
records (its own rows only, at its own positions) within the rounding a matmul over more rows brings; a STOP from
one run's on_progress ends that run as alone and no other; a NaN in one run's prompt stays in that run; the gate packs
the prefills that wait while one is under way, and prefills a run that comes alone exactly as alone."""
from __future__ import annotations

import threading

import pytest
import torch

from engine import GenerationRun, SamplingParams, load_model
from engine.batch import StepBarrier
from engine.batch.prefill import PrefillGate, prefill_reason, prefill_together
from engine.inspection.interventions import scale
from engine.inspection.probe import inspection_probe
from engine.progress import STOP
from tests.helpers import assert_same_stats

pytestmark = pytest.mark.unit

SPECS = [("hello there", 0, SamplingParams(temperature=0)),
         ("a much longer prompt than the first one, with more positions to attend to", 3,
          SamplingParams(temperature=0.9, top_k=40)),
         ("x", 11, SamplingParams(temperature=1.0, top_p=0.8, repetition_penalty=1.2)),
         ("one two three four five six seven", 5, SamplingParams(temperature=0.7))]


def _runs(model, specs=SPECS, **kw):
    return [GenerationRun(model, p, params=sp, seed=s, max_new_tokens=5, ignore_eos=True,
                          probe=inspection_probe(timing=False), **kw) for p, s, sp in specs]


def _same(alone, together, exact: bool = False) -> None:
    for a, b in zip(alone, together):
        assert b.token_ids == a.token_ids and b.text == a.text and b.stop_reason == a.stop_reason
        if exact:
            ra, rb = a.probe.recording.stat_records(), b.probe.recording.stat_records()
            assert [(r.step, r.name, r.pos0) for r in ra] == [(r.step, r.name, r.pos0) for r in rb]
            assert all(torch.equal(x.values.nan_to_num(), y.values.nan_to_num()) for x, y in zip(ra, rb))
        else:
            assert_same_stats(a, b, rtol=1e-4, atol=1e-5)
        ca = [c for c in a.probe.recording.captures if c.name == "logits"]
        cb = [c for c in b.probe.recording.captures if c.name == "logits"]
        assert [c.positions for c in ca] == [c.positions for c in cb]
        assert all(torch.allclose(x.value, y.value, rtol=1e-4, atol=1e-5, equal_nan=True) for x, y in zip(ca, cb))


def test_packed_prefills_then_each_run_match_each_alone(tiny_model):
    alone = _runs(tiny_model)
    for r in alone:
        r.run()
    together = _runs(tiny_model)
    # a one-position prompt ("x") is prefilled alone by the gate: alone its products are one-row products, of another
    # tile than a pack's (engine.matmul); packed anyway here, it is held to itself alone within rounding below
    assert [prefill_reason(r) is None for r in together] == [len(r.prompt_ids) > 1 for r in together] == \
        [True, True, False, True]
    assert "one position" in prefill_reason(together[2])
    steps = prefill_together(together)
    assert [s.index for s in steps] == [0, 0, 0, 0] and all(r.packed_prefill for r in together)
    assert [r.cache.get_pos() for r in together] == [len(r.prompt_ids) for r in together]
    for r in together:
        assert prefill_reason(r) is not None          # its next step is a decode step
        r.run()
    _same(alone, together)
    # the prompt's records: one block of every stage over the prompt's positions, at the run's own positions
    logits_rec = [r for r in together[1].probe.recording.stat_records("blocks.0.attn_out") if r.step == 0]
    assert len(logits_rec) == 1 and logits_rec[0].pos0 == 0 and \
        logits_rec[0].values.shape[0] == len(together[1].prompt_ids)


@pytest.mark.parametrize("at", [1, 2], ids=["before block 1", "after the last block"])
def test_a_stop_in_one_runs_prefill_ends_that_run_as_alone_and_no_other(tiny_model, at):
    assert tiny_model.config.num_layers == 2

    def stop_before_block_1(p):
        return STOP if p.layer == at else None
    specs_stop = [None, stop_before_block_1, None, None]

    def runs():
        return [GenerationRun(tiny_model, p, params=sp, seed=s, max_new_tokens=5, ignore_eos=True,
                              probe=inspection_probe(timing=False), on_progress=op)
                for (p, s, sp), op in zip(SPECS, specs_stop)]
    alone = runs()
    for r in alone:
        r.run()
    together = runs()
    out = prefill_together(together)
    assert out[1] is None and together[1].stop_reason == "stopped"
    assert together[1].cache.get_pos() == (0 if at == 1 else len(together[1].prompt_ids))   # as alone
    assert {r.layer for r in together[1].probe.recording.stat_records() if r.layer is not None} == set(range(at))
    for r in together:
        r.run()
    _same(alone, together)


def test_a_nan_in_one_runs_prompt_stays_in_that_run(tiny_model_dir):
    model = load_model(tiny_model_dir, device="cpu", dtype="float32")      # its own weights: one embedding row NaN
    bad = model.tokenizer.encode("x")[0]
    model.weights.embed[bad] = float("nan")
    alone = _runs(model)
    for r in alone:
        r.run()
    together = _runs(model)
    prefill_together(together)
    for r in together:
        r.run()
    assert alone[2].stop_reason == "non-finite logits" and alone[0].stop_reason == "max_new_tokens"
    _same(alone, together)


def test_runs_of_two_models_are_not_packed_together(tiny_model):
    from engine.accelerator import PLAIN
    runs = [GenerationRun(tiny_model, "hello", max_new_tokens=2),
            GenerationRun(tiny_model.with_accelerator(PLAIN), "hello", max_new_tokens=2)]
    with pytest.raises(ValueError, match="share one model"):
        prefill_together(runs)


def test_a_probe_that_changes_the_forward_is_not_packed(tiny_model):
    run = GenerationRun(tiny_model, "hello there", max_new_tokens=3,
                        probe=inspection_probe().replace("blocks.0.mlp_out", scale(0.5)))
    assert "changes the forward" in prefill_reason(run)


def test_a_failed_packed_forward_is_every_runs_error_and_advances_no_cache(tiny_model, monkeypatch):
    runs = _runs(tiny_model)

    own = type(tiny_model).forward_batch

    def forward_batch(self, batch):          # the packed forward fails; a run's own forward would go on
        if batch.form == "packed":
            raise MemoryError("no room for the packed forward")
        return own(self, batch)
    monkeypatch.setattr(type(tiny_model), "forward_batch", forward_batch)
    out = prefill_together(runs)
    assert all(isinstance(o, MemoryError) for o in out)
    assert all(r.cache.get_pos() == 0 and not r.steps and not r.done for r in runs)


def test_the_gate_packs_the_prefills_that_wait_while_one_is_under_way(tiny_model):
    """Run 0 comes alone and is prefilled by its own step (bit for bit as alone); its on_progress holds its prefill
    until the three others wait at the gate, and they are then prefilled together, in one forward."""
    gate = PrefillGate()
    waiting = threading.Event()

    def hold(p):
        if p.layer == 0:
            assert waiting.wait(30), "the other runs never came to the gate"
    together = _runs(tiny_model)
    together[0].on_progress = hold
    results: list = [None] * 4

    def work(n: int) -> None:
        results[n] = gate.prefill(together[n])
    first = threading.Thread(target=work, args=(0,))
    first.start()
    others = [threading.Thread(target=work, args=(n,)) for n in (1, 2, 3)]
    for t in others:
        t.start()
    while gate.waiting < 3:
        threading.Event().wait(0.005)
    waiting.set()
    for t in [first, *others]:
        t.join(60)
    assert gate.packs == 1 and gate.packed == 3 and all(s is not None and s.index == 0 for s in results)
    alone = _runs(tiny_model)
    for r in alone:
        r.run()
    for r in together:
        r.run()
    _same(alone[:1], together[:1], exact=True)
    _same(alone[1:], together[1:])


def test_a_packed_runs_error_is_raised_in_its_own_thread_only(tiny_model):
    """A run whose prefill step raises (here its on_token) in a pack: the gate raises it in that run's thread; the
    pack's other run has its step."""
    gate, waiting, out = PrefillGate(), threading.Event(), {}
    runs = _runs(tiny_model)[:3]
    runs[0].on_progress = lambda p: (waiting.wait(30), None)[1]

    def planted(step):
        raise RuntimeError("planted in on_token")
    runs[2].on_token = planted

    def work(n: int) -> None:
        try:
            out[n] = gate.prefill(runs[n])
        except RuntimeError as e:
            out[n] = e
    threads = [threading.Thread(target=work, args=(n,)) for n in range(3)]
    threads[0].start()
    while gate.waiting or not gate.serving:            # run 0 leads alone first
        threading.Event().wait(0.005)
    for t in threads[1:]:
        t.start()
    while gate.waiting < 2:
        threading.Event().wait(0.005)
    waiting.set()
    for t in threads:
        t.join(60)
    assert gate.packs == 1 and out[0].index == 0 and out[1].index == 0
    assert isinstance(out[2], RuntimeError) and "planted" in str(out[2])


def test_the_exact_switch_prefills_every_run_alone(tiny_model):
    barrier = StepBarrier(max_rows=1)
    together = _runs(tiny_model)
    threads = [threading.Thread(target=barrier.drive, args=(r,)) for r in together]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    alone = _runs(tiny_model)
    for r in alone:
        r.run()
    assert barrier.prefills.packs == 0 and not any(r.packed_prefill or r.batched_steps for r in together)
    _same(alone, together, exact=True)
