"""Every page opens on a GPT-2, a GPT-NeoX, a StarCoder 2 and a Cohere run (AppTest, tiny transformers-made models
from the reference tier's configs): no exception, no error; Explain and the Attention page's score split show their
numbers through the LayerNorm blocks, and those numbers add up to the forward's own (logit difference, pre-softmax
score)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import Probe, load_model
from engine.tools import dla
from inspector.ui.state import session_of
from tests.app.test_app_explain import metric
from tests.app.test_app_pages_a import arr, chart
from tests.unit.test_family_kv_cache import family_run

PAGES = ("overview", "tokens", "attention", "activations", "kv_cache", "sampling", "timeline", "debugger",
         "repetition", "nan_doctor", "compare", "quantization", "trace_files")


@pytest.fixture(scope="module", params=["gpt2", "gpt_neox", "starcoder2", "cohere"])
def classic_run(request, tmp_path_factory, tokenizer_files):
    from tests.reference.family_models import build
    folder = build(request.param, tmp_path_factory.mktemp("classic") / request.param, tokenizer_files)
    model = load_model(folder, device="cpu", dtype="float32")
    return model, folder, family_run(model)


@pytest.mark.parametrize("name", PAGES)
def test_every_page_opens_on_the_classic_families(page, classic_run, name):
    model, folder, run = classic_run
    at = page(name, run, model, str(folder)).run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    if name == "overview":      # the page is about this model, and says what its family changes
        text = " ".join(str(e.value) for e in [*at.markdown, *at.caption])
        assert ("learned vectors" in text) == (model.config.model_type == "gpt2") and (
            "parallel residual" in text) == model.config.parallel_residual and (
            "adjacent pairs" in text) == (model.config.model_type == "cohere")


U = 2.0 ** -24        # float32's unit roundoff


def gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative bound on n float32 roundings in a row (a length-n sum)."""
    return n * U / (1 - n * U)


def head_in_float64(model, e) -> tuple[float, float, float]:
    """(the logit difference the float64 head gives on the forward's own float32 final stream at e's position, the
    bound on what the float32 parts lose against that stream, the bound on the forward's float32 head's rounding).

    The parts are the forward's float32 pieces of the stream (embed, z, mlp_out, captured), each head's recomputed in
    float64 from z: they differ from the final stream only by the forward's roundings of the residual adds (2L + 1 a
    dimension) and of the attention output's H hd-term products, so |sum - head64| <= gamma(H hd + 2L + 2) sum_j
    |u_j| S_j, u the centred direction, S_j the sum of the parts' magnitudes (|z| |wo| for the attention). The
    forward's own head rounds the LayerNorm (mean: d adds; centring, variance: d + 1, first order in the mean's
    error; scale and bias: 4) and each logit's d-term product: |forward - head64| <= sum_j (|W_ja| + |W_jb|)
    (gamma(2d + 8) (|b_j| + |g_j| s (|x_j - mean| + mean|x|)) + gamma(d + 1) |h_j|) / divisor."""
    cfg, w, L, T = model.config, model.weights, model.config.num_layers, len(e.ids)
    probe = Probe().capture(["embed", "blocks.*.attn.z", "blocks.*.mlp_out", f"blocks.{L - 1}.resid_post"],
                            positions=[T - 1])
    model.logits(e.ids, probe)
    got = {c.name: c.value[-1].double() for c in probe.recording.captures}
    x = got[f"blocks.{L - 1}.resid_post"]
    s, g = dla.frozen_scale(model, x), w.norm.double()
    b = torch.zeros_like(x) if w.norm_bias is None else w.norm_bias.double()
    h = (x - x.mean()) * s * g + b
    cols = w.lm_head[:, [e.target, e.versus]].double()
    head64 = float(h @ (cols[:, 0] - cols[:, 1])) / cfg.logits_divisor
    if w.head_bias is not None:
        head64 += float(w.head_bias[e.target] - w.head_bias[e.versus]) / cfg.logits_divisor
    mag = got["embed"].abs()
    for i, lw in enumerate(w.layers):
        wo = lw.wo.double().abs().view(cfg.num_heads, cfg.head_dim, -1)
        mag = mag + torch.einsum("hk,hkd->d", got[f"blocks.{i}.attn.z"].abs(), wo) + got[f"blocks.{i}.mlp_out"].abs()
        if lw.bo is not None:
            mag = mag + lw.bo.double().abs()
    u, _ = dla.direction(model, x, e.target, e.versus)
    parts_bound = gamma(cfg.num_heads * cfg.head_dim + 2 * L + 2) * float(u.abs() @ mag)
    d, xc = x.shape[0], (x - x.mean()).abs()
    per_dim = gamma(2 * d + 8) * (b.abs() + g.abs() * s * (xc + x.abs().mean())) + gamma(d + 1) * h.abs()
    head_bound = float(per_dim @ cols.abs().sum(1)) / cfg.logits_divisor
    return head64, parts_bound, head_bound


def test_explain_splits_the_logit_difference_through_the_layernorm(page, classic_run):
    """Step 0 of the run: the page's difference is the engine's logits' own (computed here apart); the parts sum to the
    float64 head on the forward's own final stream (to the parts' rounding bound), and to the forward's difference to
    that bound plus the forward's head's own float32 rounding (logits near 30 round by 2e-6 each: not six decimals);
    the page shows both numbers and their remainder, and calls the split exact. The final norm's bias is a row of its
    own exactly where the family's final norm has a bias (Cohere's LayerNorm has none)."""
    model, folder, run = classic_run
    at = page("explain", run, model, str(folder)).run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    logits = model.logits(run.result.prompt_ids)[-1]
    a = run.result.token_ids[0]
    b = int(logits.topk(2).indices[1]) if int(logits.argmax()) == a else int(logits.argmax())
    want = float(logits[a] - logits[b])     # a full forward here, the page's a last-row one: fp32 rounding apart
    bound = 1e-4 * max(1.0, abs(want))
    assert metric(at, "logit(A) − logit(B)") == pytest.approx(want, abs=bound)
    e = list(session_of(at.session_state).memos["explain_memo"].values())[-1]
    head64, parts_bound, head_bound = head_in_float64(model, e)
    assert abs(e.total - head64) <= parts_bound, (e.total, head64, parts_bound)
    assert abs(e.residual_error) <= parts_bound + head_bound, (e.residual_error, parts_bound, head_bound)
    assert metric(at, "Sum of contributions") == pytest.approx(round(e.total, 6), abs=1e-12)
    assert metric(at, "logit(A) − logit(B)") == pytest.approx(round(e.logit_diff, 6), abs=1e-12)
    assert metric(at, "Residual error") == pytest.approx(float(f"{e.residual_error:.1e}"), abs=1e-15)
    assert any(c.value.startswith("Decomposition exact") for c in at.caption)
    assert ("final_norm.bias" in e.contributions) == (model.weights.norm_bias is not None) == (
        model.config.model_type != "cohere")


def test_the_attention_page_splits_a_score_through_the_layernorm(page, classic_run):
    """Head 1 of layer 1, the last query to key 2 (StarCoder 2's window on every layer: the earliest key inside it):
    the map's cells sum to the score the page states, which is the forward's own (its attn.scores stage, captured
    here)."""
    model, folder, run = classic_run
    at = page("attention", run, model, str(folder)).run()
    ids = session_of(at.session_state).run.ids
    window = model.config.layer_window[1]
    key = 2 if window is None else max(2, len(ids) - window)
    at.selectbox(key="att_layer").set_value(1)
    at.selectbox(key="att_head").set_value(1).run()
    at.number_input(key="qk_key").set_value(key)
    at.button(key="qk_run").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    probe = Probe().capture("blocks.1.attn.scores")
    model.logits(ids, probe)
    score = float(probe.recording.captured("blocks.1.attn.scores")[0].value[1, len(ids) - 1, key])
    total = float(np.sum(arr(chart(at, "qk_map")["data"][0]["z"])))
    assert abs(total - score) <= 1e-4 * max(1.0, abs(score))
    assert any(f"Score {score:.5g}" in c.value and "exact" in c.value for c in at.caption)
