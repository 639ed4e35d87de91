"""Why a head attends where it does: one pre-softmax attention score split into query-side x key-side components.

The score of head h at layer L, query position i, key position j is scale * q_i . k_j, where q_i = RoPE_i(W_q,h^T
(s_i w ⊙ x_i)) (+ RoPE_i(b_q,h)) and k_j likewise with head h's KV head, x_p the residual stream entering block L at
position p and s_p the attention norm's scale there. With s_i and s_j frozen at their values (as Explain freezes the
final norm), q and k are linear in x, and x_p is the sum of the embedding, every earlier head and every earlier MLP
(engine.tools.dla.layer_parts), so the score is exactly the sum over pairs (a query-side component, a key-side
component) of scale * q(a) . k(b), plus bias terms. The terms are summed in float64 and set against the score the
forward computed (its attn.scores stage): the remainder is the forward's own float32 rounding for Llama-style
blocks. Where a block is not linear in its input once the norm is frozen (a q/k norm, an attention soft cap), the
split cannot be exact: the report says so and shows the remainder it leaves.

Entry point: qk_attribution(model, ids, layer, head, query, key) -> QKAttribution."""
from __future__ import annotations

from dataclasses import dataclass

import torch

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
    names: list[str]               # the components, both sides: embed, blocks.{l}.attn.head.{h}, blocks.{l}.mlp, bias
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
    if cfg.family.norm != "rms" or cfg.parallel_residual:
        # a LayerNorm centres the stream and adds its bias, and these blocks add output biases no head owns: the
        # split would need those as terms of their own (as Explain, it is refused rather than called exact)
        raise InputError(f"the QK attribution is not implemented for {cfg.model_type}'s LayerNorm blocks yet; the "
                         "rest of the Attention page works on this model")
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
    q_parts, names_q = _side(model, rows[query], layer)
    k_parts, _ = _side(model, rows[key], layer)
    q = _project(model, q_parts, layer, head, query, T, "q")          # (n + 1, hd): the components, then the bias
    k = _project(model, k_parts, layer, head // (cfg.num_heads // cfg.num_kv_heads), key, T, "k")
    terms = cfg.attn_scale * (q @ k.T)
    why = _inexact(model)
    return QKAttribution(layer, head, query, key, names_q + ["bias"], terms, score, not why, why)


def _side(model, got: dict[str, torch.Tensor], layer: int) -> tuple[torch.Tensor, list[str]]:
    """The stream entering block `layer` at one position as its components (n, d) float64, and their names."""
    parts, names = [got["embed"]], ["embed"]
    for i in range(layer):
        heads, mlp = dla.layer_parts(model, got, i)
        parts += list(heads) + [mlp]
        names += [f"blocks.{i}.attn.head.{h}" for h in range(heads.shape[0])] + [f"blocks.{i}.mlp"]
    return torch.stack(parts), names


def _project(model, parts: torch.Tensor, layer: int, head: int, pos: int, end: int, side: str) -> torch.Tensor:
    """Each part (n, d) through the attention norm frozen at the sum's scale, the head's (q) or KV head's (k)
    projection and RoPE at pos (the table a call ending at `end` reads) -> (n + 1, hd), the last row the bias's share
    (zero without a bias)."""
    cfg, lw = model.config, model.weights.layers[layer]
    H, K, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = parts.sum(0)
    h = parts
    if lw.attn_norm is not None:
        h = parts * torch.rsqrt(x.pow(2).mean() + cfg.rms_norm_eps) * lw.attn_norm.to(torch.float64)
    first = head * hd if side == "q" else (H + head) * hd
    w = lw.wqkv[:, first:first + hd].to(torch.float64)
    out = torch.cat([h @ w, torch.zeros(1, hd, dtype=torch.float64)])
    if lw.bqkv is not None:
        out[-1] = lw.bqkv[first:first + hd].to(torch.float64)
    kind = cfg.layer_rope[layer]
    if kind is not None:
        cos, sin = rope_tables(cfg, pos + 1, "cpu", torch.float64, table_for(cfg, kind, end))
        out = rotate(out.unsqueeze(1), cos[pos:pos + 1].expand(out.shape[0], 1, -1),
                     sin[pos:pos + 1].expand(out.shape[0], 1, -1)).squeeze(1)
    return out
