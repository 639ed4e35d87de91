"""Every family against transformers on a tiny random-weight model that transformers builds from a config: fp32
logits at every position (prefill, and prefill then one token at a time through the cache, past every window), 12
greedy tokens, bf16 within a stated tolerance, and the native decode step only where the allow-list admits it."""
from __future__ import annotations

import math

import pytest
import torch

from engine import load_model
from engine.accelerator import PLAIN
from engine.generate import generate
from engine.native import build as native_build
from engine.native.step import NativeDecoder
from tests.reference.family_models import CASES, WINDOW, build

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.reference
PROMPT = [int(t) for t in torch.randint(3, 49000, (40,), generator=torch.Generator().manual_seed(7))]
NATIVE = {"llama3", "mistral-window", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "phi3-longrope",
          "granite", "smollm3", "olmo2", "gpt2", "gpt2-odd", "stablelm", "stablelm-qkv-bias", "phi", "starcoder2",
          "starcoder2-no-bias", "cohere", "cohere-bias", "gpt_neox", "gpt_neox-sequential", "mixtral",
          "qwen3_moe"}   # engine.native.step's


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer_files):
    root = tmp_path_factory.mktemp("families")
    return {name: build(name, root / name, tokenizer_files) for name in CASES}


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the largest logit."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def hf_stepped(ref, split: int) -> torch.Tensor:
    """transformers' logits for PROMPT through its own cache: a prefill of `split` tokens, then one at a time (where
    longrope switches tables once the sequence passes its original length, the two ways differ, in both engines)."""
    with torch.no_grad():
        out = ref(torch.tensor([PROMPT[:split]]), use_cache=True)
        rows, past = [out.logits[0]], out.past_key_values
        for t in PROMPT[split:]:
            out = ref(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            rows.append(out.logits[0])
            past = out.past_key_values
    return torch.cat(rows)


@pytest.mark.parametrize("name", list(CASES))
def test_family_logits_and_greedy_tokens_equal_transformers(folders, name, monkeypatch):
    """...and where the allow-list admits the family (with a native library built here), every decode step of the
    stepped run goes native, none handed back to the PyTorch forward (spied)."""
    d = folders[name]
    statuses, real = [], NativeDecoder.__call__

    def spy(self, *a, **k):
        out = real(self, *a, **k)
        statuses.append(out[2])
        return out
    monkeypatch.setattr(NativeDecoder, "__call__", spy)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    ours = load_model(d, device="cpu", dtype="float32")
    assert len(PROMPT) > WINDOW
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    assert rel(ours.logits(PROMPT), want) <= 1e-4
    want_stepped = hf_stepped(ref, 12)
    for model in (ours, ours.with_accelerator(PLAIN)):      # the native step (where admitted) and the PyTorch forward
        cache = model.new_cache(len(PROMPT))
        stepped = torch.cat([model.forward(torch.tensor(PROMPT[:12]), cache)]
                            + [model.forward(torch.tensor([t]), cache) for t in PROMPT[12:]])
        assert rel(stepped, want_stepped) <= 1e-4
    assert (ours.accelerator.decode is not None) == (name in NATIVE and native_build.load()[0] is not None), \
        ours.accelerator.why_not
    assert statuses == ([0] * (len(PROMPT) - 12) if ours.accelerator.decode is not None else [])
    with torch.no_grad():
        hf_tokens = ref.generate(torch.tensor([PROMPT[:20]]), max_new_tokens=12, do_sample=False,
                                 attention_mask=torch.ones(1, 20, dtype=torch.long), pad_token_id=0,
                                 eos_token_id=None)[0, 20:].tolist()
    result = generate(ours, PROMPT[:20], max_new_tokens=12, ignore_eos=True)
    assert result.token_ids == hf_tokens


@pytest.mark.parametrize("name", ["qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "phi3", "granite", "mixtral",
                                  "qwen3_moe", "gpt2", "gpt_neox", "stablelm", "stablelm-qkv-bias", "phi",
                                  "starcoder2", "starcoder2-no-bias", "cohere", "cohere-bias"])
def test_family_bf16_within_tolerance_of_fp32(folders, name):
    """bf16 (8 bits of mantissa) against transformers' fp32: every position within 5% of the largest logit, or within
    1.25x transformers' own bf16 error where that is larger (Gemma 2's soft caps squeeze the logits to +-3, so the
    same absolute rounding is a larger share of the largest one: 8.4% here against transformers' 9.0%). With
    experts, a row whose router meets a near tie may pick another expert in bf16 (transformers' own bf16 does too):
    there at most one row in eight is past 5%, and the median row stays within 2%."""
    d = folders[name]
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    got = load_model(d, device="cpu", dtype="bfloat16").logits(PROMPT)
    rows = (got.float() - want).abs().max(-1).values / want.abs().max()
    if not load_model(d, device="cpu", dtype="float32").config.num_experts:
        hf16 = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16).eval()
        with torch.no_grad():
            theirs = rel(hf16(torch.tensor([PROMPT])).logits[0], want)
        assert float(rows.max()) <= max(0.05, 1.25 * theirs)
    else:
        assert float((rows > 0.05).float().mean()) <= 1 / 8 and float(rows.median()) <= 0.02


def test_window_layers_cache_only_their_window(folders):
    """Gemma 3's local layers hold WINDOW rows however long the run; its global layer holds every position."""
    m = load_model(folders["gemma3_text"], device="cpu", dtype="float32")
    cache = m.new_cache(64)
    m.forward(torch.tensor(PROMPT), cache)
    per_layer = cache.layer_bytes()
    row = 2 * m.config.num_kv_heads * m.config.head_dim * 4
    assert [a for a, _ in per_layer] == [WINDOW * row] * 3 + [64 * row]
    assert [u for _, u in per_layer] == [WINDOW * row] * 3 + [len(PROMPT) * row]
    assert cache.bytes_allocated == sum(a for a, _ in per_layer)


@pytest.mark.parametrize("name", ["qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "granite", "mixtral",
                                  "qwen3_moe"])
def test_explain_splits_the_logit_difference_through_each_familys_norms_and_multipliers(folders, name):
    """Direct logit attribution through post-norms (frozen scales), q/k norms, Granite's multipliers and experts:
    the parts sum to the forward's own difference (before Gemma 2's final cap, which the explanation reports as
    not exact, by the gap it shows); each chosen expert's share adds up to its layer's MLP part."""
    from engine.tools.explain import explain_logits
    model = load_model(folders[name], device="cpu", dtype="float32")
    e = explain_logits(model, PROMPT[:16])
    scale = abs(e.logit_a) + abs(e.logit_b)
    if model.config.final_softcap:
        assert abs(e.total - e.uncapped_diff) <= 1e-4 * scale
        assert e.uncapped_diff != pytest.approx(e.logit_diff, abs=1e-3)     # the cap bent them, and it says so
        assert e.exactness.startswith("not exact") and f"{e.residual_error:+.4f}" in e.exactness
    else:
        assert abs(e.residual_error) <= 1e-4 * scale and e.exactness.startswith("exact")
    if model.config.num_experts:
        assert e.experts
        for layer in {int(k.split(".")[1]) for k in e.experts}:
            shares = [v for k, v in e.experts.items() if k.startswith(f"blocks.{layer}.")]
            assert len(shares) == model.config.experts_per_token
            assert math.fsum(shares) == pytest.approx(e.mlp(layer), rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("name", sorted(CASES))
def test_qk_attribution_sums_to_each_familys_score_or_says_why_not(folders, name):
    """Why a head attends there, for every family: the query-side x key-side terms sum to the forward's own score
    within 1e-4 of its size where the block is linear once the attention norm is frozen (biases, partial rotary,
    Granite's multipliers, no-RoPE layers, post-norms, experts upstream); a family with q/k norms or an attention
    soft cap is said to be inexact, naming why, and its remainder is the score less the terms' sum; LayerNorm
    families (GPT-2, GPT-NeoX, StableLM, Phi) are exact too, their norm's bias a term of its own (against
    transformers' own scores: tests/reference/test_layernorm_attribution.py)."""
    from engine.tools.qk_attribution import qk_attribution
    model = load_model(folders[name], device="cpu", dtype="float32")
    L = model.config.num_layers - 1
    for layer, head, q, k in ((1, 1, 20, 15), (L, model.config.num_heads - 1, 30, 30)):
        r = qk_attribution(model, PROMPT, layer, head, q, k)
        assert r.remainder == r.score - r.total
        if r.exact:
            assert abs(r.remainder) <= 1e-4 * max(1.0, abs(r.score)), (name, layer, r.score, r.total)
        else:
            assert r.why_inexact and (model.config.attn_softcap is not None
                                      or any(w.q_norm is not None for w in model.weights.layers))
    assert r.exact == (name not in ("qwen3", "qwen3_moe", "gemma2", "gemma3_text", "olmo2"))
