"""inspector.views.kv_cache against hand-computed sizes and the engine's own KVCache numbers."""
from __future__ import annotations

import pytest
import torch

from engine import KVCache, RunSettings, SamplingParams
from engine.config import ModelConfig
from inspector.session.run import inspect_run
from inspector.views import kv_cache as kv


def config_for(shape: kv.KVShape) -> ModelConfig:
    return ModelConfig.from_dict({"model_type": "llama", "vocab_size": 32, "intermediate_size": 8,
                                  "hidden_size": shape.num_heads * shape.head_dim, "head_dim": shape.head_dim,
                                  "num_hidden_layers": shape.layers, "num_attention_heads": shape.num_heads,
                                  "num_key_value_heads": shape.kv_heads})


def test_formula_hand_values():
    # SmolLM2-135M, one float32 position: 2 · 30 · 3 · 64 · 4
    assert kv.kv_bytes(30, 3, 64, 1, 1, 4) == 46_080
    # Llama-3-8B at 8k positions in bf16 is exactly 1 GiB: 2 · 32 · 8 · 128 · 8192 · 2
    assert kv.KNOWN_MODELS["Llama-3-8B"].bytes(8192, 1, 2) == 2 ** 30
    # Llama-2-7B (no GQA) at 4k in fp16, batch 4: 2 GiB each
    assert kv.KNOWN_MODELS["Llama-2-7B"].bytes(4096, 4, 2) == 4 * 2 * 2 ** 30


@pytest.mark.parametrize("name", list(kv.KNOWN_MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_formula_equals_engine_kvcache(name, dtype):
    shape = kv.KNOWN_MODELS[name]
    cache = KVCache(config_for(shape), 16, "cpu", dtype)
    bpe = kv.bytes_per_element(dtype)
    assert cache.bytes_allocated == shape.bytes(16, 1, bpe)
    assert cache.bytes_per_token == shape.bytes(1, 1, bpe)
    # and both equal the storage torch actually allocated
    assert cache.k.nbytes + cache.v.nbytes == shape.bytes(16, 1, bpe)


def test_bytes_per_element_and_names():
    assert [kv.bytes_per_element(d) for d in ("float32", "bfloat16", "float16", "fp8 / int8")] == [4, 2, 2, 1]
    assert kv.bytes_per_element(torch.float16) == 2 and kv.bytes_per_element("torch.float32") == 4
    assert kv.dtype_name(torch.bfloat16) == "bfloat16"
    assert kv.human_bytes(512) == "512 B" and kv.human_bytes(3 * 2 ** 20) == "3.00 MiB"
    assert kv.human_bytes(2 ** 30) == "1.00 GiB"


@pytest.fixture(scope="module")
def tiny_run(tiny_model):
    return inspect_run(tiny_model, RunSettings(prompt="KV cache growth", chat=False, max_new_tokens=5,
                                               params=SamplingParams(temperature=0.0)))


def test_formula_vs_engine_on_a_run(tiny_model, tiny_run):
    result = tiny_run.result
    shape = kv.KVShape.from_config(tiny_model.config)
    assert shape == kv.KVShape(layers=2, kv_heads=2, head_dim=16, num_heads=4)
    df = kv.formula_vs_engine(shape, 4, result.cache).set_index("quantity")
    n_prompt, n_steps = len(result.prompt_ids), len(result.steps)
    assert df.loc["bytes per token", "engine_bytes"] == 2 * 2 * 2 * 16 * 4 == 512
    assert df.loc["allocated", "positions"] == n_prompt + 5
    assert df.loc["used", "positions"] == n_prompt + n_steps - 1     # the last chosen token is never written
    assert df.loc["allocated", "formula_bytes"] == 512 * (n_prompt + 5)
    assert df["match"].all()
    assert (df["formula_bytes"] == df["engine_bytes"]).all()
    assert tiny_model.new_cache(n_prompt + 5).bytes_allocated == df.loc["allocated", "engine_bytes"]


def test_growth_table(tiny_run):
    result = tiny_run.result
    g = kv.growth_table(result)
    n = len(result.prompt_ids)
    assert list(g["step"]) == list(range(len(result.steps)))
    assert list(g["positions"]) == [n + s for s in range(len(result.steps))]
    assert list(g["used_bytes"]) == [512 * (n + s) for s in range(len(result.steps))]
    assert g["used_bytes"].iloc[-1] == result.cache["bytes_used"]
    assert (g["allocated_bytes"] == result.cache["bytes_allocated"]).all()
    fig = kv.growth_figure(g)
    assert [t.name for t in fig.data] == ["used", "allocated"]
    assert list(fig.data[0].y) == list(g["used_bytes"])
    assert len(set(fig.data[1].y)) == 1                              # allocated: a flat line


def test_per_layer_table_sums_to_totals():
    shape = kv.KNOWN_MODELS["SmolLM2-135M"]
    df = kv.per_layer_table(shape, 4, allocated_positions=40, used_positions=30)
    assert len(df) == 30 and list(df["layer"]) == list(range(30))
    assert df["allocated_bytes"].sum() == shape.bytes(40, 1, 4)
    assert df["used_bytes"].sum() == shape.bytes(30, 1, 4)
    assert (df["used_bytes"] == 2 * 3 * 64 * 4 * 30).all()
    assert df["used_pct"].iloc[0] == pytest.approx(75.0)
    fig = kv.per_layer_figure(df)
    assert len(fig.data) == 2 and len(fig.data[0].x) == 30


def test_gqa_savings():
    shape = kv.KNOWN_MODELS["SmolLM2-135M"]          # 9 query heads share 3 KV heads
    df = kv.gqa_table(shape, 4, {"used": 100}).iloc[0]
    assert df["gqa_bytes"] == 2 * 30 * 3 * 64 * 100 * 4
    assert df["mha_bytes"] == 2 * 30 * 9 * 64 * 100 * 4
    assert df["saved_bytes"] == df["mha_bytes"] - df["gqa_bytes"]
    assert df["mha_over_gqa"] == pytest.approx(3.0)
    llama70 = kv.gqa_table(kv.KNOWN_MODELS["Llama-3-70B"], 2, {"x": 1}).iloc[0]
    assert llama70["mha_over_gqa"] == pytest.approx(8.0)
    assert kv.gqa_table(kv.KNOWN_MODELS["Llama-2-7B"], 2, {"x": 1}).iloc[0]["saved_bytes"] == 0


def test_projection_table_scales_with_context_batch_and_dtype():
    df = kv.projection_table(kv.KNOWN_MODELS, [1024, 8192], batch=1, dtype="bfloat16")
    assert len(df) == 2 * len(kv.KNOWN_MODELS)
    row = df[(df["model"] == "Llama-3-8B") & (df["context"] == 8192)].iloc[0]
    assert row["bytes"] == 2 ** 30 and row["GiB"] == pytest.approx(1.0)
    assert row["mha_bytes"] == 4 * 2 ** 30
    qwen = df[df["model"] == "Qwen2-7B"].set_index("context")["bytes"]
    assert qwen[8192] == 8 * qwen[1024] == 2 * 28 * 4 * 128 * 8192 * 2
    big = kv.projection_table({"m": kv.KNOWN_MODELS["Mistral-7B"]}, [4096], batch=8, dtype="float32")
    small = kv.projection_table({"m": kv.KNOWN_MODELS["Mistral-7B"]}, [4096], batch=1, dtype="float16")
    assert big["bytes"].iloc[0] == 16 * small["bytes"].iloc[0]
    pivot = kv.projection_pivot(df)
    assert list(pivot.index) == list(kv.KNOWN_MODELS) and list(pivot.columns) == [1024, 8192]
    assert pivot.loc["Llama-3-70B", 8192] == pytest.approx(2.5)
    fig = kv.projection_figure(df)
    # Llama-3-8B and Mistral-7B have the same cache (32 layers, 8 KV heads of 128): one line named for both,
    # not two lines drawn on top of each other; every other model its own line
    assert len(fig.data) == len(kv.KNOWN_MODELS) - 1 and fig.layout.xaxis.type == "log"
    assert [t.name for t in fig.data if "=" in t.name] == ["Llama-3-8B = Mistral-7B (same cache size)"]
    assert len({tuple(t.y) for t in fig.data}) == len(fig.data)


def test_cuda_counters_only_on_cuda():
    assert kv.cuda_memory_table("cpu") is None
    if torch.cuda.is_available():
        df = kv.cuda_memory_table("cuda")
        assert list(df["counter"]) == ["memory_allocated", "max_memory_allocated", "memory_reserved"]
        assert (df["bytes"] >= 0).all()
