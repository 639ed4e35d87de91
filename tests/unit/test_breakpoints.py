"""Conditional breakpoints on a live GenerationRun (engine/tools/breakpoints.py) and the debugger's run
(inspector/stepper.py): each condition pauses at the exact step, and new sampler settings after a break
govern the tokens that follow."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import EngineError, GenerationRun, InputError, RunSettings, SamplingParams, inspection_probe, plant
from engine.generate import prompt_ids
from engine.tools.breakpoints import AbsAbove, EntropyBelow, NonFinite, RepeatedNgram, TokenIs, run_until
from inspector.session.stepper import Debugger
from inspector.views.debugger import candidates_table, token_ids_for

PROMPT = "Tell me about caches."


def new_run(model, probe=None, prompt=PROMPT, **kw):
    kw.setdefault("max_new_tokens", 12)
    return GenerationRun(model, prompt, chat=True, probe=probe or inspection_probe(), **kw)


def forced(cycle):
    """A replace fn on `logits` making the model choose cycle[step % len(cycle)] at every step."""
    def fn(x, ctx):
        y = torch.full_like(x, -1e4)
        y[:, cycle[ctx.step % len(cycle)]] = 1e4
        return y
    return fn


@pytest.mark.model
def test_token_and_entropy_breakpoints_on_the_bundled_model(bundled_model):
    tok = bundled_model.tokenizer
    (paris,) = tok.encode(" Paris")
    run = new_run(bundled_model, prompt="What is the capital of France?", max_new_tokens=10)
    steps, fired = run_until(run, [TokenIs((paris,))])
    assert fired is not None and "' Paris'" in fired and not run.done
    assert steps[-1].token_id == paris and steps[-1].index == len(run.steps) - 1
    assert tok.decode(run.token_ids) == "The capital of France is Paris"          # stopped right at ' Paris'
    paris_step = steps[-1].index
    # continue: the rest of the greedy answer, no further break
    rest, fired = run_until(run, [TokenIs((paris,))])
    assert fired is None and run.done and run.text == "The capital of France is Paris."
    # the same answer again, now breaking on low entropy too: every stop is the first later step whose
    # recorded entropy is below the threshold, or the ' Paris' step
    run2 = new_run(bundled_model, prompt="What is the capital of France?", max_new_tokens=10)
    bps, stops = [EntropyBelow(0.1), TokenIs((paris,))], []
    while not run2.done:
        steps, fired = run_until(run2, bps)
        if fired is not None:
            stops.append(steps[-1].index)
            assert fired.startswith(f"step {steps[-1].index}:")
    expected = [s.index for s in run2.steps if s.entropy < 0.1 or s.token_id == paris]
    assert stops == expected and paris_step in stops and len(stops) >= 2
    assert run2.token_ids == run.token_ids


def test_entropy_breakpoint_fires_at_the_first_step_below(tiny_model):
    ref = new_run(tiny_model, max_new_tokens=20)
    ref.run()
    e = [s.entropy for s in ref.steps]
    threshold = min(e[:3])                           # so the first step below it is step 3 or later
    first = next(i for i, x in enumerate(e) if x < threshold)
    steps, fired = run_until(new_run(tiny_model, max_new_tokens=20), [EntropyBelow(threshold)])
    assert steps[-1].index == first >= 3 and fired.startswith(f"step {first}: entropy")
    assert all(s.entropy >= threshold for s in steps[:-1])
    assert steps[-1].entropy == pytest.approx(e[first], abs=1e-5)


def test_nan_breakpoint_fires_where_the_planted_value_first_applies(tiny_model):
    n = len(prompt_ids(tiny_model, PROMPT, chat=True))
    probe = inspection_probe().replace("blocks.0.mlp.act", plant(float("nan"), position=n + 2))
    run = new_run(tiny_model, probe)
    steps, fired = run_until(run, [NonFinite()])
    # step 3 is the forward of position n + 2: its logits are NaN, so it draws no token and the run stops there
    assert steps[-1].index == 2 and len(run.steps) == 3 and run.stop_reason == "non-finite logits"
    assert fired.startswith("step 3: blocks.0.mlp.act holds 1 NaN") and f"position {n + 2}" in fired
    assert not any(bool(b.values[:, :, 5:].sum()) for b in probe.recording.stats if b.step < 3)
    # restricted to later stages it names the first of those
    run = new_run(tiny_model, inspection_probe().replace("blocks.0.mlp.act", plant(float("nan"), position=n + 2)))
    steps, fired = run_until(run, [NonFinite("blocks.1.*")])
    assert steps[-1].index == 2 and fired.startswith("step 3: blocks.1.attn_norm")
    with pytest.raises(EngineError, match="record"):
        run_until(GenerationRun(tiny_model, PROMPT, max_new_tokens=2), [NonFinite()])


def test_abs_value_breakpoint(tiny_model):
    n = len(prompt_ids(tiny_model, PROMPT, chat=True))
    probe = inspection_probe().replace("blocks.1.resid_mid", plant(1e6, position=n + 1, index=7))
    run = new_run(tiny_model, probe)
    steps, fired = run_until(run, [AbsAbove(1e5, "blocks.*.resid_mid")])
    assert steps[-1].index == 2
    assert fired == f"step 2: blocks.1.resid_mid reaches |value| 1e+06 > 100000 at position {n + 1}"
    # a threshold below the embedding's own values fires at the prefill, naming the first stage
    steps, fired = run_until(new_run(tiny_model), [AbsAbove(1e-3)])
    assert steps[-1].index == 0 and fired.startswith("step 0: embed reaches")
    with pytest.raises(InputError):
        AbsAbove(-1.0)


def test_repeated_ngram_breakpoint_fires_at_the_first_step_completing_a_repeat(tiny_model):
    cycle = [100, 200, 300]                          # tokens 100 200 300 100 200 300 ...
    for n, expected in [(1, 3), (2, 4), (3, 5)]:
        run = new_run(tiny_model, inspection_probe().replace("logits", forced(cycle)))
        steps, fired = run_until(run, [RepeatedNgram(n)])
        assert steps[-1].index == expected, n
        assert run.token_ids == [cycle[i % 3] for i in range(expected + 1)]
        assert f"already occurred at steps 0..{n - 1}" in fired
    # with the prompt: generating the prompt's first token repeats a 1-gram at step 0
    first = prompt_ids(tiny_model, PROMPT, chat=True)[0]
    run = new_run(tiny_model, inspection_probe().replace("logits", forced([first, 5])))
    steps, fired = run_until(run, [RepeatedNgram(1, include_prompt=True)])
    assert steps[-1].index == 0 and "prompt position 0" in fired


def test_repeated_ngram_on_hand_made_sequences():
    def fires(gen, n, prompt=(), include_prompt=False):
        """The steps at which the condition fires, checked step by step on a fake run."""
        tok = SimpleNamespace(decode=lambda ids: " ".join(map(str, ids)))
        run = SimpleNamespace(token_ids=list(gen), prompt_ids=list(prompt), model=SimpleNamespace(tokenizer=tok))
        bp = RepeatedNgram(n, include_prompt)
        return [i for i in range(len(gen)) if bp.check(run, SimpleNamespace(index=i), None)]
    assert fires([5, 5, 5], 2) == [2]                                 # overlapping repeat
    assert fires([1, 2, 3, 4], 1) == []
    assert fires([1, 2, 1, 3, 1, 2], 2) == [5]
    assert fires([7, 8], 2, prompt=[7, 8], include_prompt=True) == [1]
    assert fires([7, 8], 2, prompt=[7, 8]) == []
    with pytest.raises(InputError):
        RepeatedNgram(0)


def test_new_params_after_a_break_govern_the_later_tokens(tiny_model):
    ref = new_run(tiny_model, max_new_tokens=10)
    greedy = ref.run().token_ids
    run = new_run(tiny_model, max_new_tokens=10, seed=3)
    steps, fired = run_until(run, [TokenIs((greedy[2],))])
    assert steps[-1].index == 2 and run.token_ids == greedy[:3]
    run.params = SamplingParams(temperature=0.8, top_k=3)
    rest, fired = run_until(run, [])
    assert run.done and run.result().params == SamplingParams(temperature=0.8, top_k=3)
    # the same as a run that starts from those three tokens with the new settings (greedy drew no random numbers)
    cont = GenerationRun(tiny_model, run.prompt_ids + greedy[:3], max_new_tokens=7, seed=3,
                         params=SamplingParams(temperature=0.8, top_k=3)).run()
    assert run.token_ids[3:] == cont.token_ids
    for s in rest:                                       # each token among the step's top 3, sampled not argmax'd
        (cap,) = run.probe.recording.captured("logits", step=s.index)
        top3 = torch.topk(cap.value[-1], 3)
        assert s.token_id in top3.indices.tolist() and s.kept == 3
        p = torch.softmax(top3.values / 0.8, 0)[top3.indices.tolist().index(s.token_id)]
        assert s.prob == pytest.approx(float(p), rel=1e-4)
    assert run.token_ids[3:] != greedy[3:]
    # top_k = 1 at any temperature forces the argmax: the greedy continuation again
    run = new_run(tiny_model, max_new_tokens=10)
    run_until(run, [TokenIs((greedy[2],))])
    run.params = SamplingParams(temperature=1.5, top_k=1)
    run_until(run, [])
    assert run.token_ids == greedy and all(s.prob == 1.0 for s in run.steps)


def test_run_until_limits_and_the_end(tiny_model):
    run = new_run(tiny_model, max_new_tokens=4)
    assert [s.index for s in run_until(run, [], max_steps=2)[0]] == [0, 1]
    steps, fired = run_until(run, [EntropyBelow(0.0)])
    assert [s.index for s in steps] == [2, 3] and fired is None and run.done
    assert run_until(run, []) == ([], None)
    with pytest.raises(InputError):
        run_until(run, [], max_steps=0)


def test_debugger_steps_publishes_and_logs_params(tiny_model):
    dbg = Debugger(tiny_model, RunSettings(prompt=PROMPT, max_new_tokens=6), [EntropyBelow(100.0)])
    assert len(dbg.step()) == 1 and dbg.message.startswith("step 0: entropy")
    dbg.breakpoints = []
    dbg.step()
    assert dbg.set_params(SamplingParams(temperature=0.9)) and not dbg.set_params(SamplingParams(temperature=0.9))
    dbg.run_to_end()
    rec = dbg.record()
    assert dbg.done and len(rec.result.steps) == 6 and rec.result.params.temperature == 0.9
    assert rec.settings.params.temperature == 0.9 and rec.settings.prompt == PROMPT
    assert rec.recording is dbg.probe.recording
    assert rec.model_name == tiny_model.name and dbg.published is rec
    assert dbg.record().created > rec.created                  # every snapshot is a new run for the pages' memos
    assert dbg.params_at(1).temperature == 0.0 and dbg.params_at(2).temperature == 0.9
    assert {c.step for c in rec.recording.captured("logits")} == set(range(6))
    table = candidates_table(rec.result.steps[0], tiny_model.tokenizer)
    assert table["chosen"].sum() == 1 and table["model_prob"].is_monotonic_decreasing


def test_token_ids_for(tiny_model):
    tok = tiny_model.tokenizer
    assert token_ids_for(tok, " Paris") == tuple(tok.encode(" Paris"))
    assert token_ids_for(tok, "12, 34") == (12, 34)
    with pytest.raises(InputError, match="tokens"):
        token_ids_for(tok, " Paris is")
    with pytest.raises(InputError, match="vocabulary"):
        token_ids_for(tok, "999999", vocab_size=49152)


def test_a_token_breakpoint_is_named_by_its_token_not_only_its_id(tiny_model):
    """Issue 33, item 9: the Debugger's list read "token id in [7042]"; it names the token now."""
    from inspector.views.debugger import token_breakpoint
    tok = tiny_model.tokenizer
    (pid,) = tok.encode(" Paris") if len(tok.encode(" Paris")) == 1 else (tok.encode("a")[0],)
    text = tok.decode([pid])
    bp = token_breakpoint(tok, text)
    assert bp == TokenIs((pid,)) and bp.describe() == f"token {text!r} (id {pid})"
    two = token_breakpoint(tok, f"{pid}, 13")
    assert two.describe() == f"token one of {text!r} (id {pid}), {tok.decode([13])!r} (id 13)"
    assert TokenIs((5,)).describe() == "token id in [5]"           # made without texts (the CLI, a trace)
