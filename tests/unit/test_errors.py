"""Every bad input gets a clear error naming what is wrong."""
from __future__ import annotations

import json

import pytest
import torch

from engine import EngineError, InputError, ModelLoadError, UnsupportedModelError, load_model
from engine.generate import generate
from engine.sampling import SamplingParams
from tests.helpers import tiny_config, tiny_tensors, write_model_dir


def load(path):
    return load_model(path, device="cpu", dtype="float32")


def test_empty_prompt(tiny_model):
    for bad in ("", "   \n\t"):
        with pytest.raises(InputError, match="prompt is empty"):
            generate(tiny_model, bad)
    with pytest.raises(InputError, match="empty"):
        generate(tiny_model, [])


def test_prompt_longer_than_context(tiny_model):
    ids = [100] * tiny_model.context_length
    with pytest.raises(InputError, match=f"prompt has {len(ids)} tokens; the model's context is"):
        generate(tiny_model, ids)
    with pytest.raises(InputError, match="exceed the model's context length"):
        tiny_model.logits([100] * (tiny_model.context_length + 1))


def test_token_id_outside_vocabulary(tiny_model):
    with pytest.raises(InputError, match="outside the vocabulary"):
        tiny_model.logits([1, 2, tiny_model.config.vocab_size])


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="model not found"):
        load(tmp_path / "does-not-exist")
    with pytest.raises(ModelLoadError, match="not in the Hugging Face hub cache"):
        load("nobody/no-such-model")
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load(tmp_path / "x.gguf")


def test_directory_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load(tmp_path / "m")


def test_truncated_safetensors(tmp_path, tokenizer_files):
    d = write_model_dir(tmp_path / "m", tokenizer_files)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors.*(truncated or corrupt)"):
        load(d)


def test_tensor_of_wrong_shape(tmp_path, tokenizer_files):
    cfg = tiny_config()
    t = tiny_tensors(cfg)
    t["model.layers.1.mlp.up_proj.weight"] = torch.zeros(127, 64)
    d = write_model_dir(tmp_path / "m", tokenizer_files, cfg, t)
    with pytest.raises(ModelLoadError,
                       match=r"model.layers.1.mlp.up_proj.weight has shape \(127, 64\), expected \(128, 64\)"):
        load(d)


def test_missing_and_unexpected_tensors(tmp_path, tokenizer_files):
    cfg = tiny_config()
    t = tiny_tensors(cfg)
    del t["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ModelLoadError, match="missing tensor.*model.layers.0.self_attn.k_proj.weight"):
        load(write_model_dir(tmp_path / "a", tokenizer_files, cfg, t))
    t = tiny_tensors(cfg)
    t["model.layers.0.extra.weight"] = torch.zeros(2)
    with pytest.raises(ModelLoadError, match="unexpected tensor.*model.layers.0.extra.weight"):
        load(write_model_dir(tmp_path / "b", tokenizer_files, cfg, t))


def test_wrong_dtype_and_nan_weights(tmp_path, tokenizer_files):
    cfg = tiny_config()
    t = tiny_tensors(cfg)
    t["model.norm.weight"] = torch.ones(64, dtype=torch.int32)
    with pytest.raises(ModelLoadError, match="model.norm.weight has dtype torch.int32"):
        load(write_model_dir(tmp_path / "a", tokenizer_files, cfg, t))
    t = tiny_tensors(cfg)
    t["model.layers.1.self_attn.o_proj.weight"][3, 3] = float("nan")
    with pytest.raises(ModelLoadError, match="model.layers.1.self_attn.o_proj.weight contains NaN"):
        load(write_model_dir(tmp_path / "b", tokenizer_files, cfg, t))


def test_unsupported_architecture_and_fields(tmp_path, tokenizer_files):
    cases = [({"model_type": "bloom", "architectures": ["BloomForCausalLM"]},
              "unsupported architecture model_type='bloom'"),
             ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_scaling type 'yarn'"),
             ({"hidden_act": "gelu"}, "unsupported hidden_act='gelu'"),
             ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3")]
    for i, (override, msg) in enumerate(cases):
        d = write_model_dir(tmp_path / f"m{i}", tokenizer_files, tiny_config(), {})
        (d / "config.json").write_text(json.dumps(tiny_config(**override)))
        with pytest.raises(UnsupportedModelError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[",
                                                                                                            r"\[")):
            load(d)


def test_config_not_json_and_missing_key(tmp_path, tokenizer_files):
    d = write_model_dir(tmp_path / "a", tokenizer_files)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load(d)
    cfg = tiny_config()
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="missing required key 'hidden_size'"):
        load(d)


def test_pickle_checkpoints_are_refused(tmp_path, tokenizer_files):
    d = write_model_dir(tmp_path / "a", tokenizer_files)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match="never unpickles"):
        load(d)


def test_tokenizer_disagreeing_with_model_vocab(tmp_path, tokenizer_files):
    cfg = tiny_config(vocab_size=1000)
    d = write_model_dir(tmp_path / "a", tokenizer_files, cfg)
    with pytest.raises(ModelLoadError, match="tokenizer has 49152 tokens but the model's vocabulary has 1000"):
        load(d)


def test_missing_tokenizer(tmp_path, tokenizer_files):
    d = write_model_dir(tmp_path / "a", tokenizer_files)
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load(d)


@pytest.mark.parametrize("kwargs,msg", [
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature must be finite"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be a whole number"),
    ({"top_k": 2.5}, "top_k must be a whole number"),
    ({"min_p": 2.0}, r"min_p must be in \[0, 1\]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"frequency_penalty": float("inf")}, "frequency_penalty must be finite"),
    ({"presence_penalty": "a lot"}, "presence_penalty must be a number"),
    ({"no_repeat_ngram": -2}, "no_repeat_ngram must be a whole number"),
])
def test_invalid_sampling_parameters(tiny_model, kwargs, msg):
    with pytest.raises(InputError, match=msg):
        SamplingParams(**kwargs)
    with pytest.raises(InputError, match=msg):
        generate(tiny_model, "hello", params=SamplingParams(**kwargs))


@pytest.mark.parametrize("kwargs,msg", [({"max_new_tokens": 0}, "max_new_tokens must be a whole number >= 1"),
                                        ({"max_new_tokens": 2.5}, "max_new_tokens"),
                                        ({"seed": -1}, "seed must be a whole number")])
def test_invalid_generation_parameters(tiny_model, kwargs, msg):
    with pytest.raises(InputError, match=msg):
        generate(tiny_model, "hello", **kwargs)


def test_bad_device_and_dtype(tiny_model_dir):
    with pytest.raises(EngineError, match="unsupported dtype 'int8'"):
        load_model(tiny_model_dir, dtype="int8")
    if not torch.cuda.is_available():
        with pytest.raises(EngineError, match="no CUDA GPU is available"):
            load_model(tiny_model_dir, device="cuda")


def test_model_still_works_after_errors(tiny_model):
    for bad in ({"temperature": -1}, {"top_p": 0}):
        with pytest.raises(InputError):
            generate(tiny_model, "hi", params=SamplingParams(**bad))
    assert generate(tiny_model, "hi", max_new_tokens=3, ignore_eos=True).token_ids.__len__() == 3
    assert tiny_model.live_hooks == 0
