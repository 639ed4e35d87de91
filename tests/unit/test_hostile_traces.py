"""Crafted trace files: every one is refused with one clear message naming what is wrong, quickly, without
building what it declares; the model keeps working. (The same files through `python -m engine show`:
tests/model/test_hostile_cli.py; through the app: tests/app/test_bad_input.py.)"""
from __future__ import annotations

import json
import struct
import time

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from engine import EngineError, RunSettings, SamplingParams
from engine.trace import META_KEY, from_bytes, to_bytes
from engine.trace_check import TraceBounds
from inspector.session.run import inspect_run

pytestmark = pytest.mark.unit
DEEP = "[" * 100_000 + "]" * 100_000


def split(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def join(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def with_meta(data: bytes, change) -> bytes:
    header, body = split(data)
    meta = json.loads(header["__metadata__"][META_KEY])
    change(meta)
    header["__metadata__"][META_KEY] = json.dumps(meta)
    return join(header, body)


def with_raw_meta(data: bytes, text: str) -> bytes:
    header, body = split(data)
    header["__metadata__"][META_KEY] = text
    return join(header, body)


def with_header(data: bytes, change) -> bytes:
    header, body = split(data)
    change(header)
    return join(header, body)


def with_tensor(data: bytes, key: str, value: torch.Tensor) -> bytes:
    header, _ = split(data)
    tensors = st_load(data)
    tensors[key] = value
    return st_save(tensors, metadata=header["__metadata__"])


def setitem(path: str, value):
    """A change that sets meta[a][b]... = value (path 'result.token_ids')."""
    def change(meta):
        *head, last = path.split(".")
        d = meta
        for k in head:
            d = d[int(k)] if isinstance(d, list) else d[k]
        if isinstance(d, list):
            d[int(last)] = value
        else:
            d[last] = value
    return change


CASES = {   # name -> (how to craft it from a good file's bytes, words the message must contain)
    "stage of layer 200000000": (lambda d: with_meta(d, lambda m: m["probe"]["stat_names"].append(
        "blocks.200000000.resid_post")), "is not a stage of a model with at most"),
    "a name that is no stage": (lambda d: with_meta(d, lambda m: m["probe"]["stat_names"].append("evil")),
                                "is not a stage name"),
    "200,000 generated ids": (lambda d: with_meta(d, setitem("result.token_ids", [5] * 200_000)),
                              "token_ids must be a list of at most"),
    "no prompt": (lambda d: with_meta(d, setitem("result.prompt_ids", [])), "prompt_ids is empty"),
    "id past the vocabulary": (lambda d: with_meta(d, setitem("result.prompt_ids", [10**9])), "every id must"),
    "negative id": (lambda d: with_meta(d, setitem("result.token_ids", [-1])), "every id must"),
    "ids as text": (lambda d: with_meta(d, setitem("result.prompt_ids", ["1"])), "every id must"),
    "JSON nested 100,000 deep": (lambda d: with_raw_meta(d, '{"format": "llm-inspector-trace", "x": ' + DEEP + "}"),
                                 "nested too deeply"),
    "offsets past the end": (lambda d: with_header(d, lambda h: h["stats.0.values"].__setitem__(
        "data_offsets", [0, 10**12])), "byte range disagrees"),
    "shape disagrees with bytes": (lambda d: with_header(d, lambda h: h["stats.0.values"].__setitem__(
        "shape", [1, 1, 7])), "byte range disagrees"),
    "a huge declared capture": (lambda d: with_header(d, lambda h: h["capture.0"].update(
        shape=[1 << 20, 1 << 20], data_offsets=[0, 4 << 40])), "more numbers than this server opens"),
    "statistics outside the run": (lambda d: with_meta(d, setitem("probe.stats.0.pos0", 10**6)),
                                   "covers positions outside the run"),
    "six statistics columns": (lambda d: with_header(d, lambda h: h["stats.0.values"].update(
        shape=h["stats.0.values"]["shape"][:2] + [6])), "byte range disagrees"),
    "integer statistics": (lambda d: with_header(d, lambda h: h["stats.0.values"].__setitem__("dtype", "I64")),
                           "is missing or not"),
    "a missing tensor": (lambda d: with_header(d, lambda h: h.pop("stats.0.names")), "is missing"),
    "five-dimensional capture": (lambda d: with_header(d, lambda h: h["capture.0"].update(
        shape=[1, 1, 1, 1, h["capture.0"]["shape"][-1]])), "more than 4 dimensions"),
    "25,000 captures": (lambda d: with_meta(d, lambda m: m["probe"].__setitem__("captures", [
        m["probe"]["captures"][0]] * 25_000)), "captures must be a list of bounded length"),
    "300,000 timing marks": (lambda d: with_meta(d, setitem("probe.marks", [[0, "x", 0.0]] * 300_000)),
                             "timing marks are malformed"),
    "more steps than tokens": (lambda d: with_meta(d, lambda m: m["result"]["steps"].extend(
        m["result"]["steps"] * 3)), "at most one step per generated token"),
    "a step without its token": (lambda d: with_meta(d, lambda m: m["result"]["steps"][0].pop("token_id")),
                                 "a step must have exactly"),
    "a step with an extra field": (lambda d: with_meta(d, setitem("result.steps.0.evil", 1)),
                                   "a step must have exactly"),
    "10,000 candidates": (lambda d: with_meta(d, lambda m: m["result"]["steps"][0].__setitem__(
        "top", m["result"]["steps"][0]["top"][:1] * 10_000)), "step candidates are malformed"),
    "a 1 MB model name": (lambda d: with_meta(d, setitem("model_name", "x" * 1_000_000)), "model_name"),
    "created in the year 10^292": (lambda d: with_meta(d, setitem("created", 1e300)), "created must be"),
    "negative seconds": (lambda d: with_meta(d, setitem("seconds", -1)), "seconds must be"),
    "infinite seconds": (lambda d: with_raw_meta(d, json.dumps(json.loads(split(d)[0]["__metadata__"][META_KEY])
                                                               | {"seconds": float("inf")})), "seconds must be"),
    "unknown stop reason": (lambda d: with_meta(d, setitem("result.stop_reason", "<img src=x>")), "stop_reason"),
    "timings as a list": (lambda d: with_meta(d, setitem("result.timings", [1, 2])), "timings must map"),
    "unknown sampler field": (lambda d: with_meta(d, setitem("result.params.evil", 1)), "unexpected keyword"),
    "negative temperature": (lambda d: with_meta(d, setitem("settings.params.temperature", -1)),
                             "temperature must be >= 0"),
    "settings as a list": (lambda d: with_meta(d, setitem("settings", [1])), "settings must be a JSON object"),
    "format version 2": (lambda d: with_meta(d, setitem("version", 2)), "version 2 is not supported"),
    "another format": (lambda d: with_meta(d, setitem("format", "pickle")), "not an LLM Inspector trace"),
    "random bytes": (lambda d: bytes(range(256)) * 64, "not a trace file"),
    "header length 2**60": (lambda d: struct.pack("<Q", 1 << 60) + d[8:], "bad safetensors header"),
    "cut in half": (lambda d: d[: len(d) // 2], "its tensors cannot be read"),
    "no result": (lambda d: with_meta(d, lambda m: m.pop("result")), "result must be a JSON object"),
    "extra holding objects": (lambda d: with_meta(d, setitem("extra", {"a": {"b": 1}})), "extra must map"),
    "10,000 interventions": (lambda d: with_meta(d, setitem("interventions", ["x"] * 10_000)), "interventions"),
    "capture positions outside the run": (lambda d: with_meta(d, setitem("probe.captures.0.positions", [10**7])),
                                          "positions outside the run"),
    "capture layer disagreeing with its name": (lambda d: with_meta(d, setitem("probe.captures.0.layer", 3)),
                                                "layer disagrees"),
    "negative RMSNorm epsilon": (lambda d: with_meta(d, setitem("probe.norm_eps", -1.0)), "norm_eps"),
    "malformed capture specs": (lambda d: with_meta(d, setitem("probe.capture_specs", [["*", 1, 2]])),
                                "capture_specs are malformed"),
    "header that is a list": (lambda d: join([1, 2], split(d)[1]), "not an LLM Inspector trace"),
    "metadata that is a number": (lambda d: with_header(d, lambda h: h.__setitem__("__metadata__", {META_KEY: 5})),
                                  "not an LLM Inspector trace"),
    "stage index past the list": (lambda d: with_tensor(d, "stats.0.names", torch.full_like(
        st_load(d)["stats.0.names"], 999)), "names a stage that is not listed"),
    "layer disagreeing with the stage": (lambda d: with_tensor(d, "stats.0.layers", torch.full_like(
        st_load(d)["stats.0.layers"], 1)), "disagrees with its stage name"),
    "empty file": (lambda d: b"", "too short"),
    "seed 2**70": (lambda d: with_meta(d, setitem("result.seed", 2**70)), "seed must be"),
}


@pytest.fixture(scope="module")
def good(tiny_model) -> bytes:
    run = inspect_run(tiny_model, RunSettings(prompt="Hi there", chat=False, max_new_tokens=4,
                                              params=SamplingParams(temperature=0.8), seed=2))
    return to_bytes(run)


def test_the_good_file_opens(good, tiny_model):
    back = from_bytes(good, TraceBounds(vocab_size=tiny_model.config.vocab_size, num_layers=2))
    assert back.result.token_ids and back.probe.stats


@pytest.mark.parametrize("name", list(CASES))
def test_a_crafted_trace_is_refused_clearly_and_quickly(good, tiny_model, name):
    craft, words = CASES[name]
    data = craft(good)
    bounds = TraceBounds(vocab_size=tiny_model.config.vocab_size, num_layers=tiny_model.config.num_layers)
    t0 = time.perf_counter()
    with pytest.raises(EngineError) as e:
        from_bytes(data, bounds)
    assert time.perf_counter() - t0 < 5
    assert words in str(e.value), str(e.value)
    assert len(str(e.value)) < 400            # one message, not a dump of what the file holds


def test_the_model_works_after_every_crafted_file(tiny_model):
    ids = list(range(3, 11))
    before = tiny_model.logits(ids)
    assert torch.equal(before, tiny_model.logits(ids)) and tiny_model.live_hooks == 0
