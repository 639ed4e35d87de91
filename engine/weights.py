"""Strict loading of Hugging Face safetensors checkpoints into the engine's weight layout.

One explicit name map (HF name -> internal slot, expected shape). A missing, unexpected or mis-shaped
tensor is an error naming it. q/k/v and gate/up are fused after loading so that decode runs one matmul
where the checkpoint has three (or two); the hooks split them again by name. Matrices are stored
transposed, (in, out): on the CPU `x @ W` with that layout streams the weights about twice as fast as
`F.linear(x, W)` with HF's (out, in) layout at batch 1 (MKL's gemv path is single-threaded), and decode is
bound by reading the weights.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.errors import ModelLoadError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Buffers some older checkpoints carry that are recomputed here, never weights.
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor      # (d,)
    wqkv: torch.Tensor           # (d, (H + 2K) * hd)  columns: q heads, then k heads, then v heads
    bqkv: torch.Tensor | None    # ((H + 2K) * hd,)  Qwen2 only
    wo: torch.Tensor             # (H * hd, d)
    mlp_norm: torch.Tensor       # (d,)
    w_gate_up: torch.Tensor      # (d, 2F)  columns: gate, then up
    w_down: torch.Tensor         # (F, d)


@dataclass
class Weights:
    embed: torch.Tensor          # (V, d)  rows looked up by token id
    layers: list[LayerWeights]
    norm: torch.Tensor           # (d,)
    lm_head: torch.Tensor        # (d, V)  a transposed copy of embed when tied

    def nbytes(self) -> int:
        seen, total = set(), 0
        for t in [self.embed, self.norm, self.lm_head] + [
                x for lw in self.layers for x in vars(lw).values() if x is not None]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must hold, by its Hugging Face name, with its shape."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    names = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names |= {
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        }
        if cfg.attention_bias:
            names |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                      p + "self_attn.v_proj.bias": (kv,)}
    return names


def _shard_files(model_dir: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, RecursionError) as e:
            raise ModelLoadError(f"{index.name}: not a valid safetensors index ({type(e).__name__})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in weight_map.items()):
            raise ModelLoadError(f"{index.name}: weight_map must map tensor names to file names")
        root = model_dir.resolve()
        files = {}
        for name, fname in weight_map.items():
            path = (model_dir / fname).resolve()
            if path.parent != root or path.suffix != ".safetensors":
                raise ModelLoadError(f"{index.name}: {name!r} points at {fname!r}; shards must be .safetensors "
                                     "files in the model's own folder")
            files[name] = path
        return files
    if single.is_file():
        return {name: single for name in _keys(single)}
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")) or any(model_dir.glob("*.pth")):
        raise ModelLoadError(f"{model_dir}: only pickle checkpoints (.bin/.pt) found; this engine never unpickles. "
                             "Convert to model.safetensors first.")
    raise ModelLoadError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def _keys(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own error type for truncated/corrupt headers
        raise ModelLoadError(f"{path}: cannot read safetensors file (truncated or corrupt?): {e}") from None


def load_weights(model_dir: str | Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 progress=None, span: tuple[float, float] = (0.95, 0.99)) -> Weights:
    """Every expected tensor, checked (shape, dtype, finite) and converted. progress(fraction, message): the
    load's callback (engine.loader), told per tensor across `span`."""
    model_dir = Path(model_dir)
    expected = expected_tensors(cfg)
    where = _shard_files(model_dir)
    ignored = {n for n in where if IGNORED.fullmatch(n)}
    if cfg.tie_word_embeddings and "lm_head.weight" in where:
        ignored.add("lm_head.weight")  # tied models sometimes save a copy; the embedding is used, as in HF
    missing = sorted(set(expected) - set(where))
    unexpected = sorted(set(where) - set(expected) - ignored)
    if missing:
        raise ModelLoadError(f"{model_dir}: missing tensor(s): {', '.join(missing[:5])}"
                             + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
    if unexpected:
        raise ModelLoadError(f"{model_dir}: unexpected tensor(s): {', '.join(unexpected[:5])}"
                             + (f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else ""))

    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(where[name], []).append(name)
    raw: dict[str, torch.Tensor] = {}
    lo, hi = span
    for path, names in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    if progress:
                        progress(lo + (hi - lo) * len(raw) / len(expected),
                                 f"loading and checking weights: tensor {len(raw) + 1} of {len(expected)} ({name})")
                    raw[name] = _checked(name, f.get_tensor(name), expected[name], path).to(device=device, dtype=dtype)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read tensors (truncated or corrupt?): {e}") from None
    return _assemble(raw, cfg)


def _checked(name: str, t: torch.Tensor, shape: tuple[int, ...], path: Path) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise ModelLoadError(f"{path}: tensor {name} has shape {tuple(t.shape)}, expected {shape}")
    if t.dtype not in FLOAT_DTYPES:
        raise ModelLoadError(f"{path}: tensor {name} has dtype {t.dtype}; expected float32, float16 or bfloat16")
    if not bool(torch.isfinite(t).all()):
        raise ModelLoadError(f"{path}: tensor {name} contains NaN or Inf values")
    return t


def _assemble(raw: dict[str, torch.Tensor], cfg: ModelConfig) -> Weights:
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        bqkv = None
        if cfg.attention_bias:
            bqkv = torch.cat([raw.pop(a + f"{n}_proj.bias") for n in "qkv"])
        layers.append(LayerWeights(
            attn_norm=raw.pop(p + "input_layernorm.weight"),
            wqkv=_t(torch.cat([raw.pop(a + f"{n}_proj.weight") for n in "qkv"])),
            bqkv=bqkv,
            wo=_t(raw.pop(a + "o_proj.weight")),
            mlp_norm=raw.pop(p + "post_attention_layernorm.weight"),
            w_gate_up=_t(torch.cat([raw.pop(p + "mlp.gate_proj.weight"), raw.pop(p + "mlp.up_proj.weight")])),
            w_down=_t(raw.pop(p + "mlp.down_proj.weight")),
        ))
    embed = raw.pop("model.embed_tokens.weight")
    lm_head = _t(embed if cfg.tie_word_embeddings else raw.pop("lm_head.weight"))
    return Weights(embed=embed, layers=layers, norm=raw.pop("model.norm.weight"), lm_head=lm_head)


def _t(w: torch.Tensor) -> torch.Tensor:
    """(out, in) checkpoint layout -> contiguous (in, out)."""
    return w.t().contiguous()
