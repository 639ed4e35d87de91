"""One object per idea: SamplingParams and RunSettings are keyword-only and travel whole; old trace settings
(sampler fields flat beside the prompt) still read; the precision plan computes named units in fp32."""
from __future__ import annotations

import pytest
import torch

from engine import InputError, RunSettings, SamplingParams
from engine.variants import cast_model, precision_plan

pytestmark = pytest.mark.unit


def test_sampling_params_cannot_be_built_positionally():
    with pytest.raises(TypeError):
        SamplingParams(0.7, 40)
    assert SamplingParams(temperature=0.7, top_k=40).changed() == {"temperature": 0.7, "top_k": 40}


def test_run_settings_round_trip_and_read_the_older_flat_layout():
    s = RunSettings(prompt="hi", chat=False, max_new_tokens=5, params=SamplingParams(temperature=0.9, top_k=7),
                    seed=3, stop=("x",), ignore_eos=True)
    assert RunSettings.from_dict(s.as_dict()) == s
    old = {"prompt": "hi", "chat": False, "max_new_tokens": 5, "temperature": 0.9, "top_k": 7, "seed": 3,
           "stop": ["x"], "ignore_eos": True, "timing": True, "a_field_from_the_future": 1}
    assert RunSettings.from_dict(old) == s
    assert s.generation_kwargs()["params"] is s.params


@pytest.mark.parametrize("bad, message", [
    ({"prompt": "p", "params": {"temperature": -1}}, "temperature must be >= 0"),
    ({"prompt": "p", "params": [1, 2]}, "params must be a JSON object"),
    ({"prompt": "p", "stop": "x"}, "stop must be a list of strings"),
    ({"prompt": "p", "max_new_tokens": 3, "params": {"top_k": "many"}}, "top_k must be a number"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_run_settings_are_refused_by_name(bad, message):
    with pytest.raises(InputError, match=message):
        RunSettings.from_dict(bad)


def test_run_settings_take_only_a_sampling_params():
    with pytest.raises(InputError, match="params must be a SamplingParams"):
        RunSettings(prompt="p", params={"temperature": 1.0})


def test_precision_plan_units(tiny_model):
    ids = list(range(5, 17))
    ref = tiny_model.logits(ids)
    half = cast_model(tiny_model, "bfloat16")
    every = [f"blocks.{i}.{u}" for i in range(tiny_model.config.num_layers) for u in ("attn", "mlp")]
    planned = precision_plan(half, every + ["blocks.0.resid", "final_norm", "logits"], source=tiny_model)
    err_half = float((half.logits(ids) - ref).norm() / ref.norm())
    err_plan = float((planned.logits(ids) - ref).norm() / ref.norm())
    assert err_plan < err_half / 2                # only the embedding and the KV cache stay in bfloat16
    assert planned.weights.layers[0].wqkv.dtype == torch.float32 and half.weights.layers[0].wqkv.dtype == torch.bfloat16
    assert planned.weights.embed is half.weights.embed                 # shared, not copied
    assert precision_plan(tiny_model, []).logits(ids).equal(ref)             # an empty plan is the model itself
    with pytest.raises(InputError, match="unknown precision unit 'blocks.9.mlp'"):
        precision_plan(half, ["blocks.9.mlp"])
