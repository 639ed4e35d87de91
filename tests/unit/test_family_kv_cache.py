"""The KV cache view on a model with sliding-window (local) layers: global and local layers counted apart, the
local layers' rings stop growing at the window, and every figure agrees with the engine's own KVCache bytes.

The tiny family models are made by transformers (test-only) from a config; family_model() is shared with the
other test_family_* files."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine import RunSettings, SamplingParams
from inspector.session.run import inspect_run
from inspector.views import kv_cache as kv

BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
WINDOW = 8
FAMILIES = {"gemma2": dict(head_dim=16, sliding_window=WINDOW, final_logit_softcapping=0.5),
            "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}
PROMPT = "The quick brown fox jumps over the lazy dog and then runs far away into the woods"


def family_model(model_type: str, out: Path, tokenizer_files: Path):
    """(model, folder): a tiny random-weight model of this family, saved by transformers and loaded by the engine."""
    transformers = pytest.importorskip("transformers")
    import torch

    from engine import load_model
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, **BASE, **FAMILIES[model_type])
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_files / f, out / f)
    return load_model(out, device="cpu", dtype="float32"), out


def family_run(model, max_new: int = 6):
    return inspect_run(model, RunSettings(prompt=PROMPT, chat=False, max_new_tokens=max_new,
                                          params=SamplingParams(temperature=0.0)))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, tokenizer_files):
    return family_model("gemma2", tmp_path_factory.mktemp("fam") / "gemma2", tokenizer_files)[0]


@pytest.fixture(scope="module")
def gemma_run(gemma):
    return family_run(gemma)


def test_shape_knows_which_layers_are_local_and_matches_real_caches(gemma):
    shape = kv.KVShape.from_config(gemma.config)
    assert gemma.config.layer_window == (WINDOW, None, WINDOW, None)
    assert shape.windows == (WINDOW, None, WINDOW, None)
    per_row = 2 * 2 * 16 * 4                                     # K and V · kv_heads · head_dim · float32
    for n in (1, 5, WINDOW, 9, 40):
        cache = gemma.new_cache(n)
        # two global layers count every position, two local ones at most the window
        assert cache.bytes_allocated == shape.bytes(n, 1, 4) == per_row * (2 * n + 2 * min(n, WINDOW))
        table = kv.per_layer_table(shape, 4, n, n)
        assert list(table["allocated_bytes"]) == [a for a, _ in cache.layer_bytes()]
    # a plain Llama config keeps the old shape (no windows)
    assert kv.KVShape.from_config(type(gemma.config)(**{**gemma.config.__dict__, "layer_window": (None,) * 4})
                                  ).windows == ()


def test_per_layer_and_kind_tables_equal_the_engines_layer_bytes(gemma):
    shape, n, pos = kv.KVShape.from_config(gemma.config), 30, 20
    cache = gemma.new_cache(n)
    cache.advance(pos)
    layers = kv.per_layer_table(shape, 4, n, pos)
    assert list(zip(layers["allocated_bytes"], layers["used_bytes"])) == cache.layer_bytes()
    assert list(layers["kind"]) == ["local (window 8)", "global"] * 2
    assert layers["used_bytes"].sum() == cache.bytes_used and layers["allocated_bytes"].sum() == cache.bytes_allocated
    per_row = 2 * 2 * 16 * 4
    kinds = kv.kind_table(layers, per_row).set_index("kind")
    assert kinds.loc["global", "layers"] == 2 and kinds.loc["local (window 8)", "window"] == WINDOW
    assert kinds.loc["global", "used_bytes"] == 2 * per_row * pos
    assert kinds.loc["local (window 8)", "used_bytes"] == 2 * per_row * WINDOW
    # the full ring adds nothing for the next token; the global layers add a row each
    assert kinds.loc["local (window 8)", "next_token_bytes"] == 0 and not kinds.loc["local (window 8)", "growing"]
    assert kinds.loc["global", "next_token_bytes"] == 2 * per_row and kinds.loc["global", "growing"]
    short = kv.kind_table(kv.per_layer_table(shape, 4, n, 3), per_row).set_index("kind")
    assert short.loc["local (window 8)", "growing"]            # 3 of 8 rows: still filling


def test_run_figures_agree_with_the_engine_and_local_memory_stops_growing(gemma, gemma_run):
    result, shape = gemma_run.result, kv.KVShape.from_config(gemma.config)
    n_prompt = len(result.prompt_ids)
    assert n_prompt > WINDOW                                     # the rings turned during the prefill
    check = kv.formula_vs_engine(shape, 4, result.cache).set_index("quantity")
    assert check["match"].all()
    assert check.loc["allocated", "positions"] == n_prompt + 6   # the run's cache length, not bytes / bytes_per_token
    assert check.loc["used", "positions"] == result.steps[-1].position
    assert check.loc["allocated", "engine_bytes"] == gemma.new_cache(n_prompt + 6).bytes_allocated
    growth = kv.growth_table(result, shape)
    per_row = result.cache["bytes_per_token"] // 4
    assert growth["used_bytes"].iloc[-1] == result.cache["bytes_used"]
    assert (growth["local_used_bytes"] == 2 * WINDOW * per_row).all()       # flat: the window layers are full
    assert list(growth["global_used_bytes"].diff().dropna()) == [2 * per_row] * (len(growth) - 1)
    fig = kv.growth_figure(growth)
    assert [t.name for t in fig.data] == ["used", "allocated", "used: global layers", "used: local (window) layers"]


def test_calculator_counts_local_layers_at_most_their_window(gemma):
    shape = kv.KVShape.from_config(gemma.config)
    proj = kv.projection_table({"tiny gemma": shape, **kv.WINDOWED_MODELS}, [4, 1024, 8192], dtype="bfloat16")
    row = proj.set_index(["model", "context"])
    assert row.loc[("tiny gemma", 1024), "bytes"] == 2 * 2 * 16 * 2 * (2 * 1024 + 2 * WINDOW)
    assert row.loc[("tiny gemma", 4), "bytes"] == 2 * 2 * 16 * 2 * 4 * 4       # under the window: all count
    assert row.loc[("tiny gemma", 1024), "local_layers"] == 2
    # Gemma-2-9B in bf16: 21 global layers at 8,192 positions, 21 local ones at their 4,096
    assert row.loc[("Gemma-2-9B", 8192), "bytes"] == 2 * 8 * 256 * 2 * (21 * 8192 + 21 * 4096)
    assert row.loc[("Gemma-2-9B", 1024), "bytes"] == kv.kv_bytes(42, 8, 256, 1024, 1, 2)
    assert kv.positions_for_rows(shape, shape.rows(100)) == 100


def test_every_layer_local_the_runs_own_lengths_are_kept(tmp_path, tokenizer_files):
    """Mistral with a window on every layer: once the rings are full the bytes no longer tell the cache's length;
    the run's own length and last position are taken where they give the engine's bytes."""
    FAMILIES["mistral"] = dict(sliding_window=WINDOW)
    try:
        model, _ = family_model("mistral", tmp_path / "mistral", tokenizer_files)
    finally:
        del FAMILIES["mistral"]
    shape = kv.KVShape.from_config(model.config)
    assert shape.windows == (WINDOW,) * 4
    result = family_run(model, max_new=4).result
    n_prompt, last = len(result.prompt_ids), result.steps[-1].position
    assert kv.run_positions(result.cache, shape) == (WINDOW, WINDOW)          # the fewest that fit the bytes
    assert kv.run_positions(result.cache, shape, (n_prompt + 4, last)) == (n_prompt + 4, last)
    assert kv.run_positions(result.cache, shape, (3, 2)) == (WINDOW, WINDOW)  # hints that disagree are dropped
    check = kv.formula_vs_engine(shape, 4, result.cache, (n_prompt + 4, last)).set_index("quantity")
    assert check["match"].all()
    assert check.loc["allocated", "engine_bytes"] == model.new_cache(n_prompt + 4).bytes_allocated
    kinds = kv.kind_table(kv.per_layer_table(shape, 4, n_prompt + 4, last), result.cache["bytes_per_token"] // 4)
    assert list(kinds["kind"]) == [f"local (window {WINDOW})"] and not kinds["growing"].iloc[0]


def test_per_layer_figure_colours_local_layers(gemma):
    shape = kv.KVShape.from_config(gemma.config)
    fig = kv.per_layer_figure(kv.per_layer_table(shape, 4, 30, 20))
    used = fig.data[1]
    assert list(used.marker.color) == ["#d9822b", "#3b6fb6"] * 2 and "local" in used.name
    assert list(used.customdata) == ["local (window 8)", "global"] * 2
