"""The prescribing doctors on the tiny model: why a generation loops (engine.tools.why_loop), the fp32 rescue set
(engine.tools.rescue), quantization damage (engine.tools.quant), their CLI (engine.cli.prescribe) and views."""
from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter
from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine import InputError, Model, RunSettings, SamplingParams
from engine.cli.prescribe import add_commands, add_doctor_flags, doctor_model, extend_doctor, human_lines
from engine.generate import generate
from engine.inspection.loops import tail_loop
from engine.tools.doctor import run_doctor
from engine.tools.quant import compare_formats, requantize
from engine.tools.rescue import MAX_NEW_TOKENS, complement, find_rescue, forward_order, known_failing, precision_units
from engine.tools.rescue_runs import fp32_reference, judge
from engine.tools.why_loop import LOOK_FURTHER, Cause, _cause, fell_back, loops_in, prompt_spans, why_loop
from engine.variants import cast_model, precision_plan
from engine.weights import Weights
from inspector.views import prescribe as pv

pytestmark = pytest.mark.unit
PROMPT = "I like apples. I like apples. I like"
OVERFLOW = "scale=1e6@blocks.1.mlp_out"       # tiny mlp_out is O(1): fine in fp32, past 65,504 in float16


def no_trigram_thrice(tokens) -> bool:
    grams = Counter(tuple(tokens[i:i + 3]) for i in range(len(tokens) - 2))
    return all(n < 3 for n in grams.values())


@pytest.fixture(scope="module")
def looper(tiny_model) -> Model:
    """The tiny model made to loop by its weights alone: attention and MLP outputs are zero (wo, w_down = 0),
    so the stream is the current token's embedding, and the unembedding maps the prompt's last token A ->
    1000 -> 2000 -> A. No head can matter; only the sampler can break it."""
    w, cfg = tiny_model.weights, tiny_model.config
    a = tiny_model.tokenizer.encode(PROMPT)[-1]
    layers = [dataclasses.replace(lw, wo=torch.zeros_like(lw.wo), w_down=torch.zeros_like(lw.w_down))
              for lw in w.layers]
    head = w.lm_head.clone()
    e = F.rms_norm(w.embed, (cfg.hidden_size,), w.norm, cfg.rms_norm_eps)
    cycle = [a, 1000, 2000]
    for src, dst in zip(cycle, cycle[1:] + cycle[:1]):
        head[:, dst] = 20 * e[src] / e[src].norm()
    return Model(cfg, Weights(w.embed, layers, w.norm, head), tiny_model.tokenizer, device=tiny_model.device,
                 dtype=tiny_model.dtype, name="tiny looper")


@pytest.fixture(scope="module")
def tiny_fp16(tiny_model) -> Model:
    return cast_model(tiny_model, "float16")


# ---- why the loop ---------------------------------------------------------------------------------
def test_the_reruns_loop_test_is_the_one_loop_definition():
    # a trigram seen three times with other text between, or a short repeat the text moves on from, is no loop
    assert not loops_in([7, 1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]) and not loops_in([1, 2, 3] * 4 + [9])
    assert loops_in([5, 6] * 6) and loops_in([9, 8] + [1, 2, 3] * 4)
    assert not loops_in(list(range(64)))


def test_a_rerun_falls_back_into_the_loop_when_it_ends_in_the_loops_piece_twice():
    piece = (1, 2, 3)
    assert fell_back([9, 2, 3, 1, 2, 3, 1], piece) and fell_back([7, 1, 2, 3, 1, 2, 3], piece)
    assert not fell_back([1, 2, 3, 1, 2, 4], piece) and not fell_back([4, 5, 6, 4, 5, 6], piece)
    assert not fell_back([1, 2, 3], piece) and not fell_back([1, 2, 3, 1, 2, 3], None)


def test_a_rerun_that_ends_its_text_early_has_stopped_not_broken_the_loop():
    ended = _cause("sampler", "temperature 0 -> 1", ([4, 5, 6, 7, 8, 9, 10, 11, 12], "nine tokens", "eos"), 32)
    assert ended.outcome == "stopped" and not ended.loop_gone and ended.as_dict()["outcome"] == "stopped"
    full = _cause("sampler", "x", (list(range(48)), "t", "max_new_tokens"), 32)      # past the run's 32 tokens
    assert full.outcome == "loop gone" and full.loop_gone and full.as_dict()["loop_gone"] and full.loop is None
    kept = _cause("sampler", "x", ([1, 2, 3] * 5, "t", "loop"), 32)
    assert kept.outcome == "loop kept" and not kept.loop_gone and isinstance(kept, Cause)
    assert kept.loop == {"start": 0, "period": 3, "count": 5, "end": 15} and kept.verdict.startswith("loop kept")


def test_prompt_spans_are_sentences_covering_the_prompt_then_words_and_at_most_six():
    spans = prompt_spans(PROMPT)
    assert [PROMPT[a:b] for a, b in spans] == ["I like apples.", " I like apples.", " I like"]
    assert "".join(PROMPT[a:b] for a, b in spans) == PROMPT
    words = prompt_spans("one two three")
    assert [("one two three")[a:b] for a, b in words] == ["one", " two", " three"]
    many = "A. " * 20 + "end"
    assert len(prompt_spans(many)) == 6 and prompt_spans(many)[0][0] == 0 and prompt_spans(many)[-1][1] == len(many)


def test_a_loop_free_control_reports_no_loop_and_no_causes(tiny_model):
    report = why_loop(tiny_model, RunSettings(prompt="Tell me about caches.", chat=False))
    assert report.status == "no loop" and report.causes == [] and report.reruns == 1
    assert report.as_dict()["causes"] == []


def test_a_loop_made_by_the_unembedding_is_kept_by_every_change_tried(looper):
    """The looper's logits (20 apart) make its cycle survive every head, sampler rung, dtype and prompt span; no
    no_repeat_ngram rung is tried (it forbids an exact repeat by construction, a fix only by definition)."""
    report = why_loop(looper, RunSettings(prompt=PROMPT, chat=False))
    assert report.status == "loop" and report.loop["period"] == 3 and report.loop["start"] == 0
    kinds = {c.kind for c in report.causes}
    assert kinds == {"heads", "sampler", "numerics", "prompt"} and report.reruns <= 40
    heads = [c for c in report.causes if c.kind == "heads"]
    # one cause per ladder: none of k = 1, 2, 4, 8 broke it, so the largest is reported with every k tried
    assert [c.detail["k"] for c in heads] == [8] and not heads[0].loop_gone and heads[0].detail["tried"] == [1, 2, 4, 8]
    assert not any(c.detail.get("setting") == "no_repeat_ngram" for c in report.causes)
    assert [c.detail["setting"] for c in report.causes if c.kind == "sampler"] == [
        "repetition_penalty", "frequency_penalty", "presence_penalty", "temperature"]
    for c in report.causes:        # each rerun stops once back in the loop: its 3-token piece twice (fell_back)
        assert c.outcome == "loop kept" and not c.loop_gone and c.stopped == "loop" and c.tokens == 6
        assert c.text_after


def test_the_loop_diagnosed_is_the_loop_of_the_users_run(looper):
    """The run the page shows (16 tokens) is the run diagnosed: its loop, its length, said in the first line."""
    settings = RunSettings(prompt=PROMPT, chat=False, max_new_tokens=16)
    shown = generate(looper, PROMPT, max_new_tokens=16)
    loop = tail_loop(shown.token_ids)
    report = why_loop(looper, settings, max_reruns=7)
    assert report.loop == loop.as_dict() and report.horizon == 16 and report.run_tokens == 16
    assert not report.looked_further and report.baseline_text == shown.text
    assert report.headline.startswith(f"Your run's 16 generated tokens end in a loop from step {loop.start} with "
                                      f"period 3 (×{loop.count})")


def test_a_run_without_a_loop_is_said_plainly_and_only_then_looked_at_further(looper):
    short = RunSettings(prompt=PROMPT, chat=False, max_new_tokens=8)       # under 12 tokens: no loop yet
    report = why_loop(looper, short)
    assert report.status == "no loop" and report.reruns == 1 and report.causes == []
    assert report.headline.startswith("Your run's 8 generated tokens hold no loop: there is nothing to diagnose.")
    assert f"up to {LOOK_FURTHER} tokens" in report.headline
    further = why_loop(looper, short, look_further=20, max_reruns=7)
    assert further.looked_further and further.horizon == 20 and further.run_tokens == 8
    assert further.headline.startswith("Your run's 8 generated tokens hold no loop, so this diagnoses a longer rerun "
                                       "of the same prompt and seed (20 tokens), which loops from step 0 with period 3")
    assert further.loop == tail_loop(generate(looper, PROMPT, max_new_tokens=20).token_ids).as_dict()


def test_the_rerun_budget_is_kept_and_what_was_left_out_is_said(looper):
    report = why_loop(looper, RunSettings(prompt=PROMPT, chat=False), max_reruns=7)
    assert report.reruns == 7 and report.skipped
    # baseline + 4 head reruns (one cause) + 2 repetition_penalty rungs (one cause, the last rung tried)
    assert "sampler" in report.skipped[0] and len(report.causes) == 1 + 1
    assert report.as_dict() == why_loop(looper, RunSettings(prompt=PROMPT, chat=False), max_reruns=7).as_dict()


# ---- fp32 rescue ----------------------------------------------------------------------------------
def test_units_are_searched_resid_latest_first_and_the_complement_drops_covering_resid_units():
    units = precision_units(3)
    assert units[:3] == ["blocks.2.resid", "blocks.1.resid", "blocks.0.resid"]
    assert units[3:5] == ["blocks.0.attn", "blocks.0.mlp"] and units[-2:] == ["final_norm", "logits"]
    rest = complement(units, ["blocks.1.resid"])
    assert "blocks.0.resid" not in rest and "blocks.1.resid" not in rest and "blocks.2.resid" in rest
    assert complement(units, ["blocks.1.mlp"]) == [u for u in units if u != "blocks.1.mlp"]
    assert forward_order(["logits", "blocks.1.resid", "final_norm", "blocks.1.mlp", "blocks.0.attn"]) == \
        ["blocks.0.attn", "blocks.1.mlp", "blocks.1.resid", "final_norm", "logits"]


def test_a_stream_overflow_is_rescued_by_that_layers_resid_and_its_complement_fails(tiny_model, tiny_fp16):
    report = find_rescue(tiny_model, tiny_fp16, RunSettings(prompt=PROMPT, chat=False), injections=[OVERFLOW])
    assert report.trigger[0] == "nonfinite" and report.trials[0].first_nonfinite == "blocks.1.mlp_out"
    assert report.fp32 == ["blocks.1.resid"] and report.verified and report.finite
    assert report.top1_agreement >= 0.99 and report.bound == 3 + 6
    # three reruns: none (first NaN/Inf in layer 1), the stream in fp32 from layer 1 (passes: it is the set, the
    # prefixes of later resid units are known to fail), the complement; the old full bisection took 8
    assert [t.units for t in report.trials] == [[], ["blocks.1.resid"], report.trials[2].units]
    assert report.reruns == 3 and report.trials[2].label == "the complement"
    assert report.complement["fixes"] is False and not report.complement["finite"]
    d = report.as_dict()
    assert {"fp32", "reruns", "finite", "top1_agreement"} <= set(d) and len(d["trials"]) == d["reruns"]


def test_plans_whose_units_all_lie_after_the_first_nonfinite_layer_fail_there_as_the_search_assumes(tiny_model,
                                                                                                     tiny_fp16):
    """The premise of the search's known failures: with the first NaN/Inf in layer 0, a plan with no unit there,
    whatever comes after, meets the same first NaN/Inf as the plan with no unit (blocks.0.mlp_out)."""
    settings, fault = RunSettings(prompt=PROMPT, chat=False), "scale=1e6@blocks.0.mlp_out"
    reference = fp32_reference(tiny_model, torch.float16, settings, MAX_NEW_TOKENS, injections=[fault])
    for units in ([], ["blocks.1.resid"], ["blocks.1.attn"], ["blocks.1.attn", "blocks.1.mlp", "final_norm", "logits"]):
        trial = judge(reference, precision_plan(tiny_fp16, units, source=tiny_model) if units else tiny_fp16)
        assert not trial.finite and trial.first_nonfinite == "blocks.0.mlp_out", units
    assert known_failing(precision_units(2), judge(reference, tiny_fp16)) == 1       # blocks.1.resid only
    assert judge(reference, precision_plan(tiny_fp16, ["blocks.0.resid"], source=tiny_model)).finite


def test_an_mlp_overflow_needs_the_mlp_and_its_resid_within_the_bound(tiny_model, tiny_fp16):
    report = find_rescue(tiny_model, tiny_fp16, RunSettings(prompt=PROMPT, chat=False),
                         injections=["scale=1e6@blocks.1.mlp.up"])
    assert report.fp32 == ["blocks.1.mlp", "blocks.1.resid"] and report.reruns <= report.bound
    assert report.trials[-2].label == "the set + blocks.1.resid" and report.trials[-2].passes()


def test_a_healthy_run_needs_no_unit_and_a_fault_fp32_cannot_survive_is_not_rescued(tiny_model, tiny_fp16):
    healthy = find_rescue(tiny_model, tiny_fp16, RunSettings(prompt=PROMPT, chat=False))
    assert healthy.fp32 == [] and healthy.trigger == [] and healthy.reruns == 1
    nan = find_rescue(tiny_model, tiny_fp16, RunSettings(prompt=PROMPT, chat=False),
                      injections=["nan@blocks.1.mlp.act:3"])
    assert nan.fp32 is None and nan.reruns == 0 and "fp32 run itself is not finite" in nan.note


# ---- quantization ---------------------------------------------------------------------------------
def test_requantize_runs_its_blocks_along_the_input_dimension():
    """Output columns of scale 1 and 0.001 side by side: blocks along the input (GGUF's rows) keep every
    column's relative error at Q4_0's level; blocks across outputs would crush the small columns."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g) * torch.tensor([1.0, 1e-3] * 16)           # (in, out)
    back = requantize(w, "Q4_0")
    assert back.shape == w.shape and back.dtype == torch.float32
    rel = (back - w).norm(dim=0) / w.norm(dim=0)
    assert float(rel.max()) < 0.2
    assert torch.equal(requantize(w, "F32"), w)


def test_requantize_names_unknown_formats_and_rows_that_are_not_whole_blocks():
    with pytest.raises(InputError, match="unknown GGUF format"):
        requantize(torch.zeros(64, 4), "Q3_Z")
    with pytest.raises(InputError, match="Q8_0 cannot quantize"):
        requantize(torch.zeros(40, 4), "Q8_0")


def test_f32_compares_to_exactly_zero_and_q8_0_damages_less_than_q4_0(tiny_model):
    ids = tiny_model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 2)
    report = compare_formats(tiny_model, ids, 4, ["F32", "Q8_0", "Q4_0"])
    f32, q8, q4 = (report.result(f) for f in ("F32", "Q8_0", "Q4_0"))
    assert all(r["rel_err"] == 0.0 for r in f32.per_stage) and f32.kld_mean == 0.0 and f32.same_top == 1.0
    assert len(f32.kld) == report.steps == len(ids) - 4
    assert q8.kld_mean < q4.kld_mean and q8.same_top >= q4.same_top
    names = [r["stage"] for r in q8.per_stage]
    assert names[0] == "embed" and names[-1] == "logits" and not any("pattern" in n for n in names)
    loose = report.with_threshold(1e-9)
    assert loose.result("Q4_0").first_layer_over == 0 and loose.result("F32").first_layer_over is None
    assert report.result("Q4_0").kld == loose.result("Q4_0").kld


# ---- command line ---------------------------------------------------------------------------------
def stand_in_common(model: Model) -> SimpleNamespace:
    """What engine/cli/args.py gives subcommand modules, small enough for a test."""
    def model_args(p):
        p.add_argument("--model"), p.add_argument("--device"), p.add_argument("--dtype")

    def prompt_args(p):
        p.add_argument("prompt"), p.add_argument("--chat", action="store_true"), p.add_argument("--system")
        p.add_argument("--allow-special", action="store_true")

    def sampling_args(p):
        p.add_argument("--max-new-tokens", type=int, default=64), p.add_argument("--seed", type=int, default=0)
        for f in fields(SamplingParams):
            p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)

    def sampling_params(a):
        return SamplingParams(**{f.name: getattr(a, f.name) for f in fields(SamplingParams)})
    return SimpleNamespace(model_args=model_args, prompt_args=prompt_args, sampling_args=sampling_args,
                           sampling_params=sampling_params, load=lambda a: model)


def parser_for(model: Model) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_commands(sub, stand_in_common(model))
    d = sub.add_parser("doctor")
    common = stand_in_common(model)
    common.prompt_args(d), common.sampling_args(d), common.model_args(d)
    d.add_argument("--ignore-eos", action="store_true")
    add_doctor_flags(d)
    return parser


def test_quant_command_prints_strict_json_per_format(tiny_model, capsys):
    a = parser_for(tiny_model).parse_args(["quant", "Hello there", "--formats", "F32,Q8_0", "--max-new-tokens", "4",
                                           "--json"])
    assert a.fn(a) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["formats"]) == {"F32", "Q8_0"} and out["steps"] == 4
    for r in out["formats"].values():
        assert {"kld_mean", "same_top", "first_layer_over", "per_stage"} <= set(r)
    assert out["formats"]["F32"]["kld_mean"] == 0.0
    for bad in (",", "Q9_9"):
        a = parser_for(tiny_model).parse_args(["quant", "Hello", "--formats", bad])
        with pytest.raises(InputError):
            a.fn(a)


def test_doctor_fp32_runs_the_plan_and_rescue_and_why_loop_extend_the_report(tiny_model, tiny_model_dir, tiny_fp16):
    parser = parser_for(tiny_fp16)
    base = ["doctor", PROMPT, "--model", str(tiny_model_dir), "--device", "cpu", "--max-new-tokens", "6"]
    a = parser.parse_args(base + ["--fp32", "blocks.1.resid"])
    plan = doctor_model(tiny_fp16, a)
    assert plan.fp32_units == ["blocks.1.resid"] and plan.resid_fp32_from == 1
    fixed = run_doctor(plan, PROMPT, injections=[OVERFLOW], max_new_tokens=6)
    assert fixed.first_nonfinite is None
    rest = complement(precision_units(2), ["blocks.1.resid"])
    broken = run_doctor(doctor_model(tiny_fp16, parser.parse_args(base + ["--fp32", ",".join(rest)])), PROMPT,
                        injections=[OVERFLOW], max_new_tokens=6)
    assert broken.first_nonfinite is not None and broken.first_nonfinite.stage == "blocks.1.mlp_out"
    assert extend_doctor(plan, a, fixed.as_dict())["fp32"] == ["blocks.1.resid"]
    a = parser.parse_args(base + ["--rescue", "--why-loop"])
    out = extend_doctor(tiny_fp16, a, {"injections": [OVERFLOW], "norm_eps": None})
    assert out["rescue"]["fp32"] == ["blocks.1.resid"] and out["rescue"]["tokens"] == 6
    assert out["why_loop"]["status"] == "no loop" and out["causes"] == []
    json.dumps(out)


def test_doctor_flags_refuse_what_cannot_work(tiny_model, tiny_model_dir, tiny_fp16):
    parser = parser_for(tiny_model)
    with pytest.raises(InputError, match="--dtype float16"):
        doctor_model(tiny_model, parser.parse_args(["doctor", "x", "--fp32", "blocks.0.mlp"]))
    with pytest.raises(InputError, match="unknown precision unit"):     # --model: its fp32 copy, not the bundled one
        doctor_model(tiny_fp16, parser.parse_args(["doctor", "x", "--device", "cpu", "--fp32", "blocks.9.mlp",
                                                   "--model", str(tiny_model_dir)]))
    with pytest.raises(InputError, match="at least one unit"):
        doctor_model(tiny_fp16, parser.parse_args(["doctor", "x", "--fp32", " , "]))
    with pytest.raises(InputError, match="add --dtype float16"):
        extend_doctor(tiny_model, parser.parse_args(["doctor", "x", "--rescue"]), {"injections": []})


def test_doctor_why_loop_diagnoses_the_run_asked_for_and_looks_further_only_when_told(looper):
    parser = parser_for(looper)
    base = ["doctor", PROMPT, "--device", "cpu", "--max-new-tokens", "8", "--why-loop"]
    out = extend_doctor(looper, parser.parse_args(base), {})
    lines = human_lines(out)
    assert lines[0].startswith("why the loop: Your run's 8 generated tokens hold no loop: there is nothing to diagnose")
    assert lines[1] == (f"  to look further: add --why-loop-tokens {LOOK_FURTHER} (reruns the same prompt and seed "
                        f"for {LOOK_FURTHER} tokens)") and out["causes"] == [] and out["why_loop"]["reruns"] == 1
    out = extend_doctor(looper, parser.parse_args(base + ["--why-loop-tokens", "16"]), {})
    assert out["why_loop"]["looked_further"] and out["why_loop"]["horizon"] == 16
    assert human_lines(out)[0].startswith("why the loop: Your run's 8 generated tokens hold no loop, so this diagnoses "
                                          "a longer rerun of the same prompt and seed (16 tokens)")
    with pytest.raises(InputError, match="above --max-new-tokens \\(8\\), got 8"):
        extend_doctor(looper, parser.parse_args(base + ["--why-loop-tokens", "8"]), {})
    with pytest.raises(InputError, match="goes with --why-loop"):
        extend_doctor(looper, parser.parse_args(base[:-1] + ["--why-loop-tokens", "16"]), {})


# ---- views ----------------------------------------------------------------------------------------
def test_views_name_their_axes_and_colorscales(looper, tiny_model, tiny_fp16):
    wl = why_loop(looper, RunSettings(prompt=PROMPT, chat=False), max_reruns=7)
    df = pv.causes_frame(wl)
    assert list(df.columns) == pv.CAUSE_COLUMNS and len(df) == len(wl.causes)
    fig = pv.causes_figure(wl)
    assert fig.layout.xaxis.title.text and fig.layout.yaxis.title.text
    rs = find_rescue(tiny_model, tiny_fp16, RunSettings(prompt=PROMPT, chat=False), injections=[OVERFLOW])
    grid = pv.rescue_grid(["blocks.0.resid", "blocks.1.mlp"], 2)
    assert grid.loc["layer 0", "resid"] == 2 and grid.loc["layer 1", "resid"] == 1 and grid.loc["layer 1", "mlp"] == 2
    heat = pv.rescue_figure(rs, 2)
    assert heat.data[0].colorscale and heat.layout.xaxis.title.text and heat.layout.yaxis.title.text
    assert len(pv.rescue_trials_frame(rs)) == rs.reruns
    ids = tiny_model.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    qr = compare_formats(tiny_model, ids, 3, ["Q8_0", "Q4_0"])
    lines = pv.quant_layers_figure(qr)
    assert [t.name for t in lines.data] == ["Q8_0", "Q4_0"] and lines.layout.xaxis.title.text == "layer"
    qh = pv.quant_heatmap(qr, "Q4_0")
    assert qh.data[0].colorscale and qh.layout.yaxis.title.text and qh.layout.xaxis.title.text
    assert list(pv.quant_summary_frame(qr)["format"]) == ["Q8_0", "Q4_0"]
