"""The bench's GGUF writer (engine.bench.size_files): a tiny shape of each family it writes (llama, qwen3, gemma3), in
each format, reads back with the gguf reader as llama.cpp's tensor names and the shapes counted by hand from the
config, every matrix in the format (or llama-quantize's fallback where its rows are not whole blocks), norms in
float32; and loads as stored (its matrices kept in the file's blocks) with logits equal to the same file loaded
dequantised (the import, gguf.quants.dequantize of every tensor, the independent reference) within the tolerance
tests/unit/test_gguf_as_stored.py derives: both loads compute with the very same weight values, only float32
summation orders differ, LOGITS_RTOL = 1e-4 of max |logit|."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from engine import load_model                                   # noqa: E402
from engine.bench import size_files                             # noqa: E402
from engine.gguf_file import open_gguf                          # noqa: E402
from engine.quant_matrix import QuantMatrix                     # noqa: E402

pytestmark = pytest.mark.unit

LOGITS_RTOL = 1e-4
V, LAYERS = 49152, 2          # the bundled tokenizer's 49,152 tokens: the writer's token list
COMMON = {"num_hidden_layers": LAYERS, "vocab_size": V, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "max_position_embeddings": 256, "tie_word_embeddings": True}
TINY = {    # (config, d, heads, kv heads, head_dim, ffn); gemma3's d = 288 is 9 Q8_0 blocks but not a Q4_K super-block
    "llama": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
               "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu"},
              256, 4, 2, 64, 512),
    "qwen3": ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256,
               "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
               "hidden_act": "silu"}, 256, 4, 2, 64, 512),
    "gemma3": ({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 288,
                "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
                "query_pre_attn_scalar": 128, "sliding_window": 64, "rope_local_base_freq": 10000,
                "hidden_activation": "gelu_pytorch_tanh"}, 288, 2, 1, 128, 512),
}
ARCH = {"llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3"}
IDS = torch.tensor([1, 260, 72, 101, 262, 33, 0, 5])


def by_hand(family: str) -> dict[str, tuple[int, ...]]:
    """llama.cpp's tensor names and numpy shapes (out, in) of the tiny shape, from its config by hand."""
    _, d, h, kv, hd, f = TINY[family]
    out = {"token_embd.weight": (V, d), "output_norm.weight": (d,)}          # tied: no output.weight
    for i in range(LAYERS):
        b = f"blk.{i}."
        out |= {b + "attn_norm.weight": (d,), b + "attn_q.weight": (h * hd, d), b + "attn_k.weight": (kv * hd, d),
                b + "attn_v.weight": (kv * hd, d), b + "attn_output.weight": (d, h * hd), b + "ffn_norm.weight": (d,),
                b + "ffn_gate.weight": (f, d), b + "ffn_up.weight": (f, d), b + "ffn_down.weight": (d, f)}
        if family in ("qwen3", "gemma3"):
            out |= {b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)}
        if family == "gemma3":
            out |= {b + "post_attention_norm.weight": (d,), b + "post_ffw_norm.weight": (d,)}
    return out


def want_format(fmt: str, cols: int) -> str:
    # llama-quantize's Q4_K fallback for rows of columns that are not whole 256-value super-blocks is Q5_0
    return "Q5_0" if fmt == "Q4_K" and cols % 256 else fmt


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(tmp_path / "cache"))
    return tmp_path


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("family", list(TINY))
def test_a_tiny_shape_reads_back_as_declared_and_its_stored_load_matches_its_dequantised_load(cache, family, fmt):
    raw = {**COMMON, **TINY[family][0]}
    path = size_files.write_gguf(f"tiny-{family}", raw, fmt, cache)
    assert path.name == f"tiny-{family}.{fmt}.gguf"
    f = open_gguf(path)
    assert f.fields["general.architecture"].contents() == ARCH[family]
    assert f.fields[f"{ARCH[family]}.vocab_size"].contents() == V
    want = by_hand(family)
    got = {t.name: tuple(int(s) for s in reversed(t.shape)) for t in f.tensors}
    assert got == want
    types = {t.name: t.tensor_type.name for t in f.tensors}
    for name, dims in want.items():
        assert types[name] == ("F32" if len(dims) == 1 else want_format(fmt, dims[-1])), name
    if family == "gemma3" and fmt == "Q4_K":    # both the format and its fallback are in this file
        assert {"Q4_K", "Q5_0"} <= set(types.values())
    for t in f.tensors:                          # valid blocks: finite values, norms ones
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(values).all() and (len(t.shape) > 1 or (values == 1).all()), t.name

    stored, floats = load_model(path, quant="stored"), load_model(path)
    assert stored.config.vocab_size == V and stored.config.num_layers == LAYERS
    for lw in stored.weights.layers:
        assert all(isinstance(getattr(lw, s), QuantMatrix) for s in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert isinstance(stored.weights.embed, QuantMatrix) and stored.weights.notes == []
    by_format = {}
    for t in f.tensors:
        if t.tensor_type.name != "F32":
            by_format[t.tensor_type.name] = by_format.get(t.tensor_type.name, 0) + int(np.asarray(t.data).nbytes)
    assert {k: v for k, v in stored.weights.nbytes_by_dtype().items() if isinstance(k, str)} == by_format
    a, b = stored.logits(IDS), floats.logits(IDS)
    assert torch.isfinite(b).all()
    assert (a - b).abs().max().item() <= LOGITS_RTOL * b.abs().max().item()


def test_the_8b_file_is_the_writers_llama_shape_in_q4_k_with_blocks_of_the_stated_scales():
    from engine.bench import sizes
    assert size_files.file_name("llama-3.1-8b", "Q4_K") == "llama-3.1-8b.Q4_K.v2.gguf"
    raw = sizes.GGUF_SHAPES["llama-3.1-8b"]
    assert (raw["hidden_size"], raw["intermediate_size"], raw["num_hidden_layers"], raw["num_attention_heads"],
            raw["num_key_value_heads"], raw["vocab_size"]) == (4096, 14336, 32, 32, 8, 128256)
    values = gguf.quants.dequantize(size_files.blocks("Q4_K", (4, 512), np.random.default_rng(0)),
                                    gguf.GGMLQuantizationType.Q4_K)
    # |d * scale * q - dmin * min| with d = 0.001, dmin = 0.0005, 6-bit scales and mins, 4-bit q
    assert values.shape == (4, 512) and np.isfinite(values).all()
    assert np.abs(values).max() <= 0.001 * 63 * 15 + 0.0005 * 63


def test_a_family_the_writer_has_no_metadata_for_is_refused_by_name(cache):
    raw = {**COMMON, **TINY["llama"][0], "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}
    with pytest.raises(ValueError, match="gemma2"):
        size_files.write_gguf("tiny-gemma2", raw, "Q8_0", cache)
