"""Direct logit attribution's parts for any family: the residual stream at one position as a sum of the embedding
(and GPT-2's learned position), every attention head and every MLP (each expert's share where the layer has experts),
dotted with the logit difference's direction.

Each norm on the way is frozen at its scale for that position, as the final RMSNorm is: a post-norm (Gemma 2/3,
OLMo 2) then multiplies every part of its branch by the same numbers, so the heads still sum to the branch's output
exactly. A LayerNorm (GPT-2, GPT-NeoX, StableLM, Phi) also centres the stream: centring is linear, so it distributes
over the parts (each part's share is its own centred vector through the frozen scale), and its bias is a constant no
part owns: a term of its own, as Phi's head bias and each layer's attention output bias (blocks.{i}.attn.bias: the
layer's, not a head's). An MLP's output bias is the MLP's (the MLP is one part). Granite's multipliers scale the parts
and the direction. Gemma 2's final soft cap bends the logits after the sum: the parts add up to the uncapped
difference, and the explanation shows that against the capped one."""
from __future__ import annotations

import torch

from engine.moe import activation
from engine.quant_matrix import QuantMatrix
from engine.weights import as_float


def capture_names(model, last: int) -> list[str]:
    """The stages one forward must capture at the explained position."""
    names = ["embed", "blocks.*.attn.z", "blocks.*.attn_out", "blocks.*.mlp_out", f"blocks.{last}.resid_post"]
    if model.config.num_experts:
        names += ["blocks.*.mlp_norm", "blocks.*.resid_mid", "blocks.*.mlp.experts"]
    if model.config.final_softcap:
        names.append("logits_uncapped")
    return names


def _f64(t) -> torch.Tensor:
    """t in float64 on the CPU (a matrix kept in GGUF blocks: its dequantised value, engine.weights.as_float)."""
    return as_float(t).detach().to("cpu", torch.float64)


def _post(out: torch.Tensor, raw: torch.Tensor, w, eps: float) -> torch.Tensor:
    """Parts (..., d) of a branch whose sum is raw (d,), through its post-norm frozen at raw's scale."""
    if w is None:
        return out
    return out * torch.rsqrt(raw.pow(2).mean() + eps) * _f64(w)


def _cols(model, a: int, b: int) -> torch.Tensor:
    """The lm_head's columns of A and B, (d, 2) float64 (dequantised where the head is kept quantised)."""
    w = model.weights.lm_head
    return _f64(w.rows(torch.tensor([a, b])).t() if isinstance(w, QuantMatrix) else w[:, [a, b]])


def layer_norm(model) -> bool:
    """Whether the family's norms are LayerNorms (centre, scale, add a bias) rather than RMSNorms."""
    return model.config.family.norm == "layer"


def frozen_scale(model, x: torch.Tensor) -> float:
    """The family norm's factor at the stream x (d,): 1/sqrt(mean(x²)+eps), or for a LayerNorm 1/sqrt(var(x)+eps)."""
    if layer_norm(model):
        x = x - x.mean()
    return float(torch.rsqrt(x.pow(2).mean() + model.config.rms_norm_eps))


def direction(model, resid: torch.Tensor, a: int, b: int) -> tuple[torch.Tensor, float]:
    """The direction (d,) whose dot product with each part of the last block's output is that part's share of the
    (uncapped) logit(A) - logit(B), and the frozen final-norm scale. Through a LayerNorm the direction is centred:
    (c - mean(c)) . u == c . (u - mean(u)), so a part's centred share is a plain dot product too."""
    cfg, w = model.config, model.weights
    scale = frozen_scale(model, resid)
    cols = _cols(model, a, b)
    u = scale * _f64(w.norm) * (cols[:, 0] - cols[:, 1]) / cfg.logits_divisor
    return (u - u.mean() if layer_norm(model) else u), scale


def constants(model, a: int, b: int) -> dict[str, float]:
    """The terms of the logit difference that no part of the stream owns: the final LayerNorm's bias through the
    head (final_norm.bias) and Phi's head bias (lm_head.bias); empty for a family with neither."""
    cfg, w = model.config, model.weights
    out = {}
    if w.norm_bias is not None:
        cols = _cols(model, a, b)
        out["final_norm.bias"] = float(_f64(w.norm_bias) @ (cols[:, 0] - cols[:, 1])) / cfg.logits_divisor
    if w.head_bias is not None:
        hb = _f64(w.head_bias)
        out["lm_head.bias"] = float(hb[a] - hb[b]) / cfg.logits_divisor
    return out


def layer_parts(model, got: dict[str, torch.Tensor], i: int
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Layer i's parts of the residual stream at one position: (heads (H, d), the attention output's bias (d,) or
    None, mlp (d,)), float64, each through its branch's post-norm frozen at the position's scale, so that the
    embedding plus the layers' parts up to a block sum to the stream entering it (a parallel block's attention and MLP
    both join the stream it leaves). got: each captured stage's row (float64) at the position."""
    cfg, lw = model.config, model.weights.layers[i]
    H, hd, eps = cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
    wo = _f64(as_float(lw.wo)).view(H, hd, -1)                                               # (H, hd, d)
    heads = torch.einsum("hk,hkd->hd", got[f"blocks.{i}.attn.z"], wo) * cfg.residual_scale   # (H, d)
    if lw.bo is not None:          # the layer's, not a head's: a row of its own after the heads
        heads = torch.cat([heads, _f64(lw.bo).unsqueeze(0) * cfg.residual_scale])
    heads = _post(heads, got[f"blocks.{i}.attn_out"], lw.attn_post_norm, eps)
    mlp_raw = got[f"blocks.{i}.mlp_out"]
    mlp = _post(mlp_raw, mlp_raw, lw.mlp_post_norm, eps)
    return (heads[:H], heads[H] if lw.bo is not None else None, mlp)


def components(model, got: dict[str, torch.Tensor], upto: int, pos: int) -> tuple[list[str], torch.Tensor]:
    """The residual stream entering block `upto` (num_layers: leaving the last) at position pos as its parts,
    (names, (n, d) float64): embed (the token's row), positions (GPT-2's learned row for pos), then per layer
    blocks.{i}.attn.head.{h}, blocks.{i}.attn.bias (where the attention output has a bias) and blocks.{i}.mlp."""
    names, rows = ["embed"], [got["embed"]]
    if model.weights.pos_embed is not None:
        where = _f64(model.weights.pos_embed[pos])
        rows, names = [got["embed"] - where, where], names + ["positions"]
    for i in range(upto):
        heads, bias, mlp = layer_parts(model, got, i)
        names += [f"blocks.{i}.attn.head.{h}" for h in range(heads.shape[0])]
        rows += list(heads)
        if bias is not None:
            names.append(f"blocks.{i}.attn.bias")
            rows.append(bias)
        names.append(f"blocks.{i}.mlp")
        rows.append(mlp)
    return names, torch.stack(rows)


def parts(model, got: dict[str, torch.Tensor], direction: torch.Tensor, pos: int
          ) -> tuple[dict[str, float], dict[str, float]]:
    """(contributions: components' names -> share of the uncapped difference, the constants (engine.tools.dla
    .constants) left to the caller; experts: blocks.{i}.mlp.expert.{e} -> that expert's share of its layer's MLP
    part). got: each captured stage's row (float64) at position pos."""
    names, rows = components(model, got, model.config.num_layers, pos)
    out = dict(zip(names, (rows @ direction).tolist()))
    experts = {}
    for i in range(model.config.num_layers):
        if model.weights.layers[i].router is not None:
            experts |= _expert_shares(model, got, i, direction)
    return out, experts


def _expert_shares(model, got, i: int, direction: torch.Tensor) -> dict[str, float]:
    """Each chosen expert's output at the position (its gate times its gated MLP, recomputed in float64 from the
    captured input and gates), through the layer's post-norm, dotted with the direction."""
    cfg, lw = model.config, model.weights.layers[i]
    h = got.get(f"blocks.{i}.mlp_norm", got.get(f"blocks.{i}.resid_mid"))
    gates, act = got[f"blocks.{i}.mlp.experts"], activation(cfg.activation)
    shares = {}
    for e in torch.nonzero(gates).flatten().tolist():
        g, u = (h @ _f64(lw.experts_gate_up[e])).chunk(2)
        y = (act(g) * u) @ _f64(lw.experts_down[e]) * gates[e] * cfg.residual_scale
        y = _post(y, got[f"blocks.{i}.mlp_out"], lw.mlp_post_norm, cfg.rms_norm_eps)
        shares[f"blocks.{i}.mlp.expert.{e}"] = float(y @ direction)
    return shares
