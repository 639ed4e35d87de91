"""The attention arithmetic, in one place: scores (scaled dot products, Gemma 2's soft cap, the mask, GQA), the
pattern (their softmax), z (pattern @ V), and the padded product of several runs' rows. engine.attention's attend (the
forward's one attention function: the fused kernel, or scores and pattern as tensors offered to the probe) computes
with these, and so do the batch's padded rows (engine.batch.rows), the blocked statistics beside the fused kernel
(engine.inspection.attention_blocks, attention_partials) and the Attention view (inspector.views.attention).

It imports nothing of the engine: the inspection layer, which engine.attention calls, reads it too.

    s = attention_scores(qh, keys, scale, softcap, allowed)  # (..., H, T, hd), (..., K, S, hd) -> (..., H, T, S)
    p = softmax_pattern(s, qh.dtype)                          # softmax in float32
    z = attention_output(p, values)                           # (..., H, T, S), (..., K, S, hd) -> (..., H, T, hd)
"""
from __future__ import annotations

from typing import Callable

import torch


def attention_scores(qh: torch.Tensor, keys: torch.Tensor, scale: float | None, softcap: float | None,
                     allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Attention scores (..., H, T, S) of queries qh (..., H, T, hd) over keys (..., K, S, hd) (leading dims: a
    padded batch's rows, or none): scaled dot products (scale None: the queries are already in score units,
    score_queries), Gemma 2's soft cap (tanh(s / cap) * cap, before the mask), -inf where allowed (broadcast to
    (..., H, T, S), e.g. (T, S)) is False. Query heads sharing a KV head (GQA: head h reads KV head h // (H / K)) are
    stacked (K, G*T, hd), so the keys are never copied per head."""
    *lead, H, T, hd = qh.shape
    K, S = keys.shape[-3], keys.shape[-2]
    s = (qh.reshape(*lead, K, -1, hd) @ keys.transpose(-1, -2)).view(*lead, H, T, S)              # (..., H, T, S)
    if scale is not None:
        s = s * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    return s if allowed is None else s.masked_fill(~allowed, float("-inf"))


def softmax_pattern(scores: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The pattern: softmax of the scores over their keys, in float32 (a bfloat16 model's too), returned in dtype
    (None: float32)."""
    pattern = torch.softmax(scores.float(), dim=-1)
    return pattern if dtype is None else pattern.to(dtype)


def softmax_pattern_(scores: torch.Tensor) -> torch.Tensor:
    """softmax_pattern of contiguous float32 scores written over them (a statistics block's workspace: no second
    block of memory)."""
    return torch.ops.aten._softmax.out(scores, -1, False, out=scores)


def attention_output(pattern: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """z (..., H, T, hd) = pattern (..., H, T, S) @ values (..., K, S, hd), the heads of a KV head stacked. Over
    several rows a value that is not finite reaches only the rows that read it (weight != 0): a matmul would let
    0 * NaN leak a NaN at position j into rows t < j that give it zero weight, and generation is causal."""
    *lead, H, T, S = pattern.shape
    K, hd = values.shape[-3], values.shape[-1]
    grouped = pattern.reshape(*lead, K, -1, S)                                                   # (..., K, G*T, S)
    if T > 1 and not bool(torch.isfinite(values).all()):
        finite = torch.isfinite(values)
        z = grouped @ torch.where(finite, values, 0.0)
        reads_bad = (grouped != 0).to(values.dtype) @ (~finite).to(values.dtype)                 # (..., K, G*T, hd)
        return torch.where(reads_bad > 0, float("nan"), z).view(*lead, H, T, hd)
    return (grouped @ values).view(*lead, H, T, hd)


def score_queries(qh: torch.Tensor, scale: float) -> torch.Tensor:
    """The queries (..., hd) a statistics kernel multiplies with the keys: in the units of the default scale
    hd ** -0.5, which the kernels apply themselves (engine.native's too): qh * (scale / hd ** -0.5), qh itself at the
    default scale."""
    default = qh.shape[-1] ** -0.5
    return qh if scale == default else qh * (scale / default)


def scaled_queries(qh: torch.Tensor) -> torch.Tensor:
    """Queries in the default scale's units (score_queries) -> float32 queries in score units: a plain product with
    the keys is then the score (a blocked product into a workspace folds the scale in once per query)."""
    return qh.float() * qh.shape[-1] ** -0.5


def padded_attention(qh: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], *, scale: float,
                     softcap: float | None = None,
                     offer: Callable[[str, torch.Tensor, torch.Tensor], None] | None = None) -> torch.Tensor:
    """One query row of each of B runs in one product: qh (H, B, hd), row b over its own keys and values (K, S_b, hd)
    -> z (H, B, hd). The keys are padded to the longest with zeros whose scores are -inf: the same dot products as
    each row's alone, a softmax and a pattern @ V whose sums also run over the pad's zero weights, so a row's result
    is its alone within rounding, not bit for bit (the sums add in another order). offer(stage, x (B, H, S), pad
    (B, S)): the scores and the pattern of every row, row b's first S_b keys its own (pad: the rest)."""
    H, B, hd = qh.shape
    K, lengths = keys[0].shape[0], [k.shape[1] for k in keys]
    S = max(lengths)
    kp, vp = qh.new_zeros(B, K, S, hd), qh.new_zeros(B, K, S, hd)
    for b, (kb, vb) in enumerate(zip(keys, values)):
        kp[b, :, :lengths[b]] = kb
        vp[b, :, :lengths[b]] = vb
    pad = torch.arange(S, device=qh.device)[None, :] >= torch.tensor(lengths, device=qh.device)[:, None]   # (B, S)
    q = qh.transpose(0, 1)[:, :, None]                                                          # (B, H, 1, hd)
    scores = attention_scores(q, kp, scale, softcap, ~pad[:, None, None, :])                    # (B, H, 1, S)
    if offer is not None:
        offer("attn.scores", scores.view(B, H, S), pad)
    pattern = softmax_pattern(scores, qh.dtype)
    if offer is not None:
        offer("attn.pattern", pattern.view(B, H, S), pad)
    return attention_output(pattern, vp).view(B, H, hd).transpose(0, 1)                         # (H, B, hd)
