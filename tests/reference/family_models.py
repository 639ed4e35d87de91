"""Tiny random-weight checkpoints of every family, made by transformers (test-only) from a config and saved as a
Hugging Face folder: the reference tests load the same folder into transformers and into the engine."""
from __future__ import annotations

import math
from pathlib import Path

import torch

BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
WINDOW = 8    # every windowed case: prompts are longer than this
CASES = {
    "llama3": dict(model_type="llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, tie_word_embeddings=True),
    "mistral-window": dict(model_type="mistral", sliding_window=WINDOW),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "gemma": dict(model_type="gemma", head_dim=24, tie_word_embeddings=True),
    "gemma2": dict(model_type="gemma2", head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0, tie_word_embeddings=True),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=16, sliding_window=WINDOW,
                        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                        query_pre_attn_scalar=16, tie_word_embeddings=True),
    "phi3": dict(model_type="phi3", partial_rotary_factor=0.5),
    "phi3-longrope": dict(model_type="phi3", partial_rotary_factor=0.75, original_max_position_embeddings=32,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.75,
                                           "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                           "long_factor": [2.0 + 0.5 * i for i in range(6)]}),
    "olmo2": dict(model_type="olmo2"),
    "granite": dict(model_type="granite", embedding_multiplier=3.0, residual_multiplier=0.6,
                    attention_multiplier=0.2, logits_scaling=2.5),
    "smollm3": dict(model_type="smollm3", no_rope_layers=[1, 0, 1, 0], tie_word_embeddings=True),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[2]),
    # classic shapes: multi-head attention (None drops a BASE key their configs do not have)
    "gpt2": dict(model_type="gpt2", n_inner=96, intermediate_size=None, num_key_value_heads=None,
                 tie_word_embeddings=True),
    # every width odd, as GPT-2's vocabulary of 50,257 is: the vocabulary (49,157: 5 columns past the last sixteen),
    # the stream (60: 4 rows past the blocks of eight), q/k/v's 180 and the MLP's 90 (the engine's configs hold every
    # head_dim even: RoPE's pairs)
    "gpt2-odd": dict(model_type="gpt2", vocab_size=49157, hidden_size=60, num_attention_heads=6, n_inner=90,
                     intermediate_size=None,
                     num_key_value_heads=None, tie_word_embeddings=True),
    # StableLM's defaults (partial_rotary_factor 0.25, no q/k/v bias) and stablelm-2-1.6b's biases
    "stablelm": dict(model_type="stablelm", num_key_value_heads=4),
    "stablelm-qkv-bias": dict(model_type="stablelm", use_qkv_bias=True, partial_rotary_factor=0.5),
    # Phi's defaults: one norm for a parallel block, partial_rotary_factor 0.5, biases everywhere, the head's too
    "phi": dict(model_type="phi", num_key_value_heads=None, intermediate_size=96),
    # StarCoder 2: biases everywhere (use_bias), a window on every layer, the head tied; and use_bias off, untied
    "starcoder2": dict(model_type="starcoder2", sliding_window=WINDOW, tie_word_embeddings=True),
    "starcoder2-no-bias": dict(model_type="starcoder2", use_bias=False),
    # Cohere: Command R's logit_scale 0.0625 and tied head; Command R+'s 0.8333, here with attention biases, untied
    "cohere": dict(model_type="cohere", tie_word_embeddings=True),
    "cohere-bias": dict(model_type="cohere", logit_scale=0.8333, attention_bias=True),
    "gpt_neox": dict(model_type="gpt_neox", num_key_value_heads=None, rotary_pct=0.25, use_parallel_residual=True),
    "gpt_neox-sequential": dict(model_type="gpt_neox", num_key_value_heads=None, rotary_pct=1.0,
                                use_parallel_residual=False),
}
# the token (and position) embeddings of each family's checkpoint
EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "wpe.weight", "embed_in.weight")


def scaled_(model, seed: int) -> None:
    """Weights large enough that every variation moves the logits (transformers' init is std 0.02, under which
    attention is near uniform): matrices ~ 1/sqrt(fan-in), embeddings ~ 1, norms ~ 1 (Gemma's stored offsets ~ 0)."""
    g = torch.Generator().manual_seed(seed)
    gemma = model.config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:      # norms (and biases)
                base = 0.0 if gemma or name.endswith("bias") else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(EMBEDDINGS):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def build(name: str, out: Path, tokenizer_files: Path) -> Path:
    """CASES[name] saved to `out` by transformers (with the bundled tokenizer's files)."""
    import transformers
    kw = {k: v for k, v in dict(BASE, **CASES[name]).items() if v is not None}
    model_type = kw.pop("model_type")
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    scaled_(model, seed=sum(map(ord, name)))
    model.save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((tokenizer_files / f).read_bytes())
    return out
