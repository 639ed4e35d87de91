"""Explain a token on the tiny random model: logit attribution adds up, the sampler stages are followed
exactly, packed partial runs (patching, head scan, occlusion, deletion) equal plain full forwards, and the
explain / patch commands print what they promise."""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from engine import GenerationRun, InputError, Probe, SamplingParams
from engine.tools.attribution import attribute_inputs, deletion_curves, grad_x_input, neutral_token, occlusion
from engine.tools.explain import explain_logits, explain_step, runner_up, sampler_effects
from engine.tools.patching import SITES, ablated_logit, head_scan, patching_grid, replace_span, restored_prob

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The cat sat on the mat because", "Once upon a time, in a land far away, there", "1, 2, 3, 4,"]


def ids_of(model, text: str) -> list[int]:
    return model.tokenizer.encode(text)


# ---- direct logit attribution ------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", PROMPTS)
def test_contributions_sum_to_the_logit_difference_of_the_forward(tiny_model, prompt):
    ids = ids_of(tiny_model, prompt)
    logits = tiny_model.logits(ids)[-1]
    for a, b in [(None, None), (int(logits.argmin()), 17), (5, 4000)]:
        e = explain_logits(tiny_model, ids, a, b)
        diff = float(logits[e.target] - logits[e.versus])
        assert e.logit_diff == pytest.approx(diff, abs=1e-5)
        assert abs(e.total - e.logit_diff) <= 1e-5 * max(1.0, abs(e.logit_diff))
        names = set(e.contributions)
        assert "embed" in names and "blocks.1.attn.head.3" in names and "blocks.0.mlp" in names
        assert len(names) == 1 + 2 * (4 + 1)       # embed + per layer (4 heads + MLP): nothing counted twice


def test_heads_split_each_layers_attention_output_exactly(tiny_model):
    """Per-head parts of a layer add up to that layer's attn_out read through the same frozen norm."""
    ids = ids_of(tiny_model, PROMPTS[0])
    e = explain_logits(tiny_model, ids)
    probe = Probe().capture(["blocks.*.attn_out", "blocks.1.resid_post"], positions=[len(ids) - 1])
    tiny_model.logits(ids, probe)
    w, eps = tiny_model.weights, tiny_model.config.rms_norm_eps
    resid = probe.recording.captured("blocks.1.resid_post")[0].value[-1].double()
    scale = 1 / math.sqrt(float(resid.pow(2).mean()) + eps)
    direction = scale * w.norm.double() * (w.lm_head[:, e.target] - w.lm_head[:, e.versus]).double()
    for i in range(2):
        attn_out = probe.recording.captured(f"blocks.{i}.attn_out")[0].value[-1].double()
        assert e.attn(i) == pytest.approx(float(attn_out @ direction), abs=1e-5)
    assert e.norm_scale == pytest.approx(scale, rel=1e-12)


def test_a_step_of_a_run_defaults_to_the_chosen_token_against_the_runner_up(tiny_model):
    r = GenerationRun(tiny_model, PROMPTS[1], max_new_tokens=4).run()
    e = explain_step(tiny_model, r.prompt_ids, r.token_ids, 2)
    assert e.ids == r.prompt_ids + r.token_ids[:2] and e.target == r.token_ids[2]
    assert e.versus == runner_up(tiny_model.logits(e.ids)[-1], e.target) and e.logit_diff >= 0   # greedy
    with pytest.raises(InputError, match="step 4 is not in this run"):
        explain_step(tiny_model, r.prompt_ids, r.token_ids, 4)
    with pytest.raises(InputError, match="same token"):
        explain_step(tiny_model, r.prompt_ids, r.token_ids, 0, versus=r.token_ids[0])


def test_sampler_effects_follow_a_and_b_through_each_stage_by_hand():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.5, 0.0, -1.0])
    p = SamplingParams(temperature=0.5, top_k=2, repetition_penalty=2.0)
    fx = {s.stage: s for s in sampler_effects(logits, p, context=[0], generated=[], a=0, b=1)}
    assert list(fx) == ["model", "penalties", "temperature", "top_k", "top_p", "min_p", "probs"]
    pen = fx["penalties"]          # token 0 is in the context: 3 / 2 = 1.5 < 2, so B overtakes A
    assert (pen.value_a, pen.value_b, pen.rank_a, pen.rank_b) == (1.5, 2.0, 2, 1)
    assert pen.order_changed and pen.d_diff == pytest.approx(-1.5)
    temp = fx["temperature"]       # divided by 0.5: the gap doubles
    assert (temp.value_a, temp.value_b) == (3.0, 4.0) and temp.d_diff == pytest.approx(-0.5) and not temp.order_changed
    assert temp.prob_a == pytest.approx(math.exp(3) / sum(math.exp(2 * x) for x in [1.5, 2, 1, 0.5, 0, -1]))
    k = fx["top_k"]                # only A and B survive: values unchanged, probabilities renormalised
    assert k.d_diff == 0 and k.changed and k.prob_a == pytest.approx(1 / (1 + math.e))
    assert k.d_prob_a == pytest.approx(k.prob_a - temp.prob_a)
    assert not fx["top_p"].changed and not fx["min_p"].changed and not fx["probs"].changed
    greedy = {s.stage: s for s in sampler_effects(logits, SamplingParams(), [], [], a=1, b=0)}
    assert greedy["probs"].prob_b == 1.0 and greedy["probs"].prob_a == 0.0 and greedy["probs"].changed
    assert not greedy["penalties"].changed
    cut = {s.stage: s for s in sampler_effects(logits, SamplingParams(temperature=1.0, top_k=1), [], [], a=0, b=1)}
    assert cut["top_k"].value_b == float("-inf") and cut["top_k"].removed == "B" and cut["probs"].prob_b == 0.0
    assert not cut["top_k"].order_changed and cut["top_k"].changed and cut["probs"].removed == ""
    assert json.dumps([s.as_dict() for s in cut.values()])          # no NaN or infinity in the JSON


# ---- activation patching ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(tiny_model):
    clean = ids_of(tiny_model, "The quick brown fox jumps over the lazy dog")
    corrupt = replace_span(clean, 2, 4, ids_of(tiny_model, " red cat"))
    target = int(tiny_model.logits(clean)[-1].argmax())
    return clean, corrupt, target


@pytest.fixture(scope="module")
def grid(tiny_model, pair):
    return patching_grid(tiny_model, *pair)


def test_restoring_the_last_layers_resid_post_at_the_last_position_gives_p_clean(grid):
    assert grid.grid["resid_post"][-1][-1] == pytest.approx(grid.p_clean, rel=1e-5, abs=1e-9)
    assert abs(grid.p_clean - grid.p_corrupt) > 0.05 * grid.p_clean     # the corruption matters here


def test_restoring_the_embedding_at_every_position_gives_p_clean(tiny_model, pair, grid):
    clean, corrupt, target = pair
    assert restored_prob(tiny_model, clean, corrupt, target, "embed", list(range(len(clean)))) == \
        pytest.approx(grid.p_clean, rel=1e-5, abs=1e-9)


def test_every_grid_cell_equals_a_full_forward_with_that_one_activation_restored(tiny_model, pair, grid):
    clean, corrupt, target = pair
    for site in SITES:
        for i in range(2):
            for t in range(len(clean)):
                ref = restored_prob(tiny_model, clean, corrupt, target, f"blocks.{i}.{site}", [t])
                assert grid.grid[site][i][t] == pytest.approx(ref, rel=1e-5, abs=1e-9), (site, i, t)
    assert all(grid.grid[s][i][t] == grid.p_corrupt for s in SITES for i in range(2) for t in range(2))


def test_skipping_unchanged_positions_changes_no_cell(tiny_model, pair, grid):
    full = patching_grid(tiny_model, *pair, skip_unchanged=False, heads=False)
    assert full.runs > grid.runs - 8 and full.head_scan is None
    for s in SITES:
        assert torch.allclose(torch.tensor(full.grid[s]), torch.tensor(grid.grid[s]), rtol=1e-5, atol=1e-9)


def test_head_scan_equals_a_rerun_with_that_head_zeroed(tiny_model, pair, grid):
    clean, _, target = pair
    base = float(tiny_model.logits(clean)[-1, target])
    for i in range(2):
        for h in range(4):
            assert grid.head_scan[i][h] == pytest.approx(ablated_logit(tiny_model, clean, target, i, h) - base,
                                                         abs=1e-4)
    assert torch.allclose(torch.tensor(head_scan(tiny_model, clean, target)), torch.tensor(grid.head_scan), atol=1e-6)
    assert tiny_model.live_hooks == 0            # every packed call's probe was detached


def test_patching_refuses_prompts_of_different_lengths_and_bad_spans(tiny_model, pair):
    clean, _, target = pair
    with pytest.raises(InputError, match="same number of tokens"):
        patching_grid(tiny_model, clean, clean[:-1], target)
    with pytest.raises(InputError, match="replacement is 1 tokens; the span is 2"):
        replace_span(clean, 0, 2, [5])
    with pytest.raises(InputError, match="unknown patching site"):
        patching_grid(tiny_model, clean, clean, target, sites=("resid_pre",))


def test_progress_reaches_one(tiny_model, pair):
    seen = []
    patching_grid(tiny_model, *pair, on_progress=lambda p: seen.append(p.fraction))
    assert seen and seen[-1] == pytest.approx(1.0) and seen == sorted(seen)


# ---- input attribution -------------------------------------------------------------------------------------
def test_occlusion_and_deletion_curves_equal_full_forwards_with_tokens_replaced(tiny_model, pair):
    ids, _, target = pair
    neutral = neutral_token(tiny_model)

    def logp(x):
        return float(torch.log_softmax(tiny_model.logits(x)[-1], -1)[target])
    occ = occlusion(tiny_model, ids, target, neutral)
    for t in range(len(ids)):
        assert occ[t] == pytest.approx(logp(ids) - logp(ids[:t] + [neutral] + ids[t + 1:]), abs=1e-5)
    order = [3, 0, 5, 1, 2, 4, 6, 7, 8][:len(ids)]
    (curve,) = deletion_curves(tiny_model, ids, target, [order], neutral)
    for k in (0, 2, len(ids)):
        removed = [neutral if t in order[:k] else x for t, x in enumerate(ids)]
        assert curve[k] == pytest.approx(logp(removed), abs=1e-5)


def test_gradient_times_input_matches_a_finite_difference(tiny_model, pair):
    ids, _, target = pair
    gxi = grad_x_input(tiny_model, ids, target)

    def logp_scaled(t, f):     # log p(target) with embedding row t scaled by f
        def fn(x, ctx):
            y = x.clone()
            y[t] *= f
            return y
        lg = tiny_model.logits(ids, Probe().replace("embed", fn))[-1].double()
        return float(torch.log_softmax(lg, -1)[target])
    for t in (0, len(ids) // 2, len(ids) - 1):
        fd = (logp_scaled(t, 1 + 1e-2) - logp_scaled(t, 1 - 1e-2)) / 2e-2      # d/df at f = 1 = grad . row
        assert gxi[t] == pytest.approx(fd, rel=2e-2, abs=2e-3)
    assert tiny_model.live_hooks == 0


def test_attribution_result_is_json_and_names_the_faithful_method(tiny_model, pair):
    ids, _, target = pair
    a = attribute_inputs(tiny_model, ids, target, random_orders=2)
    d = json.loads(json.dumps(a.as_dict()))
    assert set(d["scores"]) == {"occlusion", "grad_x_input"} and len(d["deletion"]["random"]) == len(ids) + 1
    assert d["faithful"] in ("occlusion", "grad_x_input") and len(a.random_areas) == 2
    assert a.deletion["occlusion"][0] == pytest.approx(a.logp)


# ---- the explain and patch commands ------------------------------------------------------------------------
def load_cli():
    """engine/cli/explain.py loaded by path, without the CLI package around it."""
    spec = importlib.util.spec_from_file_location("explain_cli_under_test", ROOT / "engine" / "cli" / "explain.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def cli(tiny_model):
    """parse-and-run for the two commands, with a stand-in for the CLI's shared argument builders."""
    def prompt_args(p):
        p.add_argument("prompt")
        p.add_argument("--chat", action="store_true")
        p.add_argument("--system", default=None)
        p.add_argument("--allow-special", action="store_true")

    def sampling_args(p):
        p.add_argument("--max-new-tokens", type=int, default=64)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--seed", type=int, default=0)

    common = argparse.Namespace(
        model_args=lambda p: p.add_argument("--model", default=None), prompt_args=prompt_args,
        sampling_args=sampling_args, load=lambda a: tiny_model,
        sampling_params=lambda a: SamplingParams(temperature=a.temperature, top_k=a.top_k))
    parser = argparse.ArgumentParser()
    load_cli().add_commands(parser.add_subparsers(dest="cmd", required=True), common)
    return lambda *argv: (lambda a: a.fn(a))(parser.parse_args(list(argv)))


def test_explain_command_prints_every_component_and_the_residual_error(cli, capsys, tiny_model):
    assert cli("explain", PROMPTS[0], "--step", "1", "--json", "--temperature", "0.8", "--top-k", "5") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step"] == 1 and out["target"]["id"] == out["chosen"]["id"]
    parts = out["contributions"]
    assert {"embed", "blocks.0.attn.head.0", "blocks.1.attn.head.3", "blocks.1.mlp"} <= set(parts)
    assert math.fsum(parts.values()) == pytest.approx(out["sum"], abs=1e-9)
    assert out["sum"] - out["logit_diff"] == pytest.approx(out["residual_error"], abs=1e-9)
    assert abs(out["residual_error"]) < 1e-5 * max(1, abs(out["logit_diff"]))
    assert out["attn_totals"]["blocks.0.attn"] == pytest.approx(sum(parts[f"blocks.0.attn.head.{h}"] for h in range(4)))
    assert [s["stage"] for s in out["sampler"]] == ["model", "penalties", "temperature", "top_k", "top_p", "min_p",
                                                    "probs"]
    assert cli("explain", PROMPTS[0], "--target", "the", "--versus", " cat") == 0
    text = capsys.readouterr().out
    assert "sum of contributions" in text and "sampler stage" in text
    with pytest.raises(InputError, match="is 3 tokens"):
        cli("explain", PROMPTS[0], "--target", "the cat sat")


def test_patch_command_prints_the_grid_and_the_head_scan(cli, capsys, tiny_model):
    assert cli("patch", "--clean", "The cat sat on the", "--corrupt", "The dog sat on the", "--target", " mat",
               "--json") == 0
    out = json.loads(capsys.readouterr().out)
    T = len(tiny_model.tokenizer.encode("The cat sat on the"))
    assert set(out["grid"]) == set(SITES) and len(out["grid"]["mlp_out"]) == 2 and len(out["grid"]["mlp_out"][0]) == T
    assert out["grid"]["resid_post"][1][T - 1] == pytest.approx(out["p_clean"], abs=1e-5)
    assert len(out["head_scan"]) == 2 and len(out["head_scan"][0]) == 4 and 0 <= out["p_corrupt"] <= 1
    with pytest.raises(InputError, match="same number of tokens"):
        cli("patch", "--clean", "The cat sat on the", "--corrupt", "A dog", "--target", " mat")
