"""bench --sizes (engine.bench.sizes) on a small shape of its own: the folder it writes is the config's every tensor
(loaded strictly), each dtype's process reports the weights' bytes of that dtype counted by hand and held ratios
within the issue's bound, a decode path and speed over a floor, and the peer's speed (the GGUF writer's own tests:
tests/unit/test_bench_size_files.py)."""
from __future__ import annotations

import pytest

from engine.bench import sizes

pytestmark = pytest.mark.model

SMALL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "intermediate_size": 1536,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 49152,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": True,
         "hidden_act": "silu"}
PARAMS = 49152 * 512 + 512 + 4 * (2 * 512 + 512 * (512 + 2 * 128) + 512 * 512 + 3 * 512 * 1536)


def test_each_dtype_reports_what_it_holds_and_how_fast_it_decodes(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(tmp_path))
    out = sizes.sizes_bench(("small",), shapes={"small": SMALL}, say=lambda *_: None)
    assert set(out) == {"small float32", "small bfloat16"}
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        r = out[f"small {dtype}"]
        assert r["weights_bytes_by_dtype"] == {dtype: size * PARAMS}, r
        # the weights are held, and a first decode adds no second copy of them (a 80-160 MB model's figures also carry
        # fixed costs, ~50 MB: the tokenizer, RoPE tables, the runtime's first-use buffers, which a model of the
        # public sizes makes small: the bench reports those)
        assert 0.95 <= r["held_after_load_over_weights"], r
        assert r["held_after_decode_over_weights"] - r["held_after_load_over_weights"] < 0.5, r
        assert r["decode_tok_s"] > 0 and r["floor_tok_s"] > 0 and r["decode_path"]
        assert r["peer_decode_tok_s"] > 0 and r["over_peer_decode"] > 0 and r["inspected_over_plain_decode"] > 0, r
        assert sizes.line(f"small {dtype}", r).startswith(f"small {dtype}")
    assert out["small float32"]["decode_path"] == "native" or "native" in out["small float32"]["decode_path"]

