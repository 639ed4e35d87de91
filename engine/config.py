"""ModelConfig: one dataclass built from a Hugging Face config.json, with every key mapped explicitly."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.family import FAMILIES, Family, family
from engine.family import variations as var
from engine.family.variations import ROPE_TYPES
from engine.family.variations import flag as _flag
from engine.family.variations import positive as _positive

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
SUPPORTED_ROPE_TYPES = ROPE_TYPES
# Upper bounds no real model reaches: a config past them is damaged or hostile, and would make the loader
# allocate absurd tensors (rope tables, caches) before any weight is read.
SIZE_BOUNDS = {"num_hidden_layers": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024,
               "hidden_size": 1 << 17, "intermediate_size": 1 << 20, "head_dim": 1024, "vocab_size": 1 << 22,
               "max_position_embeddings": 1 << 22}
POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()      # longrope: per-frequency divisors up to the original length
    long_factor: tuple[float, ...] = ()       # longrope: past it
    attention_factor: float = 1.0             # longrope: cos and sin scaled by it


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # the family's block variations (engine.family.variations); the defaults are Llama's
    activation: str = "silu"
    embed_scale: float = 1.0
    residual_scale: float = 1.0
    attn_scale: float | None = None           # None: head_dim ** -0.5
    logits_divisor: float = 1.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    rotary_dim: int | None = None             # None: head_dim
    layer_window: tuple[int | None, ...] = ()  # per layer: sliding window, or None (global); () = all global
    layer_rope: tuple[str | None, ...] = ()    # per layer: "main", "local" or None (no RoPE); () = all main
    rope_local_theta: float | None = None     # Gemma 3's sliding layers
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    layer_moe: tuple[bool, ...] = ()           # per layer: an experts layer; () = none
    parallel_residual: bool = False           # GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x)), no resid_mid

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")

        if not self.layer_window:
            object.__setattr__(self, "layer_window", (None,) * self.num_layers)
        if not self.layer_rope:
            object.__setattr__(self, "layer_rope", ("main",) * self.num_layers)
        if not self.layer_moe:
            object.__setattr__(self, "layer_moe", (False,) * self.num_layers)
        if self.attn_scale is None:
            object.__setattr__(self, "attn_scale", self.head_dim ** -0.5)
        if self.rotary_dim is None:
            object.__setattr__(self, "rotary_dim", self.head_dim)

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def windowed(self) -> bool:
        """Some layer attends within a sliding window (its cache is a ring of the window's length)."""
        return any(w is not None for w in self.layer_window)

    @property
    def kv_groups(self) -> int:
        """Query heads that share one KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"config.json not found: {path}")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(raw, where=str(path))

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config") -> "ModelConfig":
        """The config, or ModelLoadError naming the key whose value is unusable."""
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{where}: must be a JSON object of settings, got {type(raw).__name__}")
        for key in POSITIVE_INTS:
            v, most = raw.get(key), SIZE_BOUNDS.get(key, 1 << 24)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= most):
                raise ModelLoadError(f"{where}: {key}={v!r} must be a whole number in [1, {most:,}]")
        try:
            return cls._from_dict(raw, where)
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise ModelLoadError(f"{where}: invalid value: {e}") from None

    @classmethod
    def _from_dict(cls, raw: dict, where: str) -> "ModelConfig":
        def need(key: str):
            if key not in raw:
                raise ModelLoadError(f"{where}: missing required key {key!r}")
            return raw[key]

        model_type = raw.get("model_type")
        if model_type not in FAMILIES:
            archs = raw.get("architectures")
            raise UnsupportedModelError(
                f"{where}: unsupported architecture model_type={model_type!r} (architectures={archs}); "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        fam = family(model_type, where)
        raw = var.canonical(fam, raw, where)
        act = var.activation(fam, raw, where)
        if raw.get("mlp_bias"):
            raise UnsupportedModelError(f"{where}: mlp_bias=true is not supported")

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if raw.get("head_dim") is None and hidden % heads:
            raise ModelLoadError(f"{where}: hidden_size={hidden} is not divisible by num_attention_heads={heads}")
        if head_dim % 2:
            # RoPE rotates each head's dimensions in pairs: an odd head_dim loads but fails at the first forward.
            given = (f"head_dim={head_dim}" if raw.get("head_dim") is not None else
                     f"head_dim = hidden_size / num_attention_heads = {hidden} / {heads} = {head_dim}")
            raise UnsupportedModelError(f"{where}: {given} is odd; rotary position embedding (RoPE) rotates pairs "
                                        "of dimensions, so head_dim must be even")
        layers = int(need("num_hidden_layers"))
        if fam.positions == "learned" and raw.get("rope_scaling"):
            raise UnsupportedModelError(f"{where}: rope_scaling is set, but model_type={model_type!r} has learned "
                                        "absolute positions, no RoPE")

        max_pos = int(raw.get("max_position_embeddings", 2048))
        rope = _rope_fields(fam, raw, where, head_dim, layers, max_pos)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        eps = float(raw.get("rms_norm_eps", 1e-6))
        if not math.isfinite(eps) or eps < 0:
            raise ModelLoadError(f"{where}: rms_norm_eps={eps} must be a finite number >= 0")
        bias = {"always": True, "never": False}.get(fam.bias)
        if bias is None:
            bias = _flag(raw, "attention_bias", where)
        elif fam.bias == "never" and _flag(raw, "attention_bias", where):
            raise UnsupportedModelError(f"{where}: attention_bias=true is not supported for model_type={model_type!r}")
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=eps,
            max_position_embeddings=max_pos,
            tie_word_embeddings=_flag(raw, "tie_word_embeddings", where),
            attention_bias=bias,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            activation=act,
            parallel_residual=var.parallel_residual(fam, raw, where),
            **rope,
            **var.scales(fam, raw, where, hidden, head_dim),
            **var.experts(fam, raw, where, layers),
        )


def _rope_fields(fam: Family, raw: dict, where: str, head_dim: int, layers: int, max_pos: int) -> dict:
    """RoPE and attention-window settings: theta and scaling, rotary dimensions, each layer's window and table."""
    # transformers >= 5 writes rope settings under rope_parameters (per layer type for Gemma 3); older configs
    # at the top level.
    rope_params = raw.get("rope_parameters") or {}
    if not isinstance(rope_params, dict):
        raise ModelLoadError(f"{where}: rope_parameters must be a JSON object, got {type(rope_params).__name__}")
    local_params = None
    if isinstance(rope_params.get("full_attention"), dict):
        local_params = rope_params.get("sliding_attention")
        rope_params = rope_params["full_attention"]
    fraction = var.rotary_fraction(fam, raw, rope_params, where)
    rotary_dim = int(head_dim * fraction)
    if rotary_dim % 2 or rotary_dim < 2:
        raise UnsupportedModelError(f"{where}: partial_rotary_factor={fraction} gives {rotary_dim} rotary "
                                    "dimensions; RoPE needs an even number >= 2")
    rope_theta = _positive(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0)), "rope_theta", where)
    scaling_raw = raw.get("rope_scaling")
    if scaling_raw is None and rope_params.get("rope_type", "default") != "default":
        scaling_raw = rope_params
    rope_scaling = _parse_rope_scaling(scaling_raw, where, fam, raw, rotary_dim, max_pos)
    layer_window = var.windows(fam, raw, where, layers, max_pos)
    layer_rope = var.rope_layers(fam, raw, where, layer_window)
    if fam.positions == "learned":      # GPT-2: positions are added to the embedding; no layer rotates q and k
        layer_rope = (None,) * layers
    local_theta = None
    if fam.local_rope:
        if local_params is not None and local_params.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"{where}: rope_parameters.sliding_attention.rope_type="
                                        f"{local_params.get('rope_type')!r} is not supported (default only)")
        local_theta = _positive((local_params or {}).get("rope_theta", raw.get("rope_local_base_freq", 10000.0)),
                                "rope_local_base_freq", where)

    return {"rope_theta": rope_theta, "rope_scaling": rope_scaling, "rotary_dim": rotary_dim,
            "layer_window": layer_window, "layer_rope": layer_rope, "rope_local_theta": local_theta}


def _parse_rope_scaling(raw: dict | None, where: str, fam: Family, top: dict, rotary_dim: int,
                        max_pos: int) -> RopeScaling:
    if not raw:
        return RopeScaling()
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{where}: rope_scaling must be a JSON object, got {str(raw)[:40]!r}")
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind not in fam.rope_types:
        raise UnsupportedModelError(
            f"{where}: unsupported rope_scaling type {kind!r}; supported: {', '.join(fam.rope_types)}")
    low = _positive(raw.get("low_freq_factor", 1.0), "rope_scaling.low_freq_factor", where)
    high = _positive(raw.get("high_freq_factor", 4.0), "rope_scaling.high_freq_factor", where)
    if kind == "llama3" and not high > low:
        raise ModelLoadError(f"{where}: rope_scaling needs high_freq_factor > low_freq_factor, got {high} <= {low}")
    original = raw.get("original_max_position_embeddings", top.get("original_max_position_embeddings", 8192))
    if isinstance(original, bool) or not isinstance(original, int) or not 1 <= original <= 1 << 24:
        raise ModelLoadError(f"{where}: rope_scaling.original_max_position_embeddings={original!r} must be a whole "
                             "number in [1, 2**24]")
    if kind != "longrope":
        return RopeScaling(rope_type=kind, factor=_positive(raw.get("factor", 1.0), "rope_scaling.factor", where),
                           low_freq_factor=low, high_freq_factor=high, original_max_position_embeddings=original)
    factors = {}
    for key in ("short_factor", "long_factor"):
        v = raw.get(key)
        if not isinstance(v, list) or len(v) != rotary_dim // 2:
            raise ModelLoadError(f"{where}: rope_scaling.{key} must list {rotary_dim // 2} numbers (one per rotary "
                                 f"frequency), got {str(v)[:60]}")
        factors[key] = tuple(_positive(x, f"rope_scaling.{key}", where) for x in v)
    factor = raw.get("factor")
    factor = max_pos / original if factor is None else _positive(factor, "rope_scaling.factor", where)
    attention = raw.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(rope_type=kind, factor=factor, original_max_position_embeddings=original,
                       attention_factor=_positive(attention, "rope_scaling.attention_factor", where), **factors)
