"""Rotary position embedding tables (with Llama-3 / linear scaling) and their application."""
from __future__ import annotations

import math

import torch

from engine.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))  # (hd/2,)
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        inv = inv / rs.factor
    elif rs.rope_type == "llama3":
        # Same formula as Meta's reference and transformers' _compute_llama3_parameters.
        old = rs.original_max_position_embeddings
        low_wavelen, high_wavelen = old / rs.low_freq_factor, old / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rope_tables(cfg: ModelConfig, length: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (length, 1, hd): computed in fp32, then cast (as transformers does)."""
    inv = inv_frequencies(cfg)
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv)      # (length, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)                                   # (length, hd)
    return (emb.cos().to(device=device, dtype=dtype).unsqueeze(1),
            emb.sin().to(device=device, dtype=dtype).unsqueeze(1))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, hd) rotated by half-split pairs (the HF layout): x*cos + rotate_half(x)*sin.

    rotate_half(x)*sin is written straight into one buffer, half by half ((-b)*s is -(b*s) exactly), so the
    result is the same numbers as the formula's in two fresh tensors instead of five (a quarter of the time
    at 2,048 positions). A tensor that requires grad takes the formula as written (out= is not differentiable)."""
    half = x.shape[-1] // 2
    if x.requires_grad or cos.requires_grad or sin.requires_grad:
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
    out = x * cos
    turned = torch.empty_like(out)
    torch.mul(x[..., half:], sin[..., :half], out=turned[..., :half]).neg_()
    torch.mul(x[..., :half], sin[..., half:], out=turned[..., half:])
    return out.add_(turned)
