"""Trace files: a run round-trips through its file with nothing lost; the file is safetensors + JSON only;
the CLI writes one; a reopened trace works as the app's run."""
from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as st_save

from engine import EngineError, RunSettings, SamplingParams, Trace, make_trace
from engine.generate import generate
from engine.inspection.loops import Loop
from engine.inspection.recording import Recording
from engine.inspection.trace import from_bytes, load_trace, save_trace, to_bytes
from engine.tools.doctor import fault_probe
from engine.variants import cast_model
from inspector.session.run import inspect_run
from tests.helpers import engine_cli

ROOT = Path(__file__).resolve().parents[2]


def same(a, b) -> bool:
    """Deep equality where NaN equals NaN, tensors compare by dtype, shape and every element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(torch.nan_to_num(a.float(), nan=7.25), torch.nan_to_num(
                    b.float(), nan=7.25)) and torch.equal(a.isnan(), b.isnan()))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
                                          if f.name != "recording")
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def assert_recording_equal(p, q):
    assert (p.step, p.pos0) == (q.step, q.pos0)
    assert p.watched == q.watched                     # timing, norm_eps, statistics and capture patterns
    assert same(p.marks, q.marks) and len(p.marks) > 0
    assert len(p.stats) == len(q.stats) > 0
    for a, b in zip(p.stats, q.stats):
        assert (a.step, a.pos0, a.names, a.layers) == (b.step, b.pos0, b.names, b.layers)
        assert same(a.values, b.values)
    assert len(p.captures) == len(q.captures) > 0
    for a, b in zip(p.captures, q.captures):
        assert (a.step, a.name, a.layer, a.positions) == (b.step, b.name, b.layer, b.positions)
        assert same(a.value, b.value)


def assert_round_trip(run, path):
    save_trace(run, path)
    back = load_trace(path)
    t = run
    for f in dataclasses.fields(t):
        if f.name not in ("result", "recording"):
            assert same(getattr(t, f.name), getattr(back, f.name)), f.name
    assert same(run.result, back.result)                 # every field of the result, steps, candidates, params
    assert back.result.recording is back.recording
    assert_recording_equal(run.recording, back.recording)
    assert path.read_bytes() == to_bytes(back)           # written again: byte for byte the same file
    return back


def test_inspected_run_round_trips(tiny_model, tmp_path):
    run = inspect_run(tiny_model, RunSettings(prompt="Hi 👋 <b>there</b>", max_new_tokens=5, seed=7,
                                              params=SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.1)))
    back = assert_round_trip(run, tmp_path / "run.trace")
    assert back.settings == run.settings and back.first_nonfinite is None
    assert back.result.cache == run.result.cache and back.result.cache["bytes_used"] > 0
    rec = back
    assert isinstance(rec, Trace) and rec.settings == run.settings and rec.ids == run.ids
    assert (rec.model_name, rec.seconds, rec.created) == (run.model_name, run.seconds, run.created)


def test_nonfinite_run_with_every_capture_kind_round_trips(tiny_model, tmp_path):
    """NaN/Inf in statistics, string and id captures, position filters, norm_eps. (The faults sit in the last
    layer at earlier positions, so the sampled position's logits stay finite and tokens are drawn.)"""
    probe = fault_probe(tiny_model, ["nan@blocks.1.mlp.act:3", "inf@blocks.1.attn.q:1"], norm_eps=1e-3, timing=True)
    probe.capture(["tokenizer", "detokenizer", "logits", "sampler.probs"]).capture("blocks.0.resid_post",
                                                                                   positions=[1, 4])
    res = generate(tiny_model, [5, 6, 7, 8, 9], max_new_tokens=3, ignore_eos=True, probe=probe)
    run = make_trace(RunSettings(prompt="x", chat=False), res, probe, tiny_model.name, 0.25)
    back = assert_round_trip(run, tmp_path / "nan.trace")
    nf = back.first_nonfinite
    assert (nf["stage"], nf["layer"], nf["position"]) == ("blocks.1.attn.q", 1, 1)
    assert back.interventions == ["replace blocks.1.mlp.act", "replace blocks.1.attn.q"]
    assert type(back.recording) is Recording and not hasattr(back, "probe")    # data only: code is never stored
    assert back.recording.watched.norm_eps == 1e-3 and back.recording.watched.timing
    kinds = {type(c.value).__name__ for c in back.recording.captures}
    assert kinds == {"Tensor", "str"}
    assert back.result.stop_reason == "max_new_tokens" and len(back.result.steps) == 3


def test_a_run_stopped_by_non_finite_logits_round_trips(tiny_model, tmp_path):
    probe = fault_probe(tiny_model, ["nan@blocks.0.attn.q:1"], timing=True).capture("logits")
    res = generate(tiny_model, [5, 6, 7, 8, 9], max_new_tokens=3, ignore_eos=True, probe=probe)
    run = make_trace(RunSettings(prompt="x", chat=False), res, probe, tiny_model.name, 0.25)
    back = assert_round_trip(run, tmp_path / "nan-logits.trace")
    assert back.result.stop_reason == "non-finite logits" and back.result.token_ids == []
    assert any(math.isnan(v) for b in back.recording.stats for v in b.values[:, :, 2].flatten().tolist())


def test_loops_and_low_precision_tensors_round_trip(tiny_model, tmp_path):
    m16 = cast_model(tiny_model, "bfloat16")
    probe = fault_probe(m16, timing=True).capture("logits")
    res = generate(m16, [11, 12, 13], max_new_tokens=4, ignore_eos=True, probe=probe)
    res = dataclasses.replace(res, token_ids=[1, 2, 3] * 4)     # a loop, whatever the model said
    run = make_trace(RunSettings(prompt="p", stop=("x",), ignore_eos=True), res, probe, m16.name, 1.0)
    back = assert_round_trip(run, tmp_path / "bf16.trace")
    assert back.recording.captures[0].value.dtype == torch.bfloat16
    assert back.loops == [Loop(0, 3, 4, 12)]
    assert back.settings.stop == ("x",)
    assert back.settings == RunSettings(prompt="p", stop=("x",), ignore_eos=True)   # every setting comes back


def test_file_is_safetensors_with_json_metadata(tiny_model, tmp_path):
    run = inspect_run(tiny_model, RunSettings(prompt="hello", max_new_tokens=2))
    data = to_bytes(run)
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = json.loads(header["__metadata__"]["llm_inspector_trace"])
    assert meta["format"] == "llm-inspector-trace" and meta["version"] == 1
    assert {k for k in header if k != "__metadata__"} == {
        *(f"stats.{i}.{x}" for i in range(len(run.recording.stats)) for x in ("values", "names", "layers")),
        *(f"capture.{i}" for i in range(len(run.recording.captures)))}
    src = (ROOT / "engine" / "inspection" / "trace.py").read_text()
    assert "pickle" not in src.replace("unpickl", "") and "torch.load" not in src


@pytest.mark.parametrize("data,msg", [
    (b"", "too short"), (b"\xff" * 64, "bad safetensors header"),
    (st_save({"x": torch.zeros(2)}), "without the trace metadata"),
    (st_save({"x": torch.zeros(2)}, metadata={"llm_inspector_trace": json.dumps({"format": "other"})}), "not an LLM"),
    (st_save({}, metadata={"llm_inspector_trace": json.dumps({"format": "llm-inspector-trace", "version": 99})}),
     "version 99"),
    (st_save({}, metadata={"llm_inspector_trace": json.dumps({"format": "llm-inspector-trace", "version": 1})}),
     "damaged"),
])
def test_bad_files_are_errors(data, msg):
    with pytest.raises(EngineError, match=msg):
        from_bytes(data)


@pytest.mark.model                  # the command loads the model itself: slower than the unit loop
def test_cli_trace(tiny_model_dir, tiny_model, tmp_path):
    out = tmp_path / "cli.trace"
    r = engine_cli("trace", "count: one two", "--model", str(tiny_model_dir), "--max-new-tokens", "3",
                   "--temperature", "0.8", "--seed", "5", "--ignore-eos", "--inject", "nan@blocks.1.attn.z:2",
                   "--out", str(out))
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["out"] == str(out) and info["generated_tokens"] <= 3
    t = load_trace(out)
    assert t.first_nonfinite["stage"] == "blocks.1.attn.z" and t.first_nonfinite["position"] == 2
    assert t.extra["injections"] == ["nan@blocks.1.attn.z:2"] and t.extra["dtype"] == "float32"
    assert t.settings.seed == 5 and t.settings.params.temperature == 0.8 and t.settings.chat is False
    assert t.recording.marks and {c.name for c in t.recording.captures} == {"logits"}
    assert {r.step for r in t.recording.stat_records()} == set(range(len(t.result.steps)))
    clean = engine_cli("trace", "count: one two", "--model", str(tiny_model_dir), "--max-new-tokens", "3",
                       "--seed", "5", "--out", str(tmp_path / "c.trace"))
    assert clean.returncode == 0, clean.stderr
    t = load_trace(tmp_path / "c.trace")
    assert t.result.token_ids == generate(tiny_model, "count: one two", max_new_tokens=3, seed=5).token_ids
