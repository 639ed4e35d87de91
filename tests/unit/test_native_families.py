"""The native decode step (decode.c) on the dense families its allow-list admits beyond Llama's block (engine.native.
step.refusal reads each family's declaration): Qwen2's q/k/v biases, Qwen3's per-head q/k norms, Gemma's GELU-tanh
and embeddings x sqrt(d), Granite's multipliers, SmolLM3's layers without RoPE, Mistral's sliding window (a window
of 8 the steps pass: the KV cache's ring, a pattern offered over every position), Gemma 2's post-norms, soft caps
(logits_uncapped) and query scale over local and global layers, Gemma 3's q/k norms and local RoPE table, Phi-3's
rotary fraction and longrope (the long factors once past the original length), OLMo 2's post-norms only and q/k
norms over the whole projection, the LayerNorm families' LayerNorms (with biases; Cohere's without), plain MLPs with
biases (GELU-tanh; GPT-NeoX's exact erf GELU), attention output and head biases (Phi), parallel blocks (GPT-NeoX's
two norms, Phi's and Cohere's one), GPT-2's learned positions (and a GPT-2 of odd widths: a vocabulary, a stream
and an MLP none a multiple of eight, as GPT-2's own 50,257 tokens are), Cohere's interleaved RoPE and logit scale, Mixtral's and
Qwen3-MoE's experts (router, top k, the chosen experts' products only; Qwen3-MoE's dense layer 2). Each family's tiny random model
(made by transformers from the reference tier's config, tests.reference.family_models) decodes natively -- every
step, none handed back -- and is held to the PyTorch forward of the same model (Model.with_accelerator(PLAIN)):
greedy tokens equal (in bfloat16 and float16: each of the native step's the PyTorch forward's argmax, or within the logits'
bound of it), logits and the statistics of every stage the family's forward offers (its q/k norms, post-norms and
uncapped logits included) within the bounds of the Llama tests (test_native_decode.py: 1e-5 in float32; test_native_half.py: the logits within
two ulps (4u) of their absmax in bfloat16 and float16, statistics within four (8u) of the stage's). The batched rows of these
families stay on the PyTorch forward (decode_rows.c computes Llama's block only); an experts step reads only its
chosen experts' matrices (the others NaN, it meets none); and a declaration naming a variation off the list is
refused naming it."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from engine import GenerationRun, SamplingParams, load_model
from engine.accelerator import PLAIN
from engine.family.declared import FAMILIES
from engine.inspection.probe import Probe
from engine.inspection.stages import forward_stages
from engine.native import build
from engine.native.step import NativeDecoder, refusal
from tests.helpers import step_together_to_the_end

pytestmark = pytest.mark.unit
pytest.importorskip("transformers")

NATIVE = ("qwen2", "qwen3", "gemma", "granite", "smollm3", "mistral-window", "gemma2", "gemma3_text", "phi3",
          "phi3-longrope", "olmo2", "gpt2", "gpt2-odd", "gpt_neox", "gpt_neox-sequential", "phi", "stablelm", "stablelm-qkv-bias",
          "starcoder2", "starcoder2-no-bias", "cohere", "cohere-bias", "mixtral", "qwen3_moe")

PROMPT = [1, 400, 2000, 31, 77, 1234, 9000, 15]
STEPS = 10
UNIT = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}     # u: one rounding to the dtype, relative


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer_files):
    from tests.reference.family_models import build as build_case
    if build.load()[0] is None:
        pytest.skip(f"native library unavailable here: {build.load()[1]}")
    root = tmp_path_factory.mktemp("native_families")
    return {name: build_case(name, root / name, tokenizer_files) for name in NATIVE}


def _statuses(monkeypatch) -> list:
    """The position of every native step called and its status (0: done natively; 1: handed back to PyTorch)."""
    got: list = []
    real = NativeDecoder.__call__

    def spy(self, *a, **k):
        out = real(self, *a, **k)
        got.append((a[2], out[2]))
        return out
    monkeypatch.setattr(NativeDecoder, "__call__", spy)
    return got


def _greedy(model, probe, forced=None):
    """The prompt (PyTorch prefill), then STEPS greedy tokens one a call (forced: these tokens instead) -> (tokens,
    logits (1 + STEPS, V))."""
    cache = model.new_cache(32)
    out = [model.forward(torch.tensor(PROMPT), cache, probe, last_only=True)[-1]]
    tokens = []
    for i in range(STEPS):
        tokens.append(int(out[-1].float().argmax()) if forced is None else forced[i])
        out.append(model.forward(torch.tensor([tokens[-1]]), cache, probe)[-1])
    return tokens, torch.stack(out).float()


def _by_stage(probe) -> dict:
    return {(b.pos0, n): b.values[g] for b in probe.recording.stats for g, n in enumerate(b.names)}


def _both(folders, name, dtype, monkeypatch, bound=None):
    """The family's model decoded natively and on the PyTorch forward, each with every stage's statistics ->
    (model, logits of each path, statistics of each path). bound=None: each path's greedy tokens, which must be
    equal; else (a half dtype) the PyTorch forward is fed the native step's tokens, and each of them must be the
    PyTorch forward's argmax or within `bound` (of the logits' absmax) of it: a near tie, which one ulp of difference
    may turn (the tiny Phi-3's bfloat16 reference has an exact tie at its ninth step)."""
    model = load_model(folders[name], device="cpu", dtype=dtype)
    assert model.accelerator.decode is not None, model.accelerator.why_not
    statuses = _statuses(monkeypatch)
    pa, pb = Probe().record_stats("*"), Probe().record_stats("*")
    ta, a = _greedy(model, pa)
    # every decode step went native and none was handed back (not a silent fallback), none of the prefill
    assert statuses == [(len(PROMPT) + i, 0) for i in range(STEPS)]
    tb, b = _greedy(model.with_accelerator(PLAIN), pb, None if bound is None else ta)
    assert len(statuses) == STEPS
    if bound is None:
        assert ta == tb
    for t, row in zip(ta, b[:-1]):
        assert row[t] >= row.max() - (bound or 0.0) * row.abs().max(), (t, int(row.argmax()))
    sa, sb = _by_stage(pa), _by_stage(pb)
    assert sa.keys() == sb.keys()
    decode = [k for k in sa if k[0] >= len(PROMPT)]
    assert {k[1] for k in decode} == set(forward_stages(model.config))    # every stage this family offers
    return model, a, b, [(k, sa[k], sb[k]) for k in decode]


@pytest.mark.parametrize("name", NATIVE)
def test_the_family_decodes_natively_as_the_pytorch_forward_in_float32(folders, name, monkeypatch):
    model, a, b, stats = _both(folders, name, "float32", monkeypatch)
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    for k, x, y in stats:
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    names = model.accelerator.decode.names       # a variation's own stages are among the step's statistics
    assert ("blocks.0.attn.q_norm" in names) == (name in ("qwen3", "gemma3_text", "olmo2", "qwen3_moe"))
    assert ("blocks.0.attn_post_norm" in names) == ("blocks.0.mlp_post_norm" in names) == (
        name in ("gemma2", "gemma3_text", "olmo2"))
    assert ("logits_uncapped" in names) == (name == "gemma2")
    # OLMo 2 has no pre-norms, Phi and Cohere one (no mlp_norm); a parallel block no stream between its halves; a
    # plain MLP no gate
    assert ("blocks.0.attn_norm" in names) == (name != "olmo2")
    assert ("blocks.0.mlp_norm" in names) == (name not in ("olmo2", "phi", "cohere", "cohere-bias"))
    assert ("blocks.0.resid_mid" in names) == (name not in ("gpt_neox", "phi", "cohere", "cohere-bias"))
    plain = name.startswith(("gpt2", "gpt_neox", "phi", "starcoder2")) and name not in ("phi3", "phi3-longrope")
    moe = name in ("mixtral", "qwen3_moe")
    assert ("blocks.0.mlp.gate" in names) == (not plain and not moe)
    assert ("blocks.0.mlp.up" in names) == ("blocks.0.mlp.act" in names) == (not moe)
    assert ("blocks.0.mlp.router" in names) == ("blocks.0.mlp.experts" in names) == moe
    # Qwen3-MoE's mlp_only_layers (here layer 2) are dense
    assert ("blocks.2.mlp.router" in names) == (name == "mixtral") != ("blocks.2.mlp.up" in names)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", NATIVE)
def test_the_family_decodes_natively_as_the_pytorch_forward_in_half_precision(folders, name, dtype, monkeypatch):
    u = UNIT[dtype]
    _, a, b, stats = _both(folders, name, dtype, monkeypatch, bound=4 * u)
    # the logits' scale; under a final soft cap (Gemma 2), the uncapped logits' (the cap's slope is at most 1: it
    # passes an error near 0 on whole while it shrinks the absmax, 3 here against an uncapped ~20)
    scale = max([b.abs().max()] + [y[0, 4] for k, x, y in stats if k[1] == "logits_uncapped"])
    assert (a - b).abs().max() <= 4 * u * scale
    for k, x, y in stats:
        assert (x[0, :5] - y[0, :5]).abs().max() <= 8 * u * y[0, 4], (k, x, y)
        assert x[0, 5:].tolist() == y[0, 5:].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("name", NATIVE)
def test_the_familys_runs_step_alone_on_the_native_step_beside_others(folders, name, monkeypatch):
    """decode_rows.c computes Llama's block: runs of these families stepped together (engine.batch) are not batched
    (on the PyTorch forward a row would not be its native run alone, bit for bit): each steps alone on the native
    step, its tokens those of the run alone, and decode_rows.c is never called."""
    model = load_model(folders[name], device="cpu", dtype="float32")
    assert model.accelerator.decode.rows_refusal.startswith("a block beyond Llama's")
    calls = []
    real = NativeDecoder.rows
    monkeypatch.setattr(NativeDecoder, "rows", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    greedy = SamplingParams(temperature=0.0)

    def runs(m):
        return [GenerationRun(m, torch.tensor(p), params=greedy, seed=s, max_new_tokens=4, ignore_eos=True)
                for p, s in ((PROMPT, 0), (PROMPT[:3], 1))]
    together, alone = runs(model), runs(model)
    step_together_to_the_end(together)
    for r in alone:
        r.run()
    assert calls == [] and all(r.batched_steps == 0 for r in together)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


@pytest.mark.parametrize("field, value, feature", [("norm", "scale", "another norm"),
                                                   ("activation", "relu", "another activation"),
                                                   ("experts", "switch", "other experts")])
def test_a_declared_variation_off_the_list_is_refused_naming_it(folders, field, value, feature, monkeypatch):
    """Every family the engine declares is on the list now: a declaration naming something else (a norm, an
    activation, a routing decode.c does not compute) is refused, naming the feature and the declared value."""
    model = load_model(folders["qwen2"], device="cpu", dtype="float32")
    assert refusal(model) is None
    monkeypatch.setitem(FAMILIES, "qwen2", dataclasses.replace(FAMILIES["qwen2"], **{field: value}))
    assert refusal(model) == f"{feature} ({field}={value!r})"


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_an_experts_step_reads_only_the_chosen_experts_matrices(folders, name, monkeypatch):
    """One decode step of each experts layer reads only its token's top-k experts: with every other expert's
    matrices NaN (the PyTorch forward, which multiplies only the routed experts, says which those are), the native
    step meets no NaN (status 0: a NaN read even with a gate of 0 would make its products NaN) and its logits are
    those of the step with the weights intact."""
    model = load_model(folders[name], device="cpu", dtype="float32")
    plain = model.with_accelerator(PLAIN)
    cache = model.new_cache(16)
    plain.forward(torch.tensor(PROMPT), cache)
    probe = Probe().capture("blocks.*.mlp.experts")
    want = plain.forward(torch.tensor([77]), copy.deepcopy(cache), probe)
    routed = {int(c.name.split(".")[1]): set(torch.nonzero(c.value.reshape(-1)).flatten().tolist())
              for c in probe.recording.captures if c.name.endswith("mlp.experts")}      # layer -> its chosen
    layers = model.weights.layers
    assert sorted(routed) == [i for i, lw in enumerate(layers) if lw.router is not None] and routed
    assert all(len(e) == model.config.experts_per_token for e in routed.values())
    kept = {i: (layers[i].experts_gate_up.clone(), layers[i].experts_down.clone()) for i in routed}
    statuses = _statuses(monkeypatch)
    try:
        for i, chosen in routed.items():
            for e in set(range(layers[i].router.shape[1])) - chosen:
                layers[i].experts_gate_up[e] = float("nan")
                layers[i].experts_down[e] = float("nan")
        got = model.forward(torch.tensor([77]), cache)
    finally:
        for i, (gu, down) in kept.items():
            layers[i].experts_gate_up.copy_(gu)
            layers[i].experts_down.copy_(down)
    assert statuses == [(len(PROMPT), 0)]
    assert torch.isfinite(got).all() and (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_any_width_is_admitted_and_what_is_still_refused_is_named(folders, monkeypatch):
    """The GPT-2 of odd widths takes the native step (no shape rule: any K, any N); a weight that is not contiguous
    (here a transposed view of layer 0's output matrix, the same values) is refused saying so."""
    model = load_model(folders["gpt2-odd"], device="cpu", dtype="float32")
    assert refusal(model) is None
    lw = model.weights.layers[0]
    assert [n % 8 for n in (*model.weights.lm_head.shape, *lw.w_up.shape)] == [4, 5, 4, 2]      # (60, 49157), (60, 90)
    monkeypatch.setattr(lw, "wo", lw.wo.t().contiguous().t())
    assert refusal(model) == "weights that are not contiguous torch.float32 tensors"
