"""The native decode step's allow-list (engine.native.step): what decode.c computes, read from the family's
declaration, and what decode_rows.c computes (Llama's block on float matrices).

A model takes it only when everything it computes is on the allow-list of what decode.c implements (`refusal`), read
from its family's declaration (engine.family.declared; DECLARED: RMSNorm or LayerNorm, a gated or plain MLP, SiLU,
GELU-tanh or exact-erf GELU, RoPE (half-split or interleaved) or learned positions, a sequential or parallel block,
q/k norms per head or over the projection, Mixtral's or Qwen3-MoE's experts) -- Llama's block and the variations
decode.c computes at any value the config gives: Qwen2's q/k/v biases, Qwen3's per-head q/k norms, Gemma's GELU-tanh
and scaled embeddings, Granite's multipliers, SmolLM3's layers without RoPE, sliding windows (Mistral's, Gemma
2/3's, StarCoder 2's local layers: the KV cache's ring of each window layer, engine.kv_cache), Gemma 2's post-norms,
soft caps and query scale, Gemma 3's local RoPE table, Phi-3's rotary fraction and longrope, OLMo 2's post-norms
only and q/k norms over the whole projection, the LayerNorms (with biases or, Cohere's, without) of GPT-2, GPT-NeoX,
Phi, StableLM, StarCoder 2 and Cohere, their plain MLPs with biases, attention output biases, Phi's head bias, the
parallel blocks of GPT-NeoX (two norms), Phi and Cohere (one), GPT-2's learned positions (added here, in Python, to
the token's row) and Cohere's interleaved RoPE and logit scale, and Mixtral's and Qwen3-MoE's experts (the router's
top k, renormalised where the family does, and only the chosen experts' matrices read; Qwen3-MoE's dense layers
beside them), at any matrix shape. No precision plan, every weight contiguous in the model's dtype, on the CPU in float32, bfloat16 or
float16 (the kernels round each stage to that dtype where the PyTorch forward holds a tensor of it and sum in
float32: llama_ops.h), or, in a float32 model, a GGUF matrix kept in its blocks (engine.quant_matrix.QuantMatrix,
any format engine.native.quant.TYPES names): decode.c multiplies the file's bytes by quant_ops.h's row dot product,
the one the PyTorch forward's product of one token sums with. The batched step (decode_rows.c) computes Llama's
block on float matrices only: for a model with quantised weights or any of those variations `rows_refusal` says so
and serve_rows leaves the batch to the PyTorch forward.
"""
from __future__ import annotations

import torch

from engine.family.slots import MATRICES as SLOT_MATRICES
from engine.native.quant import TYPES as QUANT_TYPES

# What decode.c computes, read from the family's declaration (engine.family.declared.Family): each declared field at
# the values decode.c implements, else the feature named in the refusal. Anything else decodes on the PyTorch forward
# (a debugger never computes another model).
DECLARED = {"norm": (("rms", "layer"), "another norm"), "mlp": (("gated", "plain"), "another MLP"),
            "positions": (("rope", "rope_interleaved", "learned"), "other positions"),
            "parallel_residual": ((False, True), "another residual block"),
            "experts": ((None, "mixtral", "qwen3_moe"), "other experts"),
            "qk_norm": ((None, "head", "whole"), "other q/k norms"),
            "activation": (("silu", "gelu_tanh", "gelu"), "another activation")}
# The element types decode.c reads and writes (llama_ops.h's T_F32, T_BF16, T_F16): the weights' and activations'
# (the model's dtype), and the KV cache's.
TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# the matrices every layer has, and its MLP's: a dense one's (its first product: a gated MLP's w_gate_up or a plain
# one's w_up, which decode.c reads as Step.wgu; then w_down), or a mixture of experts' (Step.router, egu, edown), one
# or the other at each layer (Qwen3-MoE's mlp_only_layers are dense)
LAYER_SLOTS = ("wqkv", "wo")
MLP_IN = ("w_gate_up", "w_up")
DENSE_MLPS = tuple((f, "w_down") for f in MLP_IN)
EXPERT_SLOTS = ("router", "experts_gate_up", "experts_down")
# the vectors a layer may have, every layer alike (NULL in decode.c where the block has none: the step skipped):
# Llama's pre-norms (OLMo 2 has neither), Qwen2's biases, Qwen3's and OLMo 2's q/k norms, the post-norms, the
# LayerNorms' biases, GPT-2's output and MLP biases
VECTOR_SLOTS = ("attn_norm", "mlp_norm", "bqkv", "q_norm", "k_norm", "attn_post_norm", "mlp_post_norm",
                "attn_norm_bias", "mlp_norm_bias", "bo", "b_up", "b_down")
# decode.c's Step field of each vector slot
VECTOR_FIELDS = {"attn_norm_bias": "attn_norm_b", "mlp_norm_bias": "mlp_norm_b", "b_up": "bup", "b_down": "bdown"}
ROPE_KINDS = {None: 0, "main": 1, "local": 2}     # decode.c's Step.rope_on: a layer's table
MATRICES = tuple(f for f in SLOT_MATRICES if f in LAYER_SLOTS + MLP_IN + ("w_down",))   # the products it streams
ROWS_VECTORS = ("attn_norm", "mlp_norm")      # the vectors of Llama's block, all decode_rows.c reads
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}       # decode.c's Step.act


def _declared(fam) -> str | None:
    """The first feature of the family's declared block that decode.c does not compute (the other declared
    variations it computes at any value the config gives: multipliers, soft caps, query scale, windows, local RoPE,
    rotary fraction, no-RoPE layers, embedding scale, norm offset, post-norms, logit scale)."""
    for key, (values, feature) in DECLARED.items():
        if getattr(fam, key) not in values:
            return f"{feature} ({key}={getattr(fam, key)!r})"
    return None


def refusal(model) -> str | None:
    """Why this model cannot take the native step (None: it can): the first thing off the allow-list."""
    cfg, w = model.config, model.weights
    kept = [t for t in w.all() if kept_in_blocks(t)]
    other = sorted({t.format for t in kept} - set(QUANT_TYPES))
    if other:
        return f"weights kept quantized in {', '.join(other)} (decode.c decodes {', '.join(QUANT_TYPES)})"
    if kept and model.dtype != torch.float32:
        # QuantMatrix.matmul sums in float32 and returns x's dtype: decode.c's quantised products are float32's
        return f"weights kept quantized in a {model.dtype} model (decode.c multiplies GGUF blocks in float32 only)"
    why = _declared(cfg.family)
    if why is not None:
        return why
    known = LAYER_SLOTS + MLP_IN + ("w_down",) + EXPERT_SLOTS + VECTOR_SLOTS
    beyond = sorted({f for lw in w.layers for f in lw.present()} - set(known))
    if beyond or not _layers_alike(w.layers):
        return f"layer weights other than {', '.join(known)} ({', '.join(beyond) or 'missing'})"
    if model.device.type != "cpu" or model.dtype not in TYPES or model.cache_dtype not in TYPES \
            or model.fp32_units or model.resid_fp32_from is not None:
        return "not float32, bfloat16 or float16 on the CPU, or a precision plan"
    # a matrix kept in its blocks is whole blocks by construction (QuantMatrix): the rules below are the float kernel's
    mats = [t for t in [getattr(lw, f) for lw in w.layers for f in LAYER_SLOTS + MLP_IN + ("w_down",)]
            if t is not None and not kept_in_blocks(t)]
    # experts' stacks kept in their blocks (engine.quant_experts) are multiplied by the kept matrices' kernels, expert
    # by expert; the router is read as a float (d, E) matrix
    experts = [t for lw in w.layers for t in (getattr(lw, f) for f in EXPERT_SLOTS) if t is not None
               and not kept_in_blocks(t)]
    if any(lw.router is not None and kept_in_blocks(lw.router) for lw in w.layers) or cfg.experts_per_token > 64:
        return "a router kept quantized, or more than 64 experts chosen a token (decode.c routes up to 64 experts)"
    vectors = [t for lw in w.layers for t in (getattr(lw, f) for f in VECTOR_SLOTS) if t is not None]
    vectors += [t for t in (w.norm_bias, w.head_bias, w.pos_embed) if t is not None]
    head = [] if kept_in_blocks(w.lm_head) else [w.lm_head]
    # any shape: row_product.h sums a matrix's rows past its blocks of eight, and its columns past the vectors', in
    # the order the batched rows' product sums them (GPT-2's vocabulary of 50,257, an MLP of any width)
    if any(t.dtype != model.dtype or not t.is_contiguous() for t in [*mats, *experts, *vectors, w.norm, *head]):
        return f"weights that are not contiguous {model.dtype} tensors"
    if cfg.rotary_dim % 2:
        return f"an odd rotary dimension ({cfg.rotary_dim}: decode.c rotates pairs)"
    if cfg.num_heads % cfg.num_kv_heads:
        return (f"{cfg.num_heads} query heads, not a multiple of the {cfg.num_kv_heads} KV heads (decode.c shares each "
                f"KV head among a whole group)")
    return None


def _layers_alike(layers) -> bool:
    """Whether every layer has q/k/v and o, one MLP (a dense one, gated or plain, the same kind at every dense layer,
    or experts), and the same vectors as the first."""
    mlps = [set(m) for m in (*DENSE_MLPS, EXPERT_SLOTS)]
    mlp_slots = set.union(*mlps)
    first = set(layers[0].present()) - mlp_slots
    dense_kinds = {f for lw in layers for f in MLP_IN if getattr(lw, f) is not None}
    return len(dense_kinds) <= 1 and all(
        not set(LAYER_SLOTS) - set(lw.present()) and sum(m <= set(lw.present()) for m in mlps) == 1
        and set(lw.present()) - mlp_slots == first for lw in layers)


def rows_refusal(model) -> str:
    """Why the batched step (decode_rows.c, Llama's block on float matrices) cannot run this model's rows ("": it
    can): a variation only the lone step computes, or weights kept quantized."""
    cfg, lw, kept = model.config, model.weights.layers[0], model.weights.quantized()
    if kept:
        return f"weights kept quantized ({len(kept)} GGUF matrices, e.g. {kept[0]})"
    fam, w = cfg.family, model.weights
    beyond = [f"{f} weights" for f in VECTOR_SLOTS if getattr(lw, f) is not None and f not in ROWS_VECTORS]
    beyond += [f"no {f}" for f in ROWS_VECTORS if getattr(lw, f) is None]
    beyond += [f"{k}={getattr(fam, k)!r}" for k, v in (("norm", "rms"), ("mlp", "gated"), ("positions", "rope"),
                                                       ("parallel_residual", False), ("experts", None))
               if getattr(fam, k) != v]
    beyond += [f"{f}" for f in ("head_bias", "pos_embed", "norm_bias") if getattr(w, f) is not None]
    beyond += [f"{k}={getattr(cfg, k)}" for k in ("embed_scale", "residual_scale", "logits_divisor")
               if getattr(cfg, k) != 1.0]
    beyond += [f"activation={cfg.activation}"] if cfg.activation != "silu" else []
    beyond += [f"attn_scale={cfg.attn_scale:g}"] if cfg.attn_scale != cfg.head_dim ** -0.5 else []
    beyond += ["soft caps"] if cfg.attn_softcap is not None or cfg.final_softcap is not None else []
    beyond += ["RoPE other than one full table"] if set(cfg.layer_rope) != {"main"} or cfg.rotary_dim != cfg.head_dim \
        or cfg.rope_scaling.rope_type == "longrope" else []
    beyond += ["sliding windows"] if cfg.windowed else []
    return f"a block beyond Llama's, which decode_rows.c computes ({', '.join(beyond)})" if beyond else ""


def kept_in_blocks(t) -> bool:
    """Whether a weight is a matrix kept in GGUF blocks (engine.quant_matrix.QuantMatrix: its `format` and its
    `blocks`). Recognised by those attributes, not imported: engine.quant_matrix multiplies through
    engine.accelerator, which imports this module (tests/unit/test_layout.py forbids the circle)."""
    return isinstance(getattr(t, "format", None), str) and isinstance(getattr(t, "blocks", None), torch.Tensor)
