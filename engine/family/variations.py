"""A family's block variations read from config.json: each declared variation reads its keys; a key that would
change the computation on a family that does not declare it is refused, naming the key (never loaded and silently
computed differently)."""
from __future__ import annotations

import math

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.family.declared import Family

ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def positive(v, name: str, where: str) -> float:
    """A JSON number that must be finite and > 0 (rope theta and factors: 0 or NaN would make every angle NaN)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ModelLoadError(f"{where}: {name}={v!r} must be a finite number > 0")
    return float(v)


def flag(raw: dict, key: str, where: str) -> bool:
    """A JSON boolean; the string "false" is refused rather than read as True."""
    v = raw.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ModelLoadError(f"{where}: {key} must be true or false, got {v!r}")
    return v


def _refuse(where: str, key: str, value, fam: Family, why: str) -> None:
    raise UnsupportedModelError(f"{where}: unsupported {key}={value!r} for model_type={fam.model_type!r} ({why})")


def activation(fam: Family, raw: dict, where: str) -> str:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    want = {"silu": ("silu",), "gelu": ("gelu",),
            "gelu_tanh": ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")}[fam.activation]   # gelu_new: GPT-2's tanh
    if act not in want:
        key = "hidden_activation" if raw.get("hidden_activation") else "hidden_act"
        _refuse(where, key, act, fam, f"this family's MLP is implemented with {' / '.join(want)}")
    return fam.activation


def canonical(fam: Family, raw: dict, where: str) -> dict:
    """config.json in the engine's key names: the family's own names (GPT-2's n_embd, ...) renamed, a null dropped
    (GPT-2's n_inner: null = 4 x n_embd), and a key spelled both ways refused."""
    out = dict(raw)
    for theirs, ours in fam.config_keys.items():
        if theirs not in out:
            continue
        v = out.pop(theirs)
        if v is None:
            continue
        if ours in raw and raw[ours] != v:
            raise ModelLoadError(f"{where}: {theirs}={v!r} and {ours}={raw[ours]!r} disagree")
        out[ours] = v
    if fam.model_type == "gpt2" and "intermediate_size" not in out and isinstance(out.get("hidden_size"), int):
        out["intermediate_size"] = 4 * out["hidden_size"]
    for key, value in fam.fixed.items():
        if out.get(key, value) != value:
            _refuse(where, key, out[key], fam, f"{fam.model_type} is implemented with {key}={value}")
    out.setdefault("tie_word_embeddings", fam.tie_default)
    out.setdefault("attention_bias", fam.bias_default)
    return out


def parallel_residual(fam: Family, raw: dict, where: str) -> bool:
    """Whether attention and the MLP both read the block's input (GPT-NeoX's use_parallel_residual)."""
    if not fam.parallel_residual:
        if flag(raw, "use_parallel_residual", where):
            _refuse(where, "use_parallel_residual", True, fam, "a parallel residual is declared for gpt_neox and phi")
        return False
    return flag(raw, "use_parallel_residual", where) if "use_parallel_residual" in raw else True


def scales(fam: Family, raw: dict, where: str, hidden: int, head_dim: int) -> dict:
    """Embedding, residual, query and logit scales, and soft caps."""
    out = {"embed_scale": 1.0, "residual_scale": 1.0, "attn_scale": head_dim ** -0.5, "logits_divisor": 1.0,
           "attn_softcap": None, "final_softcap": None}
    if fam.embed_scale == "sqrt_d":
        out["embed_scale"] = hidden ** 0.5
    multipliers = {"embedding_multiplier": "embed_scale", "residual_multiplier": "residual_scale",
                   "attention_multiplier": "attn_scale", "logits_scaling": "logits_divisor"}
    for key, slot in multipliers.items():
        v = raw.get(key)
        if v is None:
            continue
        if not fam.multipliers:
            if v != 1:
                _refuse(where, key, v, fam, "multipliers are Granite's")
            continue
        out[slot] = positive(v, key, where)
    v = raw.get("logit_scale")
    if v is not None and (fam.logit_scale or v != 1):
        if not fam.logit_scale:
            _refuse(where, "logit_scale", v, fam, "a logit scale is Cohere's")
        out["logits_divisor"] = 1.0 / positive(v, "logit_scale", where)   # logits x scale, as logits / (1 / scale)
    if raw.get("query_pre_attn_scalar") is not None:
        if not fam.query_scale:
            _refuse(where, "query_pre_attn_scalar", raw["query_pre_attn_scalar"], fam, "a query scale is Gemma's")
        out["attn_scale"] = positive(raw["query_pre_attn_scalar"], "query_pre_attn_scalar", where) ** -0.5
    for key, slot in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap")):
        v = raw.get(key)
        if v is None:
            continue
        if not fam.softcaps:
            _refuse(where, key, v, fam, "soft-capping is Gemma's")
        out[slot] = positive(v, key, where)
    return out


def windows(fam: Family, raw: dict, where: str, layers: int, max_pos: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: global attention)."""
    w = raw.get("sliding_window")
    types = raw.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != layers
                              or any(t not in ("full_attention", "sliding_attention") for t in types)):
        raise UnsupportedModelError(f"{where}: layer_types must list 'full_attention' or 'sliding_attention' for "
                                    f"each of the {layers} layers, got {str(types)[:80]}")
    if flag(raw, "use_bidirectional_attention", where):
        _refuse(where, "use_bidirectional_attention", True, fam, "this engine serves causal attention only")
    if fam.windows is None:
        if flag(raw, "use_sliding_window", where):
            _refuse(where, "use_sliding_window", True, fam, "sliding windows are not declared for this family")
        if w is not None and fam.model_type not in ("qwen2", "qwen3", "qwen3_moe", "smollm3"):
            _refuse(where, "sliding_window", w, fam, "sliding windows are not declared for this family")
        if types and "sliding_attention" in types:
            _refuse(where, "layer_types", "sliding_attention", fam, "sliding windows are not declared for this family")
        return (None,) * layers
    if w is None:
        return (None,) * layers
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ModelLoadError(f"{where}: sliding_window={w!r} must be a whole number >= 1")
    if fam.windows == "all":
        sliding = [True] * layers
    elif types is not None:
        sliding = [t == "sliding_attention" for t in types]
    elif fam.local_rope:      # Gemma 3 before layer_types: every sliding_window_pattern-th layer is global
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        sliding = [bool((i + 1) % pattern) for i in range(layers)]
    else:                     # Gemma 2 before layer_types: even layers slide
        sliding = [bool((i + 1) % 2) for i in range(layers)]
    # a window at least the context long is global attention (the same numbers, no ring)
    return tuple(w if s and w < max_pos else None for s in sliding)


def rope_layers(fam: Family, raw: dict, where: str, layer_window: tuple) -> tuple[str | None, ...]:
    """Each layer's rotary table: "main", "local" (Gemma 3's sliding layers) or None (no RoPE)."""
    layers = len(layer_window)
    kinds = ["local" if fam.local_rope and layer_window[i] is not None else "main" for i in range(layers)]
    if fam.local_rope and raw.get("sliding_window") is not None:
        # the layer type decides the table even where a window is as long as the context
        types = raw.get("layer_types")
        if types is not None:
            kinds = ["local" if t == "sliding_attention" else "main" for t in types]
    nope = raw.get("no_rope_layers")
    if nope is not None:
        if not isinstance(nope, list) or len(nope) != layers or any(v not in (0, 1) for v in nope):
            raise ModelLoadError(f"{where}: no_rope_layers must list 0 or 1 for each of the {layers} layers")
        if 0 in nope and not fam.no_rope_layers:
            _refuse(where, "no_rope_layers", nope, fam, "layers without RoPE are SmolLM3's")
        kinds = [k if use else None for k, use in zip(kinds, nope)]
    return tuple(kinds)


def experts(fam: Family, raw: dict, where: str, layers: int) -> dict:
    n = raw.get("num_local_experts") or raw.get("num_experts") or 0
    if fam.experts is None:
        if n:
            _refuse(where, "num_local_experts" if raw.get("num_local_experts") else "num_experts", n, fam,
                    "mixtures of experts are declared for mixtral and qwen3_moe")
        return {"num_experts": 0, "experts_per_token": 0, "moe_intermediate_size": 0, "norm_topk_prob": False,
                "layer_moe": (False,) * layers}
    k = raw.get("num_experts_per_tok")
    for key, v, most in (("num_experts", n, 4096), ("num_experts_per_tok", k, n)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= max(most, 1):
            raise ModelLoadError(f"{where}: {key}={v!r} must be a whole number in [1, {most}]")
    if fam.experts == "mixtral":
        fe, renorm, moe = raw["intermediate_size"], True, [True] * layers
    else:
        fe = raw.get("moe_intermediate_size")
        if isinstance(fe, bool) or not isinstance(fe, int) or not 1 <= fe <= 1 << 20:
            raise ModelLoadError(f"{where}: moe_intermediate_size={fe!r} must be a whole number in [1, 1,048,576]")
        renorm = flag(raw, "norm_topk_prob", where)
        step = raw.get("decoder_sparse_step", 1)
        only = raw.get("mlp_only_layers") or []
        if isinstance(step, bool) or not isinstance(step, int) or step < 1 or not isinstance(only, list):
            raise ModelLoadError(f"{where}: decoder_sparse_step must be >= 1 and mlp_only_layers a list")
        moe = [i not in only and (i + 1) % step == 0 for i in range(layers)]
    return {"num_experts": n, "experts_per_token": k, "moe_intermediate_size": fe, "norm_topk_prob": renorm,
            "layer_moe": tuple(moe)}


def rotary_fraction(fam: Family, raw: dict, rope_params: dict, where: str) -> float:
    v = rope_params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if v is None or v == 1:
        return 1.0
    if not fam.rotary_fraction:
        _refuse(where, "partial_rotary_factor", v, fam,
                "a rotary fraction is declared for phi3, phi, gpt_neox and stablelm")
    v = positive(v, "partial_rotary_factor", where)
    if v > 1:
        raise ModelLoadError(f"{where}: partial_rotary_factor={v} must be in (0, 1]")
    return v
