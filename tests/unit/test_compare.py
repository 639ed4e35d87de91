"""inspector/compare.py: the first divergence, the token-aligned table and per-stage differences, on hand-made
inputs and on the tiny model (sampler settings, cache on/off, interventions, dtype)."""
from __future__ import annotations

import math

import pytest
import torch

from engine import GenerationResult, InputError, SamplingParams, Step, load_model
from engine.generate import generate, prompt_ids
from engine.progress import STOP
from inspector.views.compare import (
    Intervention,
    RunConfig,
    aligned_table,
    differences_figure,
    divergence_stages,
    first_differing_stage,
    first_divergence,
    from_divergence,
    rel_error,
    run_config,
    stage_differences,
    tokens_figure,
)

PROMPT = "Tell me about caches."


@pytest.mark.parametrize("a, b, expected", [
    ([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 9, 3], 1), ([5], [6], 0), ([1, 2], [1, 2, 3], 2),
    ([1, 2, 3], [1, 2], 2), ([], [], None), ([], [4], 0), ([1, 2, 3, 4], [1, 2, 3, 5], 3)])
def test_first_divergence_of_hand_made_lists(a, b, expected):
    assert first_divergence(a, b) == expected


def trace(label, ids):
    steps = [Step(index=i, position=3 + i, token_id=t, text="", prob=0.5, model_prob=0.5, entropy=1.0, kept=2, top=[],
                  seconds={}) for i, t in enumerate(ids)]
    return GenerationResult(prompt_ids=[1, 2, 3], token_ids=ids, text="", steps=steps, stop_reason="max_new_tokens",
                            params=SamplingParams(), seed=0, timings={}, cache={})


def test_aligned_table_of_hand_made_traces():
    t = aligned_table(trace("A", [1, 2, 3, 4]), trace("B", [1, 2, 7]), lambda i: f"t{i}")
    assert t["step"].tolist() == [0, 1, 2, 3]
    assert t["token_a"].tolist() == ["t1", "t2", "t3", "t4"] and t["token_b"].tolist()[:3] == ["t1", "t2", "t7"]
    assert t["id_b"].isna().tolist() == [False, False, False, True]
    assert t["same"].tolist() == [True, True, False, False]
    assert t["diverged"].tolist() == [False, False, True, True]
    fig = tokens_figure(t)
    assert len(fig.data) == 2 and fig.layout.shapes[0].x0 == 2


def test_the_table_opens_at_the_divergence_with_two_steps_before_it():
    """Issue 33, item 9: Compare's table opened at step 0 and the divergence was below the fold."""
    same = list(range(10, 40))
    t = aligned_table(trace("A", same + [1, 2]), trace("B", same + [7, 8]), lambda i: f"t{i}")
    shown = from_divergence(t, first_divergence(t["id_a"].tolist(), t["id_b"].tolist()))
    assert shown["step"].tolist() == [28, 29, 30, 31] and shown["diverged"].tolist() == [False, False, True, True]
    assert from_divergence(t, None) is t and from_divergence(t, 2) is t          # nothing to skip


def test_stage_differences_of_hand_made_tensors():
    g = torch.Generator().manual_seed(0)
    x, z = torch.randn(8, generator=g), torch.randn(4, 2, generator=g)
    masked = torch.tensor([1.0, float("-inf"), 2.0])
    a = {"embed": x, "blocks.0.attn.z": z, "blocks.1.mlp.act": x, "sampler.top_k": masked, "only_a": x}
    b = {"embed": x.clone(), "blocks.0.attn.z": 1.1 * z, "blocks.1.mlp.act": x + torch.tensor([0.5] + [0.0] * 7),
         "sampler.top_k": masked.clone()}
    d = stage_differences(a, b).set_index("stage")
    assert list(d.index) == list(a)                                       # a's (forward) order
    assert d.loc["embed", "rel_error"] == 0 and d.loc["embed", "differing"] == 0
    assert d.loc["blocks.0.attn.z", "rel_error"] == pytest.approx(0.1, rel=1e-5)
    assert d.loc["blocks.0.attn.z", "layer"] == 0 and d.loc["blocks.1.mlp.act", "layer"] == 1
    assert d.loc["blocks.1.mlp.act", "max_abs_diff"] == pytest.approx(0.5)
    assert d.loc["blocks.1.mlp.act", "rel_error"] == pytest.approx(0.5 / float(x.norm()), rel=1e-5)
    assert d.loc["blocks.1.mlp.act", "differing"] == 1
    assert d.loc["sampler.top_k", "rel_error"] == 0                      # equal -inf masks are no difference
    assert math.isnan(d.loc["only_a", "rel_error"])
    assert first_differing_stage(d.reset_index()) == "blocks.0.attn.z"
    assert first_differing_stage(d.reset_index().iloc[:1]) is None
    assert len(differences_figure(d.reset_index()).data[0].x) == 5


def test_rel_error_special_values():
    nan, inf = float("nan"), float("inf")
    assert rel_error(torch.tensor([1.0, nan]), torch.tensor([1.0, nan]))[0] == 0
    err, mx, n = rel_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, inf]))
    assert err == inf and mx == inf and n == 1
    assert rel_error(torch.tensor([1.0, 2.0]), torch.tensor([nan, 2.0]))[0] == inf


@pytest.fixture(scope="module")
def ids(tiny_model):
    return prompt_ids(tiny_model, PROMPT, chat=True)


def test_run_config_reports_every_token_and_stops_when_asked(tiny_model, ids):
    seen = []
    full = run_config(tiny_model, ids, RunConfig("A"), max_new_tokens=6, seed=5, on_token=seen.append)
    assert [st.index for st in seen] == list(range(6)) and [st.token_id for st in seen] == full.token_ids
    cut = run_config(tiny_model, ids, RunConfig("A"), max_new_tokens=6, seed=5,
                     on_token=lambda st: STOP if st.index == 2 else None)
    assert cut.token_ids == full.token_ids[:3] and cut.stop_reason == "stopped"


def test_temperature_0_vs_1_diverges_where_the_engine_runs_do(tiny_model, ids):
    a, b = RunConfig("A"), RunConfig("B", params=SamplingParams(temperature=1.0))
    ta, tb = (run_config(tiny_model, ids, c, max_new_tokens=6, seed=5) for c in (a, b))
    ref_a = generate(tiny_model, ids, max_new_tokens=6, seed=5, params=SamplingParams(temperature=0.0)).token_ids
    ref_b = generate(tiny_model, ids, max_new_tokens=6, seed=5, params=SamplingParams(temperature=1.0)).token_ids
    assert ta.token_ids == ref_a and tb.token_ids == ref_b
    d = first_divergence(ta.token_ids, tb.token_ids)
    assert d is not None and d == next(i for i, (x, y) in enumerate(zip(ref_a, ref_b)) if x != y)
    diff = divergence_stages(tiny_model, a, tiny_model, b, ids, ta.token_ids, d).set_index("stage")
    model_stages = [n for n in diff.index if not n.startswith("sampler.")]
    assert (diff.loc[model_stages, "rel_error"] == 0).all()             # same model, same tokens: same forward
    assert diff.loc["sampler.temperature", "rel_error"] == 0             # T = 1 divides by one
    assert diff.loc["sampler.probs", "rel_error"] > 0.5                  # one-hot vs softmax
    assert first_differing_stage(diff.reset_index()) == "sampler.probs"
    assert "blocks.0.attn.pattern" not in diff.index                     # fused attention path kept by default
    with pytest.raises(InputError, match="share"):
        divergence_stages(tiny_model, a, tiny_model, b, ids, ta.token_ids[:2], 3)


def test_cache_off_recomputes_and_matches(tiny_model, ids):
    on, off = RunConfig("A"), RunConfig("B", cache=False)
    ta, tb = (run_config(tiny_model, ids, c, max_new_tokens=5) for c in (on, off))
    assert ta.token_ids == tb.token_ids and first_divergence(ta.token_ids, tb.token_ids) is None
    assert [st.prob for st in ta.steps] == [st.prob for st in tb.steps] == [1.0] * 5
    assert [st.entropy for st in tb.steps] == pytest.approx([st.entropy for st in ta.steps], abs=1e-4)
    diff = divergence_stages(tiny_model, on, tiny_model, off, ids, ta.token_ids, 3, attention_maps=True)
    assert (diff["rel_error"] < 1e-4).all() and diff["stage"].iloc[0] == "embed"
    assert "blocks.1.attn.pattern" in set(diff["stage"])
    # sampling without a cache draws from the same seeded generator as the engine
    hot = SamplingParams(temperature=1.0, top_k=50)
    t_off = run_config(tiny_model, ids, RunConfig("C", params=hot, cache=False), max_new_tokens=4, seed=9)
    assert t_off.token_ids == generate(tiny_model, ids, max_new_tokens=4, seed=9,
                                       params=SamplingParams(temperature=1.0, top_k=50)).token_ids


def test_interventions_differ_first_at_their_stage(tiny_model, ids):
    base = RunConfig("A")
    zero = RunConfig("B", intervention=Intervention("zero_heads", "blocks.1.attn.z", (0, 2)))
    diff = divergence_stages(tiny_model, base, tiny_model, zero, ids, [], 0)
    assert first_differing_stage(diff) == "blocks.1.attn.z"
    z = diff.set_index("stage").loc["blocks.1.attn.z"]
    assert z["differing"] == 2 * tiny_model.config.head_dim               # two heads at one position
    twice = RunConfig("B", intervention=Intervention("scale", "blocks.0.mlp.act", factor=2.0))
    diff = divergence_stages(tiny_model, base, tiny_model, twice, ids, [], 0).set_index("stage")
    assert first_differing_stage(diff.reset_index()) == "blocks.0.mlp.act"
    assert diff.loc["blocks.0.mlp.act", "rel_error"] == pytest.approx(1.0, rel=1e-5)   # ||2a - a|| / ||a||
    tz = run_config(tiny_model, ids, zero, max_new_tokens=4)
    assert tz.token_ids != run_config(tiny_model, ids, base, max_new_tokens=4).token_ids
    for bad, match in [(Intervention("zero_heads", "blocks.9.attn.z", (0,)), "no stage"),
                       (Intervention("zero_heads", "blocks.0.attn.k", (2,)), r"\[0, 2\)"),
                       (Intervention("zero_heads", "blocks.0.mlp.act", (0,)), "per-head"),
                       (Intervention("shift", "embed"), "unknown")]:
        with pytest.raises(InputError, match=match):
            run_config(tiny_model, ids, RunConfig("B", intervention=bad), max_new_tokens=1)


def test_dtype_difference_starts_at_the_embedding(tiny_model, tiny_model_dir, ids):
    bf16 = load_model(tiny_model_dir, device="cpu", dtype="bfloat16")
    a, b = RunConfig("A", dtype="float32"), RunConfig("B", dtype="bfloat16")
    tb = run_config(bf16, ids, b, max_new_tokens=3)
    assert len(tb.token_ids) == 3
    diff = divergence_stages(tiny_model, a, bf16, b, ids, [], 0).set_index("stage")
    assert first_differing_stage(diff.reset_index()) == "embed"
    assert 1e-4 < diff.loc["embed", "rel_error"] < 1e-2                # bfloat16 rounding: 8 mantissa bits
    assert 1e-4 < diff.loc["logits", "rel_error"] < 0.2
