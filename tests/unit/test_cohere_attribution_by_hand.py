"""Explain and the QK attribution on a hand-built Cohere (one layer, d = 4, one head of 4 dimensions, attention
biases, logit_scale 0.25) whose attention and MLP output matrices are zero, so the stream at the last position is the
token's row + the attention output bias: every term is computed by hand from those vectors, through the bias-free
LayerNorm (centred, over the frozen sigma, times its weight: no bias term), Cohere's RoPE on adjacent pairs of
dimensions (2j, 2j + 1 at frequency theta^(-2j/4)), and the logits times logit_scale."""
from __future__ import annotations

import math

import pytest
import torch

from engine import load_model
from tests.unit.test_layernorm_by_hand import EPS as LN_EPS, normed

pytestmark = pytest.mark.unit
transformers = pytest.importorskip("transformers")
IDS = [5, 7, 9]
A, B = 11, 12
SCALE = 0.25          # logit_scale: the logits are the head's product times this
T = lambda *v: torch.tensor(v, dtype=torch.float64)     # noqa: E731
TOK = {5: T(1, 0, 2, -1), 7: T(0, 3, -1, 1), 9: T(2, -1, 0, 1), A: T(1, 2, 0, -1), B: T(-1, 0, 1, 1)}
# (values float32 holds exactly, so the hand computation in float64 starts from the model's own numbers)
BO = T(0.125, -0.25, 0.375, 0)
LN_F_W, LN_1_W = T(1, 2, 0.5, 1.5), T(1.5, 0.5, 1, 2)
EPS, THETA = LN_EPS, 10000.0     # the by-hand LayerNorm's epsilon (its normed: one definition)


@pytest.fixture(scope="module")
def toy(tmp_path_factory, tokenizer_files):
    out = tmp_path_factory.mktemp("toy") / "cohere-d4"
    cfg = transformers.AutoConfig.for_model(
        "cohere", vocab_size=49152, hidden_size=4, num_attention_heads=1, num_key_value_heads=1, intermediate_size=8,
        num_hidden_layers=1, max_position_embeddings=16, layer_norm_eps=EPS, logit_scale=SCALE, attention_bias=True,
        use_qk_norm=False, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": THETA},
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    m, g = hf.model, torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for i, row in TOK.items():
            m.embed_tokens.weight[i] = row.float()
        layer = m.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.self_attn.o_proj.bias.copy_(BO.float())
        layer.mlp.down_proj.weight.zero_()
        layer.input_layernorm.weight.copy_(LN_1_W.float())
        m.norm.weight.copy_(LN_F_W.float())
    hf.save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((tokenizer_files / f).read_bytes())
    return load_model(out, device="cpu", dtype="float32"), hf


def turned(v: torch.Tensor, pos: int) -> torch.Tensor:
    """v (4,) rotated at position pos by adjacent pairs: (v[2j], v[2j+1]) by the angle pos * THETA^(-2j/4)."""
    out = v.clone()
    for j in range(2):
        a = pos * THETA ** (-2 * j / 4)
        c, s = math.cos(a), math.sin(a)
        out[2 * j], out[2 * j + 1] = v[2 * j] * c - v[2 * j + 1] * s, v[2 * j + 1] * c + v[2 * j] * s
    return out


def test_each_explain_term_is_its_hand_computed_share(toy):
    from engine.tools.explain import explain_logits
    model, _ = toy
    e = explain_logits(model, IDS, A, B)
    parts = {"embed": TOK[9], "blocks.0.attn.bias": BO}
    x = sum(parts.values())
    u = (TOK[A] - TOK[B]) * SCALE                # tied head, then the logits times logit_scale
    for name, c in parts.items():
        assert e.contributions[name] == pytest.approx(float(normed(c, x, LN_F_W) @ u), abs=1e-6), name
    assert e.contributions["blocks.0.attn.head.0"] == 0.0 and e.contributions["blocks.0.mlp"] == 0.0
    assert set(e.contributions) == {*parts, "blocks.0.attn.head.0", "blocks.0.mlp"}     # no norm bias to own
    assert abs(e.residual_error) <= 1e-5 and e.exactness.startswith("exact")


def test_each_qk_term_is_its_hand_computed_share_through_adjacent_pairs(toy):
    """Layer 0, query 2, key 1: the stream entering it is the token's row; q and k are that row through
    input_layernorm (frozen at each position) and the head's q_proj / k_proj rows, plus their biases, each turned by
    adjacent pairs at its position (the half-split turn gives other numbers: pairs (0, 2), (1, 3))."""
    from engine.tools.qk_attribution import qk_attribution
    model, hf = toy
    r = qk_attribution(model, IDS, 0, 0, 2, 1)
    assert r.names == ["embed", "bias"]
    attn = hf.model.layers[0].self_attn
    wq, wk = attn.q_proj.weight.detach().double(), attn.k_proj.weight.detach().double()
    bq, bk = attn.q_proj.bias.detach().double(), attn.k_proj.bias.detach().double()
    q = {"embed": turned(wq @ normed(TOK[9], TOK[9], LN_1_W), 2), "bias": turned(bq, 2)}
    k = {"embed": turned(wk @ normed(TOK[7], TOK[7], LN_1_W), 1), "bias": turned(bk, 1)}
    for i, a in enumerate(r.names):
        for j, b in enumerate(r.names):
            # the engine's tables are float32's cos and sin (as transformers'), cast to float64 exactly: the angle
            # pos * theta^(-2j/4) rounds twice (<= 2u |angle| <= 4u here, u = 2^-24, angles <= 2) and cos / sin once
            # (u), so each turned entry is off by <= 5u times its pair's |v| sum and the dot product by <= 2 * 5u
            # |q|_1 |k|_1 (first order): bound 12u of it, times the head's scale
            bound = 0.5 * 12 * 2.0 ** -24 * float(q[a].abs().sum() * k[b].abs().sum())
            assert abs(float(r.terms[i, j]) - 0.5 * float(q[a] @ k[b])) <= bound, (a, b)
    assert abs(r.remainder) <= 1e-5 * max(1.0, abs(r.score)) and r.exact
