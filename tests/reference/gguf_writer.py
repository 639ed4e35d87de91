"""Test-only: write a Hugging Face folder (config.json, model.safetensors) as a GGUF file the way llama.cpp's
convert_hf_to_gguf.py does for its family, with the gguf package: its metadata keys, its tensor names, q/k rows
permuted by its LlamaModel, Gemma's norms stored as 1 + w, experts stacked into one tensor per slot, llama3's rope
factors as rope_freqs.weight and phi3 longrope's as rope_factors_long/short, all in float32; the classic families'
converters as tests/reference/gguf_classic.py says, each tensor name one llama.cpp lists for the architecture
(gguf.constants.MODEL_TENSORS)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from engine.family import FAMILIES
from tests.reference.gguf_classic import CLASSIC_ARCHS, classic_metadata, classic_tensor

TOKENIZER_KEYS = ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id")


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: rows of each head from halves to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope(cfg: dict) -> dict:
    params = cfg.get("rope_parameters") or {}
    params = params.get("full_attention", params)
    return {**params, **(cfg.get("rope_scaling") or {})} | {"rope_theta": params.get("rope_theta",
                                                                                  cfg.get("rope_theta", 10000.0))}


def metadata(w, cfg: dict, arch: str, fam) -> None:
    """The keys the converter writes: TextModel's, then the family's own."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    rope = _rope(cfg)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    head_dim = cfg.get("head_dim") if fam.model_type != "granite" else None   # GraniteModel pops head_dim
    if head_dim and fam.model_type != "phi3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if fam.gguf_permutes_qk:      # LlamaModel
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim or hidden // heads)
    if fam.model_type == "phi3":
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
                                       * hidden) // heads)
        w.add_rope_scaling_orig_ctx_len(cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
        w.add_sliding_window(cfg.get("sliding_window") or 0)
    if fam.model_type in ("gemma2", "gemma3_text"):     # GemmaModel (v1) writes no window
        w.add_sliding_window(cfg["sliding_window"])
    if fam.model_type == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if fam.model_type == "granite":
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    if fam.experts:
        w.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if fam.experts == "qwen3_moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])


def rope_tensors(cfg: dict, fam) -> dict[str, np.ndarray]:
    """llama3's rope_freqs.weight (LlamaModel.generate_extra_tensors) and phi3 longrope's factor tensors."""
    rope = _rope(cfg)
    kind = rope.get("rope_type", "default")
    if kind == "longrope":
        return {"rope_factors_long.weight": np.asarray(rope["long_factor"], np.float32),
                "rope_factors_short.weight": np.asarray(rope["short_factor"], np.float32)}
    if kind != "llama3":
        return {}
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return {"rope_freqs.weight": np.asarray(torch.tensor(out, dtype=torch.float32))}


def _globals(ck) -> dict[str, str]:
    """The checkpoint's tensors outside the layers -> llama.cpp's names (token_embd, position_embd, output_norm,
    output)."""
    out = {ck.embed: "token_embd.weight", ck.norm: "output_norm.weight", ck.lm_head: "output.weight"}
    for hf, g in ((ck.norm_bias, "output_norm.bias"), (ck.lm_head_bias, "output.bias"),
                  (ck.pos_embed, "position_embd.weight")):
        if hf:
            out[hf] = g
    return out


def gguf_tensors(folder: Path, cfg: dict, fam) -> dict[str, np.ndarray]:
    """The folder's tensors under llama.cpp's names, transformed as its converter does."""
    hf = {k: v.float().numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}
    top = _globals(fam.checkpoint)
    out = {top[k]: v for k, v in hf.items() if k in top}
    if fam.gguf_arch == "gpt2" and "output.weight" not in out:     # GPT2Model writes the tied head out
        out["output.weight"] = out["token_embd.weight"].copy()
    heads = cfg.get("num_attention_heads") or cfg["n_head"]
    kv = cfg.get("num_key_value_heads") or heads
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    copies = int(fam.gguf_arch == "gpt2" and "output.weight" not in {top.get(k) for k in hf})
    for i in range(cfg.get("num_hidden_layers") or cfg["n_layer"]):
        for parts in (*fam.parts.values(), *fam.moe_parts.values()):
            for name, _, g in parts:
                full = fam.checkpoint.layer.format(i=i) + name
                if "{e}" in name and full.format(e=0) in hf:
                    out[f"blk.{i}.{g}"] = np.stack([hf[full.format(e=e)] for e in range(experts)])
                elif full in hf:
                    out[f"blk.{i}.{g}"] = hf[full]
                    if fam.gguf_arch in CLASSIC_ARCHS:
                        out[f"blk.{i}.{g}"] = classic_tensor(g, name, hf[full], cfg, fam.gguf_arch)
    assert len(hf) + copies == sum(1 if a.ndim < 3 else len(a) for a in out.values()), "a tensor has no GGUF name"
    for name, a in out.items():
        if fam.gguf_permutes_qk and ("attn_q." in name or "attn_k." in name):
            out[name] = permute(a, heads if "attn_q." in name else kv)
        if fam.norm_offset and name.endswith("norm.weight"):     # Gemma2Model / Gemma3Model: data + 1
            out[name] = a + np.float32(fam.norm_offset)
    return out | rope_tensors(cfg, fam)


def write_gguf(folder: Path, path: Path, tokenizer_reader, kv: dict | None = None, quant: str | None = None) -> Path:
    """folder (a transformers checkpoint) as llama.cpp's converter would write it; the tokenizer's fields copied
    from tokenizer_reader (a GGUFReader); kv: extra metadata, {key: value}, to write besides. quant: a type
    gguf.quants.quantize writes (Q8_0, Q4_0, ...) for every 2-D matrix (and stack of experts) whose rows are whole blocks, as
    llama-quantize leaves norms and vectors in float32; None: every tensor float32."""
    import gguf
    cfg = json.loads((folder / "config.json").read_text())
    fam = FAMILIES[cfg["model_type"]]
    arch = fam.gguf_arch
    w = gguf.GGUFWriter(str(path), arch)
    if arch in CLASSIC_ARCHS:
        classic_metadata(w, cfg, arch)
    else:
        metadata(w, cfg, arch, fam)
    for key in TOKENIZER_KEYS:
        value = tokenizer_reader.fields[f"tokenizer.ggml.{key}"].contents()
        {"model": w.add_tokenizer_model, "pre": w.add_tokenizer_pre, "tokens": w.add_token_list,
         "token_type": w.add_token_types, "merges": w.add_token_merges, "bos_token_id": w.add_bos_token_id,
         "eos_token_id": w.add_eos_token_id}[key](value)
    for key, value in (kv or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32)(key, value)
    known = _llama_cpp_names(arch)
    for name, a in gguf_tensors(folder, cfg, fam).items():
        assert arch not in CLASSIC_ARCHS or name.rsplit(".", 1)[0] in known, f"llama.cpp's {arch} has no {name}"
        a = np.ascontiguousarray(a, dtype=np.float32)
        qt = quant and gguf.GGMLQuantizationType[quant]
        if qt and a.ndim in (2, 3) and a.shape[-1] % gguf.GGML_QUANT_SIZES[qt][0] == 0:     # 3: stacked experts
            w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama_cpp_names(arch: str) -> set[str]:
    """The tensor names (without .weight / .bias) llama.cpp lists for an architecture, blocks 0 to 63."""
    from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES
    which = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch)
    return {TENSOR_NAMES[t].format(bid=b) for t in MODEL_TENSORS[which] for b in range(64)}
