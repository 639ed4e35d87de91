"""Test-only: what llama.cpp's convert_hf_to_gguf.py writes for the classic families (GPT2Model, GPTNeoXModel,
Phi2Model, StableLMModel, StarCoder2Model, CommandR2Model): their metadata keys (each converter's own
set_gguf_parameters, most of them without TextModel's), and how each changes a tensor on the way (GPT-2's Conv1D
matrices transposed to (out, in), GPT-NeoX's per-head query_key_value regrouped to q | k | v, GPT-2's tied head
written out as a copy of the embedding)."""
from __future__ import annotations

import numpy as np

CLASSIC_ARCHS = ("gpt2", "gptneox", "phi2", "stablelm", "starcoder2", "command-r")


def _rotary_dims(cfg: dict, head_dim: int) -> int:
    params = cfg.get("rope_parameters") or {}
    return int(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) * head_dim)


def classic_metadata(w, cfg: dict, arch: str) -> None:
    """The keys each converter writes, as its set_gguf_parameters does."""
    hidden, heads, layers = (cfg.get(k) or cfg.get(alt) for k, alt in (("hidden_size", "n_embd"),
                                                                        ("num_attention_heads", "n_head"),
                                                                        ("num_hidden_layers", "n_layer")))
    w.add_block_count(layers)
    w.add_context_length(cfg.get("max_position_embeddings") or cfg["n_positions"])
    w.add_embedding_length(hidden)
    w.add_head_count(heads)
    if arch == "gpt2":          # 4 x n_embd, whatever n_inner says
        w.add_feed_forward_length(4 * hidden)
        w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
        return
    if arch == "phi2":          # 4 x n_embd; multi-head; the rotary part of a head from partial_rotary_factor
        w.add_feed_forward_length(4 * hidden)
        w.add_head_count_kv(heads)
        w.add_layer_norm_eps(cfg["layer_norm_eps"])
        w.add_rope_dimension_count(_rotary_dims(cfg, hidden // heads))
        return
    w.add_feed_forward_length(cfg["intermediate_size"])
    if arch in ("gptneox", "stablelm"):
        w.add_rope_dimension_count(_rotary_dims(cfg, hidden // heads))
        if arch == "stablelm":
            w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_parallel_residual(cfg.get("use_parallel_residual", True))
        w.add_layer_norm_eps(cfg["layer_norm_eps"])
        return
    # StarCoder2Model and CommandR2Model: TextModel's keys (no sliding window: llama.cpp's starcoder2 computes none)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_eps(cfg.get("norm_epsilon") or cfg["layer_norm_eps"])
    if arch == "command-r":
        w.add_logit_scale(cfg["logit_scale"])
        import gguf
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)


def classic_tensor(gguf_name: str, hf_name: str, a: np.ndarray, cfg: dict, arch: str) -> np.ndarray:
    """A tensor as the converter changes it."""
    if arch == "gpt2" and hf_name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
        return a.T              # Conv1D (in, out) -> (out, in)
    if arch == "gptneox" and gguf_name.endswith(("attn_qkv.weight", "attn_qkv.bias")):
        heads = cfg["num_attention_heads"]          # (H, 3, hd, ...) -> q | k | v
        per = a.reshape(heads, 3, a.shape[0] // heads // 3, *a.shape[1:])
        return np.concatenate([per[:, j].reshape(-1, *a.shape[1:]) for j in range(3)])
    return a
