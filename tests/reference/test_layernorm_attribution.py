"""Explain and the QK attribution through LayerNorm blocks (GPT-2, GPT-NeoX parallel and sequential, Phi, StableLM
with and without q/k/v biases, StarCoder 2 with and without its biases and window, Cohere's bias-free LayerNorm with
interleaved RoPE and logit_scale, with and without attention biases) against transformers on tiny random-weight
models it builds: the logit attribution's terms (centred parts through the frozen final LayerNorm, its bias where it
has one, Phi's head bias, each layer's attention output bias, GPT-2's learned positions) sum to the logit difference
transformers computes, and the query-side x key-side terms sum to the pre-softmax score transformers' attention
computes (captured by an attention function registered here, with sdpa's masks, in float64), and to the engine's own
(its attn.scores stage)."""
from __future__ import annotations

import pytest
import torch

from engine import Probe, load_model
from engine.tools import dla
from tests.reference.family_models import build

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.reference
FAMILIES = ("gpt2", "gpt_neox", "gpt_neox-sequential", "phi", "stablelm", "stablelm-qkv-bias", "starcoder2",
            "starcoder2-no-bias", "cohere", "cohere-bias")
WITH_BO = ("gpt2", "gpt_neox", "gpt_neox-sequential", "phi", "starcoder2", "cohere-bias")   # attention output bias
PROMPT = [int(t) for t in torch.randint(3, 49000, (24,), generator=torch.Generator().manual_seed(11))]
REL = 1e-4           # the bound, relative to the size of what is split (at least 1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer_files):
    root = tmp_path_factory.mktemp("layernorm")
    return {name: build(name, root / name, tokenizer_files) for name in FAMILIES}


def hf_run(folder, ids: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """transformers' float64 logits (T, V) of ids and each layer's pre-softmax scores (H, T, T), recorded by an
    attention function that computes them from the query and key it is handed (after RoPE) and then attends as sdpa."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    scores: dict[int, torch.Tensor] = {}

    def record(module, query, key, value, attention_mask, scaling=None, **kw):
        keys = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        scores[module.layer_idx] = (query @ keys.transpose(-1, -2))[0] * scale
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kw)

    AttentionInterface.register("record_scores", record)
    # and sdpa's masks: a function registered without a mask of its own gets no sliding window (StarCoder 2's)
    AttentionMaskInterface.register("record_scores", sdpa_mask)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64,
                                                           attn_implementation="record_scores").eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    return logits, scores


@pytest.mark.parametrize("name", FAMILIES)
def test_explain_terms_sum_to_transformers_logit_difference(folders, name):
    from engine.tools.explain import explain_logits
    model = load_model(folders[name], device="cpu", dtype="float32")
    ref, _ = hf_run(folders[name], PROMPT)
    last = ref[-1]
    tenth = int(torch.topk(last, 10).indices[-1])
    for versus in (None, tenth):
        e = explain_logits(model, PROMPT, versus=versus)
        want = float(last[e.target] - last[e.versus])
        assert abs(e.total - want) <= REL * max(1.0, abs(want)), (name, e.total, want)
        assert abs(e.residual_error) <= REL * max(1.0, abs(e.logit_diff)) and e.exactness.startswith("exact")
    w, lw = model.weights, model.weights.layers[0]
    terms = set(e.contributions)
    assert ("positions" in terms) == (name == "gpt2")
    # Cohere's LayerNorm has no bias: no term for it (its checkpoint has no final norm bias either)
    assert ("final_norm.bias" in terms) == (w.norm_bias is not None) == (not name.startswith("cohere"))
    assert ("lm_head.bias" in terms) == (name == "phi") and ("blocks.0.attn.bias" in terms) == (lw.bo is not None)
    assert (lw.bo is not None) == (name in WITH_BO)
    assert w.norm_bias is None or e.contributions["final_norm.bias"] != 0.0
    if name == "phi":           # the head bias's term is the checkpoint's own lm_head.bias[A] - lm_head.bias[B]
        from safetensors.torch import load_file
        hb = load_file(str(folders[name] / "model.safetensors"))["lm_head.bias"].double()
        assert e.contributions["lm_head.bias"] == pytest.approx(float(hb[e.target] - hb[e.versus]), rel=1e-12)
    # each layer's attention share is its heads and its bias: the share of attn_out itself, frozen and centred
    probe = Probe().capture("blocks.*.attn_out", positions=[len(PROMPT) - 1])
    model.logits(PROMPT, probe)
    cols = w.lm_head[:, [e.target, e.versus]].double()
    u = e.norm_scale * w.norm.double() * (cols[:, 0] - cols[:, 1]) / model.config.logits_divisor   # Cohere: x scale
    for c in probe.recording.captures:
        out = c.value[-1].double()
        i = int(c.name.split(".")[1])
        assert e.attn(i) == pytest.approx(float((out - out.mean()) @ u), rel=1e-6, abs=1e-6)
    assert dla.layer_norm(model)


@pytest.mark.parametrize("name", FAMILIES)
def test_qk_terms_sum_to_transformers_pre_softmax_score(folders, name):
    from engine.tools.qk_attribution import qk_attribution
    model = load_model(folders[name], device="cpu", dtype="float32")
    _, scores = hf_run(folders[name], PROMPT)
    L, H = model.config.num_layers - 1, model.config.num_heads - 1
    window = model.config.layer_window[L]       # StarCoder 2's on every layer (8): key 0 is outside query 23's
    for layer, head, q, k in ((0, 0, 9, 4), (1, 1, 20, 15), (L, H, 23, 23), (L, 2, 23, 0 if window is None else 16)):
        r = qk_attribution(model, PROMPT, layer, head, q, k)
        want = float(scores[layer][head, q, k])
        size = max(1.0, abs(want))
        assert r.exact and abs(r.total - want) <= REL * size, (name, layer, head, q, k, r.total, want)
        assert abs(r.score - want) <= REL * size and r.remainder == r.score - r.total
        lw = model.weights.layers[layer]
        norm_bias = f"blocks.{layer}.attn_norm.bias"
        assert r.names[-1] == "bias" and (norm_bias in r.names) == (lw.attn_norm_bias is not None) == (
            not name.startswith("cohere"))
        assert ("positions" in r.names) == (name == "gpt2")
        assert bool((r.terms[-1] == 0).all()) == (lw.bqkv is None) == (
            name in ("stablelm", "starcoder2-no-bias", "cohere"))
        if lw.attn_norm_bias is not None:
            # the norm's bias pairs with every component of the other side: its row and column are filled (but for
            # the projection bias's pair, zero where the projection has no bias)
            n, filled = r.names.index(norm_bias), slice(0, -1 if lw.bqkv is None else None)
            assert r.names[n + 1:] == ["bias"]
            assert bool((r.terms[n, filled] != 0).all()) and bool((r.terms[filled, n] != 0).all())
