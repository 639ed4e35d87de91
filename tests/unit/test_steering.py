"""Steering (engine.tools.steering) on the tiny model: coefficient 0 is bit for bit the plain run (tokens and every
step's logits, KL 0), a vector moves the run and its KL is what the two distributions give by hand, the vector is
the mean difference of the captured residual streams computed by hand, and bad input is refused by name.
tests/reference/test_steering_reference.py holds the steered run to transformers with a forward hook."""
from __future__ import annotations

import json

import pytest
import torch

from engine import InputError, Probe, SamplingParams
from engine.settings import RunSettings
from engine.tools.steering import MAX_PROMPTS, SteeringVector, steer, steering_probe, steering_vector
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
    assert torch.allclose(vec.vector.double(), mean(POS) - mean(NEG), rtol=1e-6, atol=1e-7)
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
