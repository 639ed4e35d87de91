"""Tiny random Llama 2/3, Mistral, Qwen2 checkpoints: the engine against transformers on the same files."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from engine import load_model
from tests.helpers import tiny_config, tiny_tensors, write_model_dir

transformers = pytest.importorskip("transformers")

CASES = {
    "llama2": dict(),
    "llama-tied": dict(tie_word_embeddings=True),
    "llama3-rope-scaling": dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "llama-linear-rope": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama-attention-bias": dict(attention_bias=True),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=False),
    "head-dim-override": dict(head_dim=32),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers(tmp_path, tokenizer_files, name):
    cfg = tiny_config(**CASES[name])
    d = write_model_dir(tmp_path / name, tokenizer_files, cfg, tiny_tensors(cfg, seed=len(name)))
    ours = load_model(d, device="cpu", dtype="float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    ids = ours.tokenizer.encode("Rotary positions matter at long range. " * 8)[:96]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = ours.logits(ids)
    assert float((got - want).norm() / want.norm()) <= 1e-4
    # and through the KV cache, one token at a time after a prefill
    cache = ours.new_cache(len(ids))
    stepped = torch.cat([ours.forward(torch.tensor(ids[:50]), cache)] +
                        [ours.forward(torch.tensor([t]), cache) for t in ids[50:]])
    assert float((stepped - want).norm() / want.norm()) <= 1e-4


def test_sharded_checkpoint(tmp_path, tokenizer_files, tiny_model_dir):
    cfg = tiny_config()
    t = tiny_tensors(cfg)
    d = write_model_dir(tmp_path / "sharded", tokenizer_files, cfg, {})
    (d / "model.safetensors").unlink()
    names = sorted(t)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, keys in shards.items():
        save_file({k: t[k] for k in keys}, str(d / fname))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    sharded = load_model(d, device="cpu", dtype="float32")
    single = load_model(tiny_model_dir, device="cpu", dtype="float32")
    assert torch.equal(sharded.logits([5, 6, 7]), single.logits([5, 6, 7]))


def test_org_name_from_offline_hub_cache(tmp_path, monkeypatch, tiny_model_dir):
    snap = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for f in tiny_model_dir.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    m = load_model("acme/tiny", device="cpu")
    assert m.name == "acme/tiny" and m.path == snap


def test_fp16_and_bf16_run_close_to_fp32(tiny_model_dir):
    ids = list(range(100, 140))
    ref = load_model(tiny_model_dir, dtype="float32").logits(ids)
    for dt in ("bfloat16", "float16"):
        m = load_model(tiny_model_dir, dtype=dt)
        assert m.dtype == getattr(torch, dt) and m.weights.embed.dtype == m.dtype
        got = m.logits(ids)
        assert float((got - ref).norm() / ref.norm()) < 0.05, dt
