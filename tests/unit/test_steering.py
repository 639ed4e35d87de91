"""Steering (engine.tools.steering) on the tiny model: coefficient 0 is bit for bit the plain run (tokens and every
step's logits, KL 0), a vector moves the run and its KL is what the two distributions give by hand, the vector is
the mean difference of the captured residual streams computed by hand, the steered prefill that shares the plain
one's first blocks is the steered run's own, and bad input is refused by name.
tests/reference/test_steering_reference.py holds the steered run to transformers with a forward hook."""
from __future__ import annotations

import json

import pytest
import torch

from engine import InputError, Probe, SamplingParams
from engine.settings import RunSettings
from engine.accelerator import PLAIN
from engine.generate import GenerationRun
from engine.tools.steering import (MAX_PROMPTS, SteeringVector, _prefill_both, steer, steering_probe,
                                   steering_vector)
from tests.helpers import engine_cli

pytestmark = pytest.mark.unit
POS, NEG = ["good happy joy", "a great day"], ["bad sad grief", "a terrible day"]
SETTINGS = RunSettings(prompt="The weather today is", chat=False, max_new_tokens=6, params=SamplingParams(temperature=0),
                       ignore_eos=True)


def test_the_vector_is_the_mean_difference_of_the_residual_streams(tiny_model):
    vec = steering_vector(tiny_model, POS, NEG, 1)

    def mean(prompts):
        rows = []
        for p in prompts:
            probe = Probe().capture("blocks.1.resid_post")
            tiny_model.logits(tiny_model.tokenizer.encode(p), probe)
            x = probe.recording.captured("blocks.1.resid_post")[0].value.double()
            rows.append(x.sum(0) / x.shape[0])
        return sum(rows) / len(rows)
    # the prompts share one forward (a block-diagonal causal mask), whose products are blocked otherwise than one
    # prompt's: each stream element within a few float32 spacings of the streams' scale (2^-23 of it) of the lone
    # forwards' (measured: 2.8e-7 of the largest); a row reading another prompt's keys would be off by O(1)
    want = mean(POS) - mean(NEG)
    assert float((vec.vector.double() - want).abs().max()) <= 2 ** -19 * float(want.abs().max())
    assert vec.stage == "blocks.1.resid_post" and vec.norm > 0


def test_coefficient_zero_is_the_plain_run_bit_for_bit(tiny_model):
    vec = steering_vector(tiny_model, POS, NEG, 0)
    run = steer(tiny_model, SETTINGS, vec, 0.0)
    assert run.steered_ids == run.plain_ids and run.steered_text == run.plain_text
    assert all(s["kl_steered_plain"] == 0.0 and s["p_steered"] == s["p_plain"] for s in run.steps)


def test_a_vector_moves_the_run_and_its_kl_is_the_distributions(tiny_model):
    vec = SteeringVector(0, torch.randn(tiny_model.config.hidden_size, generator=torch.Generator().manual_seed(1)),
                         ("p",), ("n",))
    run = steer(tiny_model, SETTINGS, vec, 8.0)
    assert run.steered_ids != run.plain_ids
    # by hand: the steered logits from a probe adding 8 v; the plain ones on the steered prefix
    ids = tiny_model.tokenizer.encode(SETTINGS.prompt) + run.steered_ids
    n = len(ids) - len(run.steered_ids)
    steered = tiny_model.logits(ids[:-1], steering_probe(vec, 8.0))[n - 1:].double()
    plain = tiny_model.logits(ids[:-1])[n - 1:].double()
    for k, step in enumerate(run.steps):
        lp, lq = torch.log_softmax(steered[k], -1), torch.log_softmax(plain[k], -1)
        assert step["token"] == int(steered[k].argmax())
        assert abs(step["kl_steered_plain"] - float((lp.exp() * (lp - lq)).sum())) <= 1e-4
        assert abs(step["p_plain"] - float(lq[step["token"]].exp())) <= 1e-5


@pytest.mark.parametrize("call, msg", [
    (lambda m: steering_vector(m, POS, NEG, 2), "layer must be a whole number in 0..1"),
    (lambda m: steering_vector(m, [], NEG, 0), "positive set needs at least one"),
    (lambda m: steering_vector(m, POS, ["  "], 0), "negative set needs at least one"),
    (lambda m: steering_vector(m, ["x"] * (MAX_PROMPTS + 1), NEG, 0), f"at most {MAX_PROMPTS}"),
    (lambda m: steering_vector(m, "a string", NEG, 0), "list of strings"),
    (lambda m: steer(m, SETTINGS, steering_vector(m, POS, NEG, 0), float("nan")), "finite number"),
    (lambda m: steer(m, SETTINGS, steering_vector(m, POS, NEG, 0), 1e9), "finite number"),
    (lambda m: steer(m, SETTINGS, SteeringVector(0, torch.zeros(3), ("p",), ("n",)), 1.0), "does not fit"),
])
def test_bad_input_is_refused_by_name(tiny_model, call, msg):
    with pytest.raises(InputError, match=msg):
        call(tiny_model)


def test_the_cli_steers_and_says_what_moved(tiny_model_dir):
    r = engine_cli("steer", "The weather today is", "--model", tiny_model_dir, "--positive", "good happy joy",
                   "--negative", "bad sad grief", "--layer", "1", "--coefficient", "0", "--max-new-tokens", "4",
                   "--temperature", "0", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["steered_ids"] == d["plain_ids"] and len(d["steps"]) == 4 and d["vector"]["layer"] == 1
    bad = engine_cli("steer", "x", "--model", tiny_model_dir, "--positive", "a", "--negative", "b", "--layer", "9")
    assert bad.returncode != 0 and "layer must be" in bad.stderr


@pytest.mark.parametrize("chat", [False, True])
def test_the_shared_prefill_is_the_steered_runs_own(tiny_model, chat):
    """The steered prompt shares the plain prefill's blocks 0 .. layer (their keys and values copied, the later
    blocks run on the plain stream plus the vector, in the plain prefill's chunks: with chat, the template opening
    first): its first logits and its whole cache are those of the steered run prefilled alone, bit for bit."""
    plain_model = tiny_model.with_accelerator(PLAIN)
    vec = SteeringVector(0, torch.randn(tiny_model.config.hidden_size, generator=torch.Generator().manual_seed(2)),
                         ("p",), ("n",))

    def run(probe):
        return GenerationRun(plain_model, "The weather today is", probe=probe, max_new_tokens=3, chat=chat)
    plain = run(Probe().capture(["logits", vec.stage]))
    steered = run(steering_probe(vec, 3.0, Probe().capture("logits")))
    first = _prefill_both(plain_model, plain, steered, vec.layer)
    alone = run(steering_probe(vec, 3.0, Probe().capture("logits")))
    alone.step()
    assert (steered.prefix_len > 0) == chat
    assert torch.equal(first[1][0], alone.probe.recording.captured("logits", 0)[0].value.float()[-1])
    assert not torch.equal(first[1][0], first[0][0])                   # the vector does move it
    n = len(alone.prompt_ids)
    assert steered.cache.get_pos() == alone.cache.get_pos() == n and steered.token_ids == alone.token_ids
    assert torch.equal(steered.cache.k[:, :, :n], alone.cache.k[:, :, :n])
    assert torch.equal(steered.cache.v[:, :, :n], alone.cache.v[:, :, :n])


def test_copy_layers_copies_the_layers_asked_for_and_refuses_another_shape(tiny_model):
    src, dst = tiny_model.new_cache(8), tiny_model.new_cache(8)
    src.k.normal_(generator=torch.Generator().manual_seed(3))
    src.v.normal_(generator=torch.Generator().manual_seed(4))
    dst.copy_layers(src, range(1))
    assert torch.equal(dst.k[0], src.k[0]) and torch.equal(dst.v[0], src.v[0])
    assert not dst.k[1].any() and not dst.v[1].any() and dst.get_pos() == 0        # layer 1 and the position kept
    with pytest.raises(InputError, match="same length"):
        tiny_model.new_cache(9).copy_layers(src, range(1))
