"""The families' norms: RMSNorm (Llama and most others) and LayerNorm with its bias (GPT-2, GPT-NeoX), each in the
wider of the stream's and the weight's dtypes with its output in the weight's (the dtype the next matmul runs in)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.config import ModelConfig


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in the wider of the stream's and the weight's dtypes, output in the weight's (the dtype the
    following matmul runs in). In fp32 it is F.rms_norm's arithmetic, op for op (x * rsqrt(mean(x²) + eps) * w),
    in 7 small ops instead of its 11 (decode runs 61); half precisions keep F.rms_norm, which squares in fp32."""
    if x.dtype == w.dtype == torch.float32:
        r = x.pow(2).sum(-1, keepdim=True).div_(x.shape[-1]).add_(eps).rsqrt_()
        return (x * r).mul_(w)
    if x.dtype == w.dtype:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    wide = torch.promote_types(x.dtype, w.dtype)
    return F.rms_norm(x.to(wide), (x.shape[-1],), w.to(wide), eps).to(w.dtype)


def _layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm with its bias (GPT-2, GPT-NeoX) in the wider of the stream's and the weight's dtypes, output in
    the weight's, as rms_norm."""
    wide = torch.promote_types(x.dtype, w.dtype)
    out = F.layer_norm(x.to(wide), (x.shape[-1],), w.to(wide), None if b is None else b.to(wide), eps)
    return out.to(w.dtype)


def family_norm(cfg: "ModelConfig", x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                eps: float) -> torch.Tensor:
    """The family's norm (engine.family: RMSNorm, or LayerNorm with a bias) of x (..., d) with weight w."""
    return _layer_norm(x, w, b, eps) if cfg.family.norm == "layer" else rms_norm(x, w, eps)
