"""Direct logit attribution's parts for any family: the residual stream at one position as a sum of the embedding,
every attention head and every MLP (each expert's share where the layer has experts), dotted with the logit
difference's direction.

Each norm on the way is frozen at its scale for that position, as the final RMSNorm is: a post-norm (Gemma 2/3,
OLMo 2) then multiplies every part of its branch by the same numbers, so the heads still sum to the branch's output
exactly. Granite's multipliers scale the parts and the direction. Gemma 2's final soft cap bends the logits after
the sum: the parts add up to the uncapped difference, and the explanation shows that against the capped one."""
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


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64)


def _post(out: torch.Tensor, raw: torch.Tensor, w, eps: float) -> torch.Tensor:
    """Parts (..., d) of a branch whose sum is raw (d,), through its post-norm frozen at raw's scale."""
    if w is None:
        return out
    return out * torch.rsqrt(raw.pow(2).mean() + eps) * _f64(w)


def direction(model, resid: torch.Tensor, a: int, b: int) -> tuple[torch.Tensor, float]:
    """The direction (d,) whose dot product with the last block's output is the (uncapped) logit(A) - logit(B), and
    the frozen final-norm scale."""
    cfg, w = model.config, model.weights
    scale = float(torch.rsqrt(resid.pow(2).mean() + cfg.rms_norm_eps))
    cols = _f64(w.lm_head.rows(torch.tensor([a, b])).t() if isinstance(w.lm_head, QuantMatrix)    # kept quantised:
                else w.lm_head[:, [a, b]])                                             # (d, 2), dequantised
    return scale * _f64(w.norm) * (cols[:, 0] - cols[:, 1]) / cfg.logits_divisor, scale


def layer_parts(model, got: dict[str, torch.Tensor], i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer i's parts of the residual stream at one position: (heads (H, d), mlp (d,)), float64, each through its
    branch's post-norm frozen at the position's scale, so that embed + the layers' heads and MLPs up to a block sum to
    the stream entering it. got: each captured stage's row (float64) at the position."""
    cfg, lw = model.config, model.weights.layers[i]
    H, hd, eps = cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
    wo = _f64(as_float(lw.wo)).view(H, hd, -1)                                               # (H, hd, d)
    heads = torch.einsum("hk,hkd->hd", got[f"blocks.{i}.attn.z"], wo) * cfg.residual_scale   # (H, d)
    mlp_raw = got[f"blocks.{i}.mlp_out"]
    return (_post(heads, got[f"blocks.{i}.attn_out"], lw.attn_post_norm, eps),
            _post(mlp_raw, mlp_raw, lw.mlp_post_norm, eps))


def parts(model, got: dict[str, torch.Tensor], direction: torch.Tensor) -> tuple[dict[str, float], dict[str, float]]:
    """(contributions: embed, blocks.{i}.attn.head.{h}, blocks.{i}.mlp, which sum to the uncapped difference;
    experts: blocks.{i}.mlp.expert.{e} -> that expert's share of its layer's MLP part). got: each captured stage's
    row (float64) at the position."""
    out, experts = {"embed": float(got["embed"] @ direction)}, {}
    for i in range(model.config.num_layers):
        heads, mlp = layer_parts(model, got, i)
        out.update({f"blocks.{i}.attn.head.{h}": float(v) for h, v in enumerate(heads @ direction)})
        out[f"blocks.{i}.mlp"] = float(mlp @ direction)
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
