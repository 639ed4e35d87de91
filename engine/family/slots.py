"""The per-layer weight slots of every family: the one list that weight loading, probes' weight overrides, precision
plans, the native step, quantisation, the bench and the NaN doctor derive theirs from.

A slot is a field of engine.weights.LayerWeights. A family fills the slots its block has (engine.family.declared);
the others stay None, and the block reads which are there (a post-norm slot present = a post-norm computed)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    field: str        # LayerWeights attribute
    probe: str        # the weight's name under blocks.{i}. for a probe's weight override
    unit: str         # the half-block it belongs to: "attn" or "mlp" (precision plans, variants)
    kind: str         # "norm" (d,) or (hd,) vector, "matrix" (in, out), "bias", "router" (d, E), "experts" (E, in, out)


SLOTS: tuple[Slot, ...] = (
    Slot("attn_norm", "attn_norm.weight", "attn", "norm"),
    Slot("attn_norm_bias", "attn_norm.bias", "attn", "bias"),   # (d,) LayerNorm's
    Slot("wqkv", "attn.wqkv", "attn", "matrix"),            # (d, (H + 2K) hd): q heads, k heads, v heads
    Slot("bqkv", "attn.bqkv", "attn", "bias"),              # ((H + 2K) hd,)
    Slot("q_norm", "attn.q_norm.weight", "attn", "norm"),   # (hd,) per head, or (H hd,) over the projection
    Slot("k_norm", "attn.k_norm.weight", "attn", "norm"),   # (hd,) or (K hd,)
    Slot("wo", "attn.wo", "attn", "matrix"),                # (H hd, d)
    Slot("bo", "attn.bo", "attn", "bias"),                  # (d,)
    Slot("attn_post_norm", "attn_post_norm.weight", "attn", "norm"),
    Slot("mlp_norm", "mlp_norm.weight", "mlp", "norm"),
    Slot("mlp_norm_bias", "mlp_norm.bias", "mlp", "bias"),  # (d,) LayerNorm's
    Slot("w_gate_up", "mlp.w_gate_up", "mlp", "matrix"),    # (d, 2F): gate columns, then up
    Slot("w_up", "mlp.w_up", "mlp", "matrix"),              # (d, F): a plain MLP's
    Slot("b_up", "mlp.b_up", "mlp", "bias"),                # (F,)
    Slot("w_down", "mlp.w_down", "mlp", "matrix"),          # (F, d)
    Slot("b_down", "mlp.b_down", "mlp", "bias"),            # (d,)
    Slot("router", "mlp.router", "mlp", "router"),          # (d, E)
    Slot("experts_gate_up", "mlp.experts.w_gate_up", "mlp", "experts"),   # (E, d, 2Fe)
    Slot("experts_down", "mlp.experts.w_down", "mlp", "experts"),         # (E, Fe, d)
    Slot("mlp_post_norm", "mlp_post_norm.weight", "mlp", "norm"),
)
BY_FIELD = {s.field: s for s in SLOTS}
BY_PROBE = {s.probe: s for s in SLOTS}
FIELDS = tuple(s.field for s in SLOTS)
MATRICES = tuple(s.field for s in SLOTS if s.kind == "matrix")      # the dense 2-D products of a block
UNIT_FIELDS = {u: tuple(s.field for s in SLOTS if s.unit == u) for u in ("attn", "mlp")}
GLOBAL_WEIGHTS = ("embed.weight", "final_norm.weight", "lm_head.weight")


def probe_weight_names() -> tuple[str, ...]:
    """Every weight a probe may override: the global ones and blocks.{i}.<slot>."""
    return GLOBAL_WEIGHTS + tuple(f"blocks.{{i}}.{s.probe}" for s in SLOTS)
