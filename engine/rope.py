"""Rotary position embedding tables (default, linear, Llama-3 and Phi-3's longrope; a rotary fraction; Gemma 3's
local tables) and their application."""
from __future__ import annotations

import math
import threading
from collections.abc import Mapping

import torch

from engine.config import ModelConfig


def inv_frequencies(cfg: ModelConfig, kind: str = "main") -> torch.Tensor:
    """(rotary_dim / 2,) for one table: "main", "long" (longrope past its original length) or "local" (Gemma 3's
    sliding layers: their own base, no scaling)."""
    hd = cfg.rotary_dim
    theta = cfg.rope_local_theta if kind == "local" else cfg.rope_theta
    shape = torch.arange(0, hd, 2, dtype=torch.int64).float() / hd
    rs = cfg.rope_scaling
    if kind == "local":
        return 1.0 / (theta ** shape)
    if rs.rope_type == "longrope":
        ext = torch.tensor(rs.long_factor if kind == "long" else rs.short_factor, dtype=torch.float32)
        return 1.0 / (ext * theta ** shape)
    inv = 1.0 / (theta ** shape)  # (hd/2,)
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


def rope_tables(cfg: ModelConfig, length: int, device, dtype, kind: str = "main") -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (length, 1, rotary_dim): computed in fp32, then cast (as transformers does)."""
    inv = inv_frequencies(cfg, kind)
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv)      # (length, rd/2)
    if cfg.family.positions == "rope_interleaved":     # Cohere: dims 2j and 2j + 1 share frequency j
        emb = torch.repeat_interleave(freqs, 2, dim=-1)                       # (length, rd)
    else:
        emb = torch.cat([freqs, freqs], dim=-1)                               # (length, rd)
    cos, sin = emb.cos(), emb.sin()
    if kind != "local" and cfg.rope_scaling.attention_factor != 1.0:
        cos, sin = cos * cfg.rope_scaling.attention_factor, sin * cfg.rope_scaling.attention_factor
    return cos.to(device=device, dtype=dtype).unsqueeze(1), sin.to(device=device, dtype=dtype).unsqueeze(1)


class RopeTables(Mapping):
    """A model's rotary tables, kind -> (cos, sin) over positions 0 .. len - 1, grown on demand (ensure) up to the
    context length: made at once for max_position_embeddings, a Llama-3.2-1B-shaped model held 67 MB of tables
    (131,072 positions), a tenth of its Q4_K weights, before any run needed them. A longer table's first rows are the
    shorter one's bit for bit (each entry is cos / sin of its own position times its frequency:
    tests/unit/test_rope_tables.py), so a run computes the same numbers however long the tables have grown. Growing
    replaces the tables whole (under a lock): a forward already holding the shorter ones keeps them."""

    START = 4096          # positions made at load

    def __init__(self, cfg: ModelConfig, device, dtype, kinds: tuple[str, ...]) -> None:
        self._cfg, self._device, self._dtype, self._kinds = cfg, device, dtype, tuple(kinds)
        self._lock = threading.Lock()
        self._n = 0
        self._tables: dict = {}
        self.ensure(self.START)

    def ensure(self, n: int) -> None:
        """Tables covering at least positions 0 .. n - 1 (at most the context length: the forward refuses more)."""
        if n <= self._n:
            return
        with self._lock:
            if n <= self._n:
                return
            m = min(max(int(n), 2 * self._n), self._cfg.max_position_embeddings)
            m = max(m, min(int(n), self._cfg.max_position_embeddings))
            self._tables = {k: rope_tables(self._cfg, m, self._device, self._dtype, k) for k in self._kinds}
            self._n = m

    def __len__(self) -> int:
        return len(self._kinds)

    def __iter__(self):
        return iter(self._kinds)

    def __getitem__(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._tables[kind]

    @property
    def positions(self) -> int:
        return self._n


def table_kinds(cfg: ModelConfig) -> tuple[str, ...]:
    """The tables a model of this config needs."""
    kinds = {k for k in cfg.layer_rope if k is not None} | {"main"}
    if cfg.rope_scaling.rope_type == "longrope":
        kinds.add("long")
    return tuple(sorted(kinds))


def table_for(cfg: ModelConfig, kind: str, end: int) -> str:
    """The table a layer of rope kind `kind` reads in a call whose last position is end - 1: longrope switches every
    row of the call to its long factors once the sequence passes the original length (as transformers does)."""
    if kind == "main" and cfg.rope_scaling.rope_type == "longrope" \
            and end > cfg.rope_scaling.original_max_position_embeddings:
        return "long"
    return kind


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """x (T, heads, hd) with its first rotary_dim (cos's width) dimensions rotated, the rest passed through.
    pairs: adjacent dimensions rotate together (Cohere's tables, interleaved), not the two halves."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return apply_rope(x, cos, sin, pairs)
    return torch.cat([apply_rope(x[..., :rd], cos, sin, pairs), x[..., rd:]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """x (T, heads, hd) rotated by half-split pairs (the HF layout): x*cos + rotate_half(x)*sin; with pairs, by
    adjacent pairs (Cohere's rotate_half: (x0, x1) -> (-x1, x0) for each pair).

    rotate_half(x)*sin is written straight into one buffer, half by half ((-b)*s is -(b*s) exactly), so the
    result is the same numbers as the formula's in two fresh tensors instead of five (a quarter of the time
    at 2,048 positions). A tensor that requires grad takes the formula as written (out= is not differentiable)."""
    if pairs:
        turned = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)
        return x * cos + turned * sin
    half = x.shape[-1] // 2
    if x.requires_grad or cos.requires_grad or sin.requires_grad:
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
    out = x * cos
    turned = torch.empty_like(out)
    torch.mul(x[..., half:], sin[..., :half], out=turned[..., :half]).neg_()
    torch.mul(x[..., :half], sin[..., half:], out=turned[..., half:])
    return out.add_(turned)
