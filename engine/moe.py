"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each row's top-k experts; their gated MLPs' outputs
are summed, weighted by the router's probabilities (renormalised over the top k where the family does)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.matmul import mm


def route(router_logits: torch.Tensor, k: int, renormalise: bool) -> torch.Tensor:
    """router_logits (T, E) -> gates (T, E): each row's top-k experts' weights (softmax in float32, as transformers
    computes it, then top k, then optionally renormalised), 0 for every other expert; in the logits' dtype."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    top, idx = torch.topk(probs, k, dim=-1)
    if renormalise:
        top = top / top.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, idx, top).to(router_logits.dtype)


def experts_mlp(h: torch.Tensor, gates: torch.Tensor, gate_up, down, act) -> torch.Tensor:
    """h (T, d), gates (T, E) -> (T, d): for each expert that some row routes to (ascending, as transformers adds
    them), its gated MLP on those rows times their gate, added into the rows. gate_up (E, d, 2Fe), down (E, Fe, d):
    float stacks, or engine.quant_experts.QuantExperts (a GGUF file's experts kept in their blocks); either way
    expert e's matrices are gate_up[e] and down[e], multiplied by engine.matmul.mm (its tiles: a row's product does
    not depend on how many rows chose the expert)."""
    out = torch.zeros_like(h)
    for e in torch.nonzero(gates.ne(0).any(0)).flatten().tolist():
        rows = torch.nonzero(gates[:, e]).flatten()
        g, u = mm(h[rows], gate_up[e]).chunk(2, dim=-1)                     # (n, Fe) each
        y = mm(act(g) * u, down[e])                                          # (n, d)
        out.index_add_(0, rows, (y * gates[rows, e, None]).to(out.dtype))
    return out


def activation(name: str):
    if name == "gelu":        # GPT-NeoX's exact erf GELU
        return F.gelu
    return F.silu if name == "silu" else (lambda x: F.gelu(x, approximate="tanh"))
