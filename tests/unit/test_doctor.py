"""NaN/Inf doctor: injections are found exactly where they were planted (library and CLI), the teaching
presets reproduce their failures, and fp32 vs fp16/bf16 comparison."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

from engine import InputError, SamplingParams
from engine.generate import nonfinite_stop
from engine.inspection.nonfinite import lead_up, locate_nonfinite
from engine.tools.doctor import FP16_MAX, PRESETS, Injection, fault_probe, precision_compare, run_doctor
from engine.variants import cast_model
from tests.helpers import engine_cli

IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2683]
FOX = "The quick brown fox jumps over the lazy dog"


def cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m engine ARGS` through its entry point in this process (tests.helpers.engine_cli)."""
    return engine_cli(*args)


def test_parse_injections():
    assert Injection.parse("nan@blocks.17.mlp.act:5") == Injection("nan", "blocks.17.mlp.act", 5)
    assert Injection.parse("scale=4@blocks.11.mlp.act") == Injection("scale", "blocks.11.mlp.act", None, 4.0)
    assert Injection.parse(" zero@embed:2 ").spec == "zero@embed:2"
    assert Injection.parse("scale=1e3@blocks.0.attn.q:1").spec == "scale=1000@blocks.0.attn.q:1"
    for bad in ["nan", "nan@", "boom@embed", "scale=x@embed", "nan@blocks.1.mlp.act:-1", "nan@embed:a"]:
        with pytest.raises(InputError):
            Injection.parse(bad)


def test_unknown_targets_are_errors(tiny_model):
    for spec, msg in [("nan@blocks.9.mlp.act", "unknown stage"), ("nan@blocks.9.mlp.w_down", "layers 0..1"),
                      ("nan@tokenizer", "unknown stage"), ("nan@blocks.0.mlp.nope", "unknown stage")]:
        with pytest.raises(InputError, match=msg):
            fault_probe(tiny_model, [spec])


@pytest.mark.parametrize("stage,layer,position", [
    ("blocks.1.mlp.act", 1, 4), ("blocks.0.attn.v", 0, 0), ("blocks.1.attn.scores", 1, 6),
    ("blocks.0.resid_post", 0, 7), ("embed", None, 3), ("final_norm", None, 5)])
@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_planted_value_is_reported_exactly(tiny_model, stage, layer, position, kind):
    rep = run_doctor(tiny_model, IDS, injections=[f"{kind}@{stage}:{position}"], max_new_tokens=2)
    nf = rep.first_nonfinite
    assert (nf.step, nf.stage, nf.layer, nf.position) == (0, stage, layer, position)
    assert nf.stats[kind] >= 1
    assert rep.lead_up[-1]["stage"] == stage and all(r["nan"] + r["inf"] == 0 for r in rep.lead_up[:-1])
    # when the fault reached the last position's logits (the recorded statistics say so), the engine refused
    # to sample from them; otherwise the doctor stopped at the step that went non-finite. Never a fake "eos".
    logits_bad = any(r.values[:, 5:7].sum() > 0 for r in rep.probe.recording.stat_records("logits"))
    assert rep.result.stop_reason == ("non-finite logits" if logits_bad else "nonfinite")
    assert (nonfinite_stop(rep.result) is not None) == logits_bad
    assert len(rep.result.token_ids) == (0 if logits_bad else 1)      # step 0 draws only from finite logits


def test_plant_in_a_decode_step(tiny_model):
    """Position 10 of an 8-token prompt is fed at step 3 (step s > 0 feeds position n_prompt + s - 1)."""
    rep = run_doctor(tiny_model, IDS, injections=["nan@blocks.1.attn.q_rot:10"], max_new_tokens=6, ignore_eos=True)
    nf = rep.first_nonfinite
    assert (nf.step, nf.stage, nf.layer, nf.position) == (3, "blocks.1.attn.q_rot", 1, 10)
    # step 3's logits are all NaN (the last layer's query at the position decoded): nothing is drawn from them
    assert len(rep.result.token_ids) == 3 and rep.result.stop_reason == "non-finite logits"
    assert nonfinite_stop(rep.result) == {"step": 3, "position": 10, "nan": tiny_model.config.vocab_size, "inf": 0}
    full = run_doctor(tiny_model, IDS, injections=["nan@blocks.1.attn.q_rot:10"], max_new_tokens=6,
                      ignore_eos=True, stop_at_nonfinite=False)
    assert full.result.token_ids == rep.result.token_ids and full.first_nonfinite.as_dict() == nf.as_dict()
    assert full.result.stop_reason == "non-finite logits"          # --keep-going cannot sample from NaN either


def test_weight_scale_zero_and_sampler_injections(tiny_model):
    before = tiny_model.weights.layers[1].w_down.clone()
    nf = run_doctor(tiny_model, IDS, injections=["inf@blocks.1.mlp.w_down:300"], max_new_tokens=1).first_nonfinite
    assert (nf.stage, nf.layer, nf.position) == ("blocks.1.mlp_out", 1, 0)
    assert torch.equal(tiny_model.weights.layers[1].w_down, before)
    probe = fault_probe(tiny_model, ["scale=1e38@blocks.0.mlp.up:2", "zero@blocks.1.attn_out:1"]).capture(
        "blocks.1.attn_out")
    tiny_model.logits(IDS, probe)
    out = probe.recording.captured("blocks.1.attn_out")[0].value
    assert float(out[1].abs().max()) == 0 and float(out[0].abs().max()) > 0
    nf = locate_nonfinite(probe.recording)
    assert (nf.stage, nf.position) in {("blocks.0.mlp.up", 2), ("blocks.0.mlp.act", 2)}
    rep = run_doctor(tiny_model, IDS, injections=["nan@sampler.top_p:8"], max_new_tokens=2,
                     params=SamplingParams(temperature=0.7))
    assert (rep.first_nonfinite.stage, rep.first_nonfinite.position) == ("sampler.top_p", 8)
    assert rep.result.stop_reason == "error" and "distribution" in rep.error     # no draw from NaN


def test_rmsnorm_eps0_preset(tiny_model):
    p = PRESETS["rmsnorm-eps0"]
    nf = run_doctor(tiny_model, IDS, injections=p.injections, norm_eps=p.norm_eps, max_new_tokens=1).first_nonfinite
    assert (nf.stage, nf.layer, nf.position) == ("blocks.0.attn_norm", 0, 2) and nf.stats["nan"] == 64
    assert run_doctor(tiny_model, IDS, injections=p.injections, max_new_tokens=1).first_nonfinite is None


@pytest.mark.model
def test_nan_preset_on_the_bundled_model(bundled_model):
    rep = run_doctor(bundled_model, FOX, injections=PRESETS["nan-activation"].injections, max_new_tokens=1)
    nf = rep.first_nonfinite
    assert (nf.step, nf.stage, nf.layer, nf.position) == (0, "blocks.17.mlp.act", 17, 3)
    assert [r["stage"] for r in lead_up(rep.probe.recording, nf, 2)] == ["blocks.17.mlp.gate", "blocks.17.mlp.up",
                                                               "blocks.17.mlp.act"]


@pytest.mark.model
def test_fp16_overflow_preset(bundled_model):
    """float16 copy, layer 11's MLP activation ×4: the first token's massive activation overflows where the
    same run in fp32 first passes 65504, and the fp16 run without the fault stays finite."""
    p = PRESETS["fp16-overflow"]
    m16 = cast_model(bundled_model, p.dtype)
    assert m16.dtype == torch.float16 and bundled_model.dtype == torch.float32
    rep = run_doctor(m16, FOX, injections=p.injections, max_new_tokens=1)
    nf = rep.first_nonfinite
    assert nf is not None and nf.stats["inf"] >= 1
    ref = fault_probe(bundled_model, p.injections)
    bundled_model.logits(bundled_model.tokenizer.encode(FOX), ref)
    over = next((r, int(r.values[:, 4].argmax())) for r in ref.recording.stat_records()
                if float(r.values[:, 4].max()) > FP16_MAX)
    assert (nf.stage, nf.position) == (over[0].name, over[1]) == ("blocks.11.mlp_out", 0)
    assert float(lead_up(rep.probe.recording, nf, 1)[0]["absmax"]) < FP16_MAX        # mlp.act itself still fits
    assert run_doctor(m16, FOX, max_new_tokens=1).first_nonfinite is None


@pytest.mark.model
def test_precision_compare(tiny_model, bundled_model):
    same = precision_compare(tiny_model, cast_model(tiny_model, "float32"), IDS)
    assert all(r["rel_err"] == 0 for r in same.rows) and same.divergence is None and same.top1_agreement == 1
    names = [n for n in tiny_model.hook_names() if n not in ("tokenizer", "detokenizer")
             and not n.startswith("sampler.") and not n.endswith(("attn.scores", "attn.pattern"))]
    assert [r["stage"] for r in same.rows] == names
    low = precision_compare(tiny_model, cast_model(tiny_model, "bfloat16"), IDS, threshold=1e-9)
    assert low.divergence == low.rows[0] and 0 < low.rows[0]["rel_err"] < 2 ** -8
    rep = precision_compare(bundled_model, cast_model(bundled_model, "float16"), bundled_model.tokenizer.encode(FOX))
    by = {r["stage"]: r["rel_err"] for r in rep.rows}
    assert rep.threshold == 8 * 2 ** -11 and 0 < by["embed"] < 2 ** -11       # one rounding of the weights
    assert by["logits"] < 0.02 and rep.top1_agreement >= 0.9


@pytest.mark.model                  # the command loads the model itself: slower than the unit loop
def test_cli_doctor_json_tiny(tiny_model_dir):
    r = cli("doctor", "one two three four five", "--model", str(tiny_model_dir), "--max-new-tokens", "5",
            "--ignore-eos", "--inject", "nan@blocks.1.mlp.act:7", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    nf = out["first_nonfinite"]
    assert (nf["step"], nf["stage"], nf["layer"], nf["position"]) == (7 - out["prompt_tokens"] + 1,
                                                                     "blocks.1.mlp.act", 1, 7)
    assert nf["stats"]["nan"] == 1 and out["injections"] == ["nan@blocks.1.mlp.act:7"]
    assert isinstance(out["loops"], list)
    r = cli("doctor", "hi there, how are you", "--model", str(tiny_model_dir), "--max-new-tokens", "1", "--compare",
            "float16",
            "--preset", "rmsnorm-eps0")
    assert r.returncode == 0, r.stderr
    assert "first non-finite: step 0, stage blocks.0.attn_norm, layer 0, position 2" in r.stdout
    assert "precision float16" in r.stdout
    r = cli("doctor", "hi", "--model", str(tiny_model_dir), "--inject", "nan@blocks.7.mlp.act")
    assert r.returncode == 2 and "unknown stage" in r.stderr


@pytest.mark.model                  # the command loads the model itself: slower than the unit loop
def test_cli_doctor_json_bundled_loop_then_nan():
    """Greedy repeat over 13 tokens, then a NaN planted at position 22 (fed at step 13, the last step)."""
    r = cli("doctor", "I like apples. I like apples. I like", "--max-new-tokens", "14", "--inject",
            "nan@blocks.17.mlp.act:22", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_tokens"] == 10
    nf = out["first_nonfinite"]
    assert (nf["step"], nf["stage"], nf["layer"], nf["position"]) == (13, "blocks.17.mlp.act", 17, 22)
    # ". I'm a big apple" twice (steps 1-12) is not yet a loop: a loop holds three full periods
    # (engine.inspection.loops)
    assert out["loops"] == []
    assert out["lead_up"][-1]["stage"] == "blocks.17.mlp.act" and out["lead_up"][-1]["nan"] == 1
    # the NaN reaches step 13's logits: the run stops there with 13 tokens, none drawn from them
    assert out["stop_reason"] == "non-finite logits" and out["generated_tokens"] == 13
    assert (out["nonfinite_logits"]["step"], out["nonfinite_logits"]["position"]) == (13, 22)


@pytest.mark.model                  # the command loads the model itself: slower than the unit loop
def test_cli_doctor_fp16_overflow_preset():
    r = cli("doctor", FOX, "--preset", "fp16-overflow", "--max-new-tokens", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    nf = out["first_nonfinite"]
    assert out["model_dtype"] == "float16"
    assert (nf["step"], nf["stage"], nf["layer"], nf["position"]) == (0, "blocks.11.mlp_out", 11, 0)
    assert nf["stats"]["absmax"] == "Infinity"                           # strict JSON


@pytest.mark.model                  # the command loads the model itself: slower than the unit loop
def test_cli_nan_logits_stop_reason_in_doctor_json_and_trace_file(tiny_model_dir, tmp_path):
    """NaN logits at the prefill used to be sampled (argmax picks token 0, <|endoftext|>) and reported as "eos"
    with nothing generated; now every surface says "non-finite logits" and names step 0."""
    common = ("one two three", "--model", str(tiny_model_dir), "--max-new-tokens", "4", "--inject", "nan@logits")
    r = cli("doctor", *common, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    n = out["prompt_tokens"]
    assert (out["stop_reason"], out["generated_tokens"], out["token_ids"]) == ("non-finite logits", 0, [])
    assert out["nonfinite_logits"] == {"step": 0, "position": n - 1, "nan": 1, "inf": 0}
    assert (out["first_nonfinite"]["stage"], out["first_nonfinite"]["position"]) == ("logits", n - 1)
    human = cli("doctor", *common)
    assert "stop: non-finite logits" in human.stdout
    assert f"step 0 (position {n - 1}): the logits held 1 NaN" in human.stdout
    r = cli("trace", *common, "--out", str(tmp_path / "nan.trace"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stop_reason"] == "non-finite logits"
    from engine import load_trace
    t = load_trace(tmp_path / "nan.trace")
    assert (t.result.stop_reason, t.result.token_ids, t.result.steps) == ("non-finite logits", [], [])
    nf = t.first_nonfinite
    assert (nf["step"], nf["stage"], nf["position"]) == (0, "logits", n - 1)


def test_precision_compare_reports_progress_per_layer(tiny_model):
    heard = []
    precision_compare(tiny_model, cast_model(tiny_model, "bfloat16"), IDS,
                      on_progress=lambda p: heard.append((p.done, p.total)))
    L = tiny_model.config.num_layers
    assert heard == [(k, 2 * L) for k in range(2 * L + 1)]      # before each layer of both forwards, then the end
