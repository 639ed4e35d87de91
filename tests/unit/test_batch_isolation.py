"""One run's own code cannot end or stall another run that shares its forward (engine.batch): runs driven through
the step barrier, one thread a run, full-inspection probes, a victim run ("The capital of France is", greedy, 24
tokens) packed into one prefill with another run and batched with it at its decode steps.

- A failure in the other run's own code at any point of a shared forward (its on_progress before a block or after
  the last, its probe offered a stage of the packed prefill or of a batched step, its sampler, its on_token) is
  raised in that run's thread only; the victim ends with the tokens of its run alone and statistics within the
  batching's rounding (engine.batch.step's module docstring: tests/unit/test_batch_decode.py measures it).
- A run whose on_token blocks (here: until the victim has ended) leaves the batch: the others go on without it and
  it rejoins once its callback returns (engine.batch.barrier: the barrier waits WINDOW_S for a run that is not
  back, then steps the ones present); a run whose prefill's on_progress blocks holds up neither a decoding run
  nor a run that comes to the gate after it past PREFILL_WAIT_S (engine.batch.prefill; here 0.2 s: no time is
  asserted, the holds are events), nor one packed into its forward past ASK_WAIT_S (engine.batch.segments).

The pack is made deterministic by a third run (the holder): it comes first and prefills alone, and its on_progress
holds its prefill until the victim and the other wait at the gate; they are then packed into one forward."""
from __future__ import annotations

import threading

import pytest

from engine import GenerationRun, SamplingParams
from engine.accelerator import PLAIN
from engine.batch import StepBarrier
from engine.inspection.probe import inspection_probe
from engine.results import GenerationResult
from tests.helpers import assert_same_stats

pytestmark = pytest.mark.unit

VICTIM = "The capital of France is"
WAIT_S = 20.0          # how long a test's hold waits before it gives up (a stall on today's code ends the test)


class Planted(RuntimeError):
    """What the other user's code raises."""


def _victim(model, **kw) -> GenerationRun:
    return GenerationRun(model, VICTIM, params=SamplingParams(temperature=0), max_new_tokens=24, ignore_eos=True,
                         probe=inspection_probe(), **kw)


def _other(model, **kw) -> GenerationRun:
    return GenerationRun(model, "a user who types something else entirely", seed=3, max_new_tokens=24,
                         ignore_eos=True, params=SamplingParams(temperature=0.8, top_k=40), probe=inspection_probe(),
                         **kw)


def _holder(model, **kw) -> GenerationRun:
    return GenerationRun(model, "x y z", seed=1, max_new_tokens=40, ignore_eos=True,
                         params=SamplingParams(temperature=0.7), probe=inspection_probe(), **kw)


def _alone(run: GenerationRun) -> GenerationRun:
    """The same run's settings, run alone to its end with no callbacks."""
    alone = GenerationRun(run.model, run.prompt_ids, params=run.params, seed=run.seed,
                          max_new_tokens=run.max_new_tokens, ignore_eos=True, probe=inspection_probe())
    alone.run()
    return alone


def _drive_packed(barrier: StepBarrier, holder: GenerationRun, runs: list[GenerationRun]) -> list:
    """holder, then runs, each driven to its end by `barrier` in a thread of its own: holder's prefill leads alone
    and holds until `runs` wait at the gate, which then packs their prefills into one forward. Each run's
    GenerationResult or the exception its own thread raised (holder's first)."""
    everyone = [holder, *runs]
    out: list = [None] * len(everyone)
    own = holder.on_progress

    def hold(p):
        if p.layer == 0:
            assert _until(lambda: barrier.prefills.waiting >= len(runs)), "the runs never came to the gate"
        return None if own is None else own(p)
    holder.on_progress = hold

    def work(n: int) -> None:
        try:
            out[n] = barrier.drive(everyone[n])
        except Exception as e:          # what the run's own thread raises
            out[n] = e
    threads = [threading.Thread(target=work, args=(n,)) for n in range(len(everyone))]
    threads[0].start()
    assert _until(lambda: barrier.prefills.serving == 1 and barrier.prefills.waiting == 0), "the holder never led"
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a run never ended"
    return out


def _until(cond) -> bool:
    done = threading.Event()
    for _ in range(int(WAIT_S / 0.005)):
        if cond():
            return True
        done.wait(0.005)
    return False


def _same_as_alone(run: GenerationRun, result, alone: GenerationRun) -> None:
    """run ended with result as alone ended: the same tokens, text and stop, statistics within the rounding."""
    assert isinstance(result, GenerationResult), result
    assert result.token_ids == alone.token_ids and result.text == alone.text
    assert result.stop_reason == alone.stop_reason == "max_new_tokens"
    assert_same_stats(alone, run, rtol=1e-4, atol=1e-5)


def _fail_probe_at(run: GenerationRun, stage: str, step: int) -> None:
    """run's probe raises when it is offered `stage` at `step` (a broken probe; a capture out of memory): every
    stage's statistics enter its batcher by one door, whichever path offered them."""
    batcher = run.probe.stats_batcher
    add = batcher.add

    def failing(name, *a, **k):
        if run.probe.step == step and stage in (name if isinstance(name, list) else [name]):
            raise Planted(f"this user's probe failed at {stage}")
        return add(name, *a, **k)
    batcher.add = failing


DECODE = 3             # the decode step a decode-time failure lands on (every run of the batch still running)

POINTS = {
    "prefill: on_progress before block 1": ("progress", 1),
    "prefill: on_progress after the last block": ("progress", 2),
    "prefill: probe at the attention scores": ("probe", "blocks.0.attn.scores", 0),
    "prefill: probe at a block's output": ("probe", "blocks.1.mlp_out", 0),
    "prefill: sampler": ("probe", "sampler.probs", 0),
    "prefill: on_token": ("token", 0),
    "decode: probe at the attention scores": ("probe", "blocks.0.attn.scores", DECODE),
    "decode: probe at a block's output": ("probe", "blocks.1.mlp_out", DECODE),
    "decode: sampler": ("probe", "sampler.probs", DECODE),
    "decode: on_token": ("token", DECODE),
}


def _plant(run: GenerationRun, point: tuple) -> None:
    kind = point[0]
    if kind == "progress":
        def progress(p):
            if p.layer == point[1]:
                raise Planted("this user's progress callback failed")
        run.on_progress = progress
    elif kind == "probe":
        _fail_probe_at(run, point[1], point[2])
    else:
        def token(step):
            if step.index == point[1]:
                raise Planted("this user's on_token failed")
        run.on_token = token


@pytest.mark.parametrize("path", ["native", "pytorch"])
@pytest.mark.parametrize("where", list(POINTS))
def test_a_failure_in_another_runs_own_code_ends_that_run_only(tiny_model, where, path):
    assert tiny_model.config.num_layers == 2
    model = tiny_model if path == "native" else tiny_model.with_accelerator(PLAIN)
    holder, victim, other = _holder(model), _victim(model), _other(model)
    _plant(other, POINTS[where])
    barrier = StepBarrier(window_s=0.5)
    out = _drive_packed(barrier, holder, [victim, other])
    assert barrier.prefills.packs == 1 and barrier.prefills.packed == 2   # the two prompts in one forward
    _same_as_alone(victim, out[1], _alone(victim))
    assert victim.packed_prefill and victim.batched_steps > DECODE        # its forwards were shared
    assert isinstance(out[2], Planted), out[2]                            # the other run's thread raises its error
    _same_as_alone(holder, out[0], _alone(holder))


@pytest.mark.parametrize("at", [0, 2], ids=["its packed prefill's token", "a batched decode step's token"])
def test_a_run_whose_on_token_blocks_leaves_the_step_and_the_others_go_on(tiny_model, at):
    """The slow run's on_token waits until the victim has ended: the victim (and the holder) step on without it;
    once it returns the slow run goes on, shares steps again with the holder, and ends as alone."""
    model = tiny_model.with_accelerator(PLAIN)
    victim_ended, seen = threading.Event(), {}

    def tell_end(step):
        if victim.done:
            victim_ended.set()
    holder, victim = _holder(model), _victim(model, on_token=tell_end)

    def blocks(step):
        if step.index == at:
            seen["victim ended first"] = victim_ended.wait(WAIT_S)
            seen["batched before"] = slow.batched_steps
    slow = _other(model, on_token=blocks)
    barrier = StepBarrier(window_s=0.5)
    out = _drive_packed(barrier, holder, [victim, slow])
    assert barrier.prefills.packs == 1 and barrier.prefills.packed == 2
    assert seen["victim ended first"], "the victim's steps waited on the slow run's on_token"
    assert slow.batched_steps > seen["batched before"]                    # it rejoined the holder's steps
    for run, result in zip([holder, victim, slow], out):
        _same_as_alone(run, result, _alone(run))


def test_a_prefill_whose_on_progress_blocks_holds_up_no_decoding_run(tiny_model):
    """The victim decodes alone; the other run comes to its prefill and its on_progress blocks before block 1 until
    the victim has ended. The victim's steps wait for that prefill (its run would join them) at most prefill_wait_s,
    then go on without it; the blocked run then prefills, decodes and ends as alone."""
    model = tiny_model.with_accelerator(PLAIN)
    decoding, blocking, victim_ended = (threading.Event() for _ in range(3))
    seen: dict = {}

    def victim_calls(step):
        if step.index == 1:
            decoding.set()
        if step.index == 2:
            assert blocking.wait(WAIT_S), "the other run's prefill never began"
        if victim.done:
            victim_ended.set()
    victim = _victim(model, on_token=victim_calls)

    def blocks(p):
        if p.layer == 1 and "victim ended first" not in seen:
            blocking.set()
            seen["victim ended first"] = victim_ended.wait(WAIT_S)
    slow = _other(model, on_progress=blocks)
    barrier, out = StepBarrier(window_s=0.5, prefill_wait_s=0.2), [None, None]

    def work(n: int, run: GenerationRun, after: threading.Event | None) -> None:
        if after is not None:
            assert after.wait(WAIT_S)
        out[n] = barrier.drive(run)
    threads = [threading.Thread(target=work, args=(0, victim, None)),
               threading.Thread(target=work, args=(1, slow, decoding))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert seen["victim ended first"], "the victim's steps waited on the other run's prefill"
    for run, result in zip([victim, slow], out):
        _same_as_alone(run, result, _alone(run))


def test_a_prefill_whose_on_progress_blocks_holds_up_no_run_that_comes_after_it(tiny_model):
    """The other run prefills alone and its on_progress blocks before block 1 until the victim has ended; the victim
    comes to the gate meanwhile: it waits for that prefill (to be packed after it) at most the gate's wait_s, then is
    prefilled beside it and decodes to its end; the blocked run then goes on, and both end as alone."""
    model = tiny_model.with_accelerator(PLAIN)
    victim_ended, seen = threading.Event(), {}

    def tell_end(step):
        if victim.done:
            victim_ended.set()
    victim = _victim(model, on_token=tell_end)

    def blocks(p):
        if p.layer == 1 and "victim ended first" not in seen:
            seen["victim ended first"] = victim_ended.wait(WAIT_S)
    slow = _other(model, on_progress=blocks)
    barrier, out = StepBarrier(window_s=0.5, prefill_wait_s=0.2), [None, None]

    def work(n: int, run: GenerationRun) -> None:
        out[n] = barrier.drive(run)
    threads = [threading.Thread(target=work, args=(0, slow)), threading.Thread(target=work, args=(1, victim))]
    threads[0].start()
    assert _until(lambda: barrier.prefills.serving == 1), "the other run's prefill never began"
    threads[1].start()
    for t in threads:
        t.join(120)
    assert seen["victim ended first"], "the victim waited at the gate on the other run's prefill"
    for run, result in zip([slow, victim], out):
        _same_as_alone(run, result, _alone(run))


def test_a_packed_run_whose_on_progress_blocks_holds_up_none_of_its_pack(tiny_model):
    """The victim and the other run are packed into one prefill (the holder leads); the other's on_progress blocks
    before block 1 of that packed forward until the victim has ended. Its answer is waited for at most ASK_WAIT_S
    (engine.batch.segments.Asker), so the forward goes on, the victim decodes to its end, and the blocked run then
    hears its own callback's answer, prefills, decodes and ends as alone."""
    model = tiny_model.with_accelerator(PLAIN)
    victim_ended, seen = threading.Event(), {}

    def tell_end(step):
        if victim.done:
            victim_ended.set()
    holder, victim = _holder(model), _victim(model, on_token=tell_end)

    def blocks(p):
        if p.layer == 1 and "victim ended first" not in seen:
            seen["victim ended first"] = victim_ended.wait(WAIT_S)
    slow = _other(model, on_progress=blocks)
    barrier = StepBarrier(window_s=0.5)
    out = _drive_packed(barrier, holder, [victim, slow])
    assert barrier.prefills.packs == 1 and barrier.prefills.packed == 2
    assert seen["victim ended first"], "the victim waited on the other run's on_progress in their packed forward"
    for run, result in zip([holder, victim, slow], out):
        _same_as_alone(run, result, _alone(run))
