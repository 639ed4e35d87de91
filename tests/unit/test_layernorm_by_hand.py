"""Explain and the QK attribution through a LayerNorm, on a hand-built GPT-2 (one layer, d = 4, one head) whose
attention and MLP output matrices are zero, so the stream at every position is the token's row + its position's
row + the attention output bias + the MLP output bias, all set here: every term can be computed by hand from those
vectors (centred, over the frozen sigma, times the norm's weight; the norm's bias alone), and is."""
from __future__ import annotations

import pytest
import torch

from engine import load_model

pytestmark = pytest.mark.unit
transformers = pytest.importorskip("transformers")
IDS = [5, 7, 9]
A, B = 11, 12
T = lambda *v: torch.tensor(v, dtype=torch.float64)     # noqa: E731
TOK = {5: T(1, 0, 2, -1), 7: T(0, 3, -1, 1), 9: T(2, -1, 0, 1), A: T(1, 2, 0, -1), B: T(-1, 0, 1, 1)}
POS = [T(0.5, 0, 0, -0.5), T(0, 1, -1, 0), T(0.25, -0.5, 1, 0)]
# (values float32 holds exactly, so the hand computation in float64 starts from the model's own numbers)
BO, B_DOWN = T(0.125, -0.25, 0.375, 0), T(0, 0.5, -0.125, 0.25)
LN_F_W, LN_F_B = T(1, 2, 0.5, 1.5), T(0.375, -0.125, 0.25, 0.5)
LN_1_W, LN_1_B = T(1.5, 0.5, 1, 2), T(-0.25, 0.125, 0.375, 0.0625)
EPS = 1e-5


@pytest.fixture(scope="module")
def toy(tmp_path_factory, tokenizer_files):
    out = tmp_path_factory.mktemp("toy") / "gpt2-d4"
    cfg = transformers.AutoConfig.for_model("gpt2", vocab_size=49152, n_embd=4, n_head=1, n_layer=1, n_positions=16,
                                            n_inner=8, layer_norm_epsilon=EPS, tie_word_embeddings=True)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    t, g = hf.transformer, torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for i, row in TOK.items():
            t.wte.weight[i] = row.float()
        t.wpe.weight[:3] = torch.stack(POS).float()
        h = t.h[0]
        h.attn.c_proj.weight.zero_()
        h.attn.c_proj.bias.copy_(BO.float())
        h.mlp.c_proj.weight.zero_()
        h.mlp.c_proj.bias.copy_(B_DOWN.float())
        h.ln_1.weight.copy_(LN_1_W.float())
        h.ln_1.bias.copy_(LN_1_B.float())
        t.ln_f.weight.copy_(LN_F_W.float())
        t.ln_f.bias.copy_(LN_F_B.float())
    hf.save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((tokenizer_files / f).read_bytes())
    return load_model(out, device="cpu", dtype="float32"), hf


def normed(c: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A part c of the stream x through the LayerNorm with its sigma frozen at x's: (c - mean(c)) / sigma * w."""
    return (c - c.mean()) / torch.sqrt(x.var(unbiased=False) + EPS) * w


def test_each_explain_term_is_its_hand_computed_share(toy):
    from engine.tools.explain import explain_logits
    model, _ = toy
    e = explain_logits(model, IDS, A, B)
    parts = {"embed": TOK[9], "positions": POS[2], "blocks.0.attn.bias": BO, "blocks.0.mlp": B_DOWN}
    x = sum(parts.values())
    u = TOK[A] - TOK[B]                          # tied head: the columns of A and B are their embeddings
    for name, c in parts.items():
        assert e.contributions[name] == pytest.approx(float(normed(c, x, LN_F_W) @ u), abs=1e-6), name
    assert e.contributions["final_norm.bias"] == pytest.approx(float(LN_F_B @ u), abs=1e-6)   # b · (W_A - W_B)
    assert e.contributions["blocks.0.attn.head.0"] == 0.0          # its output matrix is zero
    assert e.attn(0) == pytest.approx(e.contributions["blocks.0.attn.bias"], abs=1e-12)
    assert set(e.contributions) == {*parts, "blocks.0.attn.head.0", "final_norm.bias"}
    assert e.norm_scale == pytest.approx(float(1 / torch.sqrt(x.var(unbiased=False) + EPS)), rel=1e-6)
    assert abs(e.residual_error) <= 1e-5 and e.exactness.startswith("exact")


def test_each_qk_term_is_its_hand_computed_share(toy):
    """Layer 0, query 2, key 1: the stream is the token's row + its position's; q and k are those parts through ln_1
    (frozen at each position) and the head's columns of c_attn, plus ln_1's bias and c_attn's bias through them."""
    from engine.tools.qk_attribution import qk_attribution
    model, hf = toy
    r = qk_attribution(model, IDS, 0, 0, 2, 1)
    assert r.names == ["embed", "positions", "blocks.0.attn_norm.bias", "bias"]
    w = hf.transformer.h[0].attn.c_attn.weight.detach().double()         # Conv1D (d, 3d): columns q | k | v
    bqkv = hf.transformer.h[0].attn.c_attn.bias.detach().double()
    bq, bk = bqkv[:4], bqkv[4:8]
    xq, xk = TOK[9] + POS[2], TOK[7] + POS[1]
    q = {"embed": normed(TOK[9], xq, LN_1_W), "positions": normed(POS[2], xq, LN_1_W)}
    k = {"embed": normed(TOK[7], xk, LN_1_W), "positions": normed(POS[1], xk, LN_1_W)}
    q, k = ({n: v @ w[:, off:off + 4] for n, v in side.items()} for side, off in ((q, 0), (k, 4)))
    q["blocks.0.attn_norm.bias"], k["blocks.0.attn_norm.bias"] = LN_1_B @ w[:, :4], LN_1_B @ w[:, 4:8]
    q["bias"], k["bias"] = bq, bk
    for i, a in enumerate(r.names):
        for j, b in enumerate(r.names):
            assert float(r.terms[i, j]) == pytest.approx(0.5 * float(q[a] @ k[b]), rel=1e-9, abs=1e-12), (a, b)
    assert abs(r.remainder) <= 1e-5 * max(1.0, abs(r.score)) and r.exact


def test_the_explain_views_show_every_term_and_end_at_the_sum(toy):
    """The page's table has a row for each term (the positions and the biases included, each named), and the
    layer figure's running total, through the terms that are no layer's, ends at the sum of them all."""
    from engine.tools.explain import explain_logits
    from inspector.views import explain as xv
    model, _ = toy
    e = explain_logits(model, IDS, A, B)
    df = xv.contributions_frame(e)
    assert list(df["component"]) == list(e.contributions)
    assert dict(zip(df["component"], df["kind"])) == {
        "embed": "embedding", "positions": "positions", "blocks.0.attn.head.0": "attention head",
        "blocks.0.attn.bias": "L0 attn bias", "blocks.0.mlp": "MLP", "final_norm.bias": "final norm bias"}
    assert float(df["contribution"].sum()) == pytest.approx(e.total, abs=1e-12)
    line = xv.layer_figure(e).data[-1]
    assert list(line.x) == ["positions", "0", "final norm bias"]
    assert line.y[-1] == pytest.approx(e.total, abs=1e-12)
