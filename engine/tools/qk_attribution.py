"""Why a head attends where it does: one pre-softmax attention score split into query-side x key-side components.

The score of head h at layer L, query position i, key position j is scale * q_i . k_j, where q_i = RoPE_i(W_q,h^T
(s_i w ⊙ x_i)) (+ RoPE_i(b_q,h)) and k_j likewise with head h's KV head, x_p the residual stream entering block L at
position p and s_p the attention norm's scale there. With s_i and s_j frozen at their values (as Explain freezes the
final norm), q and k are linear in x, and x_p is the sum of the embedding, every earlier head and every earlier MLP
(engine.tools.dla.components), so the score is exactly the sum over pairs (a query-side component, a key-side
component) of scale * q(a) . k(b), plus bias terms. Through a LayerNorm (GPT-2, GPT-NeoX, StableLM, Phi) each
component is centred (centring is linear) before the frozen scale, and the norm's bias is a constant of each side
(blocks.{L}.attn_norm.bias, through the projection and RoPE), as the projection's bias is ("bias"); each constant
pairs with every component of the other side (Cohere's LayerNorm has no bias: no such constant). GPT-2's learned
position is a component ("positions"), and its attention has no RoPE; Cohere's RoPE turns adjacent pairs of
dimensions (engine.rope's pairs), as its forward does. The terms are summed in float64 and set against the score the
forward computed (its attn.scores stage): the remainder is the forward's own float32 rounding for these blocks.
Where a block is not linear in its input once the norm is frozen (a q/k norm, an attention soft cap), the split
cannot be exact: the report says so and shows the remainder it leaves.

Entry point: qk_attribution(model, ids, layer, head, query, key) -> QKAttribution."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention_math import attention_scores
from engine.errors import InputError
from engine.inspection.probe import Probe
from engine.rope import rope_tables, rotate, table_for
from engine.tools import dla

MAX_POSITIONS = 1_024


@dataclass
class QKAttribution:
    layer: int
    head: int
    query: int
    key: int
    names: list[str]               # the components, both sides: embed, blocks.{l}.attn.head.{h}, blocks.{l}.mlp, ...,
    #                                the constants last (blocks.{L}.attn_norm.bias of a LayerNorm, then "bias")
    terms: torch.Tensor            # (n, n) float64: terms[a, b] = the score's part from query-side a and key-side b
    score: float                   # the forward's own score (attn.scores before softmax)
    exact: bool                    # whether the block is linear once the norm is frozen (no q/k norm, no soft cap)
    why_inexact: str

    @property
    def total(self) -> float:
        return float(self.terms.sum())

    @property
    def remainder(self) -> float:
        return self.score - self.total

    def top_pairs(self, k: int = 15) -> list[dict]:
        flat = self.terms.flatten()
        order = flat.abs().argsort(descending=True)[:k]
        n = len(self.names)
        return [{"query side": self.names[int(t) // n], "key side": self.names[int(t) % n], "term": float(flat[t])}
                for t in order]

    def by_group(self) -> tuple[list[str], torch.Tensor]:
        """The terms summed per group (embed; each layer's heads together; each layer's MLP; bias): a map small
        enough to read, (groups, (g, g))."""
        groups = [_group(n) for n in self.names]
        labels = list(dict.fromkeys(groups))
        index = torch.tensor([labels.index(g) for g in groups])
        m = torch.zeros(len(labels), len(self.names), dtype=torch.float64)
        m.index_add_(0, index, self.terms)
        out = torch.zeros(len(labels), len(labels), dtype=torch.float64)
        out.index_add_(1, index, m)
        return labels, out

    def as_dict(self, k: int = 15) -> dict:
        labels, grouped = self.by_group()
        return {"layer": self.layer, "head": self.head, "query": self.query, "key": self.key, "score": self.score,
                "total": self.total, "remainder": self.remainder, "exact": self.exact,
                "why_inexact": self.why_inexact, "top_pairs": self.top_pairs(k),
                "groups": labels, "by_group": grouped.tolist()}


def _group(name: str) -> str:
    if name.startswith("blocks.") and ".attn.head." in name:
        return name.split(".attn.head.")[0] + ".attn"
    return name


def _inexact(model) -> str:
    cfg, lw = model.config, model.weights.layers
    reasons = []
    if any(w.q_norm is not None for w in lw):
        reasons.append("q/k norms (each a norm of its own, not frozen here)")
    if cfg.attn_softcap is not None:
        reasons.append("an attention soft cap (tanh of the score)")
    return "; ".join(reasons)


def qk_attribution(model, ids: list[int], layer: int, head: int, query: int, key: int) -> QKAttribution:
    cfg = model.config
    T = len(ids)
    if not 1 <= T <= MAX_POSITIONS:
        raise InputError(f"the QK attribution takes 1 to {MAX_POSITIONS:,} positions, got {T:,}")
    checks = (("layer", layer, cfg.num_layers - 1), ("head", head, cfg.num_heads - 1), ("query", query, T - 1))
    for what, v, hi in checks:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
            raise InputError(f"{what} must be a whole number in 0..{hi}, got {v!r}")
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key <= query:
        raise InputError(f"key must be a whole number in 0..{query} (a query attends to itself and before), "
                         f"got {key!r}")
    if cfg.layer_window[layer] is not None and query - key >= cfg.layer_window[layer]:
        raise InputError(f"layer {layer} attends within a window of {cfg.layer_window[layer]}: key {key} is outside "
                         f"query {query}'s")
    names = ["embed", "blocks.*.attn.z", "blocks.*.attn_out", "blocks.*.mlp_out", f"blocks.{layer}.attn.scores"]
    probe = Probe().capture(names[:4], positions=[query, key]).capture(names[4])
    model.forward(torch.tensor(ids), model.new_cache(T), probe)
    rows: dict[int, dict[str, torch.Tensor]] = {query: {}, key: {}}
    score = None
    for c in probe.recording.captures:
        if c.name == names[4]:
            score = float(c.value[head, query, key])
            continue
        for r, p in enumerate(c.positions):
            rows[p][c.name] = c.value[r].to(torch.float64)
    names_q, q_parts = dla.components(model, rows[query], layer, query)
    _, k_parts = dla.components(model, rows[key], layer, key)
    constants = ([f"blocks.{layer}.attn_norm.bias"] if model.weights.layers[layer].attn_norm_bias is not None
                 else []) + ["bias"]
    q = _project(model, q_parts, layer, head, query, T, "q")          # (n + c, hd): the components, the constants
    k = _project(model, k_parts, layer, head // (cfg.num_heads // cfg.num_kv_heads), key, T, "k")
    terms = attention_scores(q[None], k[None], cfg.attn_scale, None)[0]      # (n + c, m + c): scale * q . k
    why = _inexact(model)
    return QKAttribution(layer, head, query, key, names_q + constants, terms, score, not why, why)


def _normed(model, parts: torch.Tensor, layer: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Each part (n, d) through the attention norm frozen at the sum's scale (a LayerNorm's: each part centred
    first), and the norm's constant rows: [its bias (d,)] for a LayerNorm with one, else []."""
    lw = model.weights.layers[layer]
    if lw.attn_norm is None:
        return parts, []
    if dla.layer_norm(model):
        parts = parts - parts.mean(-1, keepdim=True)
    h = parts * dla.frozen_scale(model, parts.sum(0)) * lw.attn_norm.to(torch.float64)
    return h, [] if lw.attn_norm_bias is None else [lw.attn_norm_bias.to(torch.float64)]


def _project(model, parts: torch.Tensor, layer: int, head: int, pos: int, end: int, side: str) -> torch.Tensor:
    """Each part (n, d) through the attention norm frozen at the sum's scale, the head's (q) or KV head's (k)
    projection and RoPE at pos (the table a call ending at `end` reads) -> (n + c, hd): the components' rows, then
    the LayerNorm bias's (where the norm has one) and the projection bias's (zero without a bias)."""
    cfg, lw = model.config, model.weights.layers[layer]
    H, hd = cfg.num_heads, cfg.head_dim
    h, norm_bias = _normed(model, parts, layer)
    first = head * hd if side == "q" else (H + head) * hd
    w = lw.wqkv[:, first:first + hd].to(torch.float64)
    rows = torch.cat([h, *(b.unsqueeze(0) for b in norm_bias)])                  # (n + c - 1, d)
    out = torch.cat([rows @ w, torch.zeros(1, hd, dtype=torch.float64)])
    if lw.bqkv is not None:
        out[-1] = lw.bqkv[first:first + hd].to(torch.float64)
    kind = cfg.layer_rope[layer]
    if kind is not None:
        cos, sin = rope_tables(cfg, pos + 1, "cpu", torch.float64, table_for(cfg, kind, end))
        pairs = cfg.family.positions == "rope_interleaved"      # Cohere: adjacent dimensions rotate together
        out = rotate(out.unsqueeze(1), cos[pos:pos + 1].expand(out.shape[0], 1, -1),
                     sin[pos:pos + 1].expand(out.shape[0], 1, -1), pairs).squeeze(1)
    return out
