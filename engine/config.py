"""ModelConfig: one dataclass built from a Hugging Face config.json, with every key mapped explicitly."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")

    @property
    def kv_groups(self) -> int:
        """Query heads that share one KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_dim(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

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
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = raw.get("architectures")
            raise UnsupportedModelError(
                f"{where}: unsupported architecture model_type={model_type!r} (architectures={archs}); "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{where}: unsupported hidden_act={act!r}; only 'silu' (SwiGLU) is implemented")
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

        # transformers >= 5 writes rope settings under rope_parameters; older configs at the top level.
        rope_params = raw.get("rope_parameters") or {}
        if not isinstance(rope_params, dict):
            raise ModelLoadError(f"{where}: rope_parameters must be a JSON object, got {type(rope_params).__name__}")
        rope_theta = _positive(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0)), "rope_theta", where)
        scaling_raw = raw.get("rope_scaling")
        if scaling_raw is None and rope_params.get("rope_type", "default") != "default":
            scaling_raw = rope_params
        rope_scaling = _parse_rope_scaling(scaling_raw, where)

        max_pos = int(raw.get("max_position_embeddings", 2048))
        if model_type == "mistral" and raw.get("sliding_window"):
            # Within the window, sliding-window attention equals full attention: cap the context there.
            max_pos = min(max_pos, int(raw["sliding_window"]))
        if model_type == "qwen2" and raw.get("use_sliding_window"):
            raise UnsupportedModelError(f"{where}: use_sliding_window=true is not supported")

        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        eps = float(raw.get("rms_norm_eps", 1e-6))
        if not math.isfinite(eps) or eps < 0:
            raise ModelLoadError(f"{where}: rms_norm_eps={eps} must be a finite number >= 0")
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=eps,
            rope_theta=rope_theta,
            max_position_embeddings=max_pos,
            tie_word_embeddings=_flag(raw, "tie_word_embeddings", where),
            # Qwen2 always has q/k/v biases; Llama only with attention_bias.
            attention_bias=(model_type == "qwen2") or _flag(raw, "attention_bias", where),
            rope_scaling=rope_scaling,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _parse_rope_scaling(raw: dict | None, where: str) -> RopeScaling:
    if not raw:
        return RopeScaling()
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{where}: rope_scaling must be a JSON object, got {str(raw)[:40]!r}")
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{where}: unsupported rope_scaling type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    low = _positive(raw.get("low_freq_factor", 1.0), "rope_scaling.low_freq_factor", where)
    high = _positive(raw.get("high_freq_factor", 4.0), "rope_scaling.high_freq_factor", where)
    if kind == "llama3" and not high > low:
        raise ModelLoadError(f"{where}: rope_scaling needs high_freq_factor > low_freq_factor, got {high} <= {low}")
    original = raw.get("original_max_position_embeddings", 8192)
    if isinstance(original, bool) or not isinstance(original, int) or not 1 <= original <= 1 << 24:
        raise ModelLoadError(f"{where}: rope_scaling.original_max_position_embeddings={original!r} must be a whole "
                             "number in [1, 2**24]")
    return RopeScaling(rope_type=kind, factor=_positive(raw.get("factor", 1.0), "rope_scaling.factor", where),
                       low_freq_factor=low, high_freq_factor=high, original_max_position_embeddings=original)


def _positive(v, name: str, where: str) -> float:
    """A JSON number that must be finite and > 0 (rope theta and factors: 0 or NaN would make every angle NaN)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ModelLoadError(f"{where}: {name}={v!r} must be a finite number > 0")
    return float(v)


def _flag(raw: dict, key: str, where: str) -> bool:
    """A JSON boolean; the string "false" is refused rather than read as True."""
    v = raw.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ModelLoadError(f"{where}: {key} must be true or false, got {v!r}")
    return v
