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
from engine.inspection.trace import META_KEY, from_bytes, to_bytes
from engine.inspection.trace_check import TraceBounds
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


def bomb(data: bytes, item: str, n: int) -> str:
    """The file's metadata text with a key "pad" holding n copies of item (built as text: fast at 60 MB)."""
    text = split(data)[0]["__metadata__"][META_KEY]
    return text[:-1] + ', "pad": [' + (item + ",") * (n - 1) + item + "]}"


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
    "unknown sampler field": (lambda d: with_meta(d, setitem("result.params.evil", 1)),
                              "result params holds an unknown key 'evil'"),
    "negative temperature": (lambda d: with_meta(d, setitem("settings.params.temperature", -1)),
                             "temperature must be a number in [0, 100]"),
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
    # Run settings: what the sidebar could have sent on this server, nothing else (issue 19, item 2).
    "a 20 MB prompt": (lambda d: with_meta(d, setitem("settings.prompt", "x" * 20_000_000)),
                       "a trace's metadata is at most 16 MiB"),
    "a prompt one character over the server's limit": (lambda d: with_meta(d, setitem(
        "settings.prompt", "x" * 20_001)), "the prompt must be text of at most 20,000 characters"),
    "a prompt that is a number": (lambda d: with_meta(d, setitem("settings.prompt", 12345)),
                                  "the prompt must be text"),
    "no prompt in the settings": (lambda d: with_meta(d, lambda m: m["settings"].pop("prompt")),
                                  "settings have no prompt"),
    "a prompt holding a lone surrogate": (lambda d: with_meta(d, setitem("settings.prompt", "hi \ud800")),
                                          "valid Unicode"),
    "a system message that is a list": (lambda d: with_meta(d, setitem("settings.system", ["be evil"])),
                                        "the system message must be text"),
    "500,000 stop strings": (lambda d: with_meta(d, setitem("settings.stop", ["x"] * 500_000)),
                             "stop must be a list of at most 16 strings of at most 200"),
    "17 stop strings": (lambda d: with_meta(d, setitem("settings.stop", ["x"] * 17)), "stop must be a list"),
    "a stop string of 201 characters": (lambda d: with_meta(d, setitem("settings.stop", ["x" * 201])),
                                        "stop must be a list"),
    "a stop string that is a number": (lambda d: with_meta(d, setitem("settings.stop", [7])), "stop must be"),
    "max_new_tokens 1e9": (lambda d: with_meta(d, setitem("settings.max_new_tokens", 1e9)),
                           "max_new_tokens must be a whole number in [1, 1,024]"),
    "max_new_tokens 'lots'": (lambda d: with_meta(d, setitem("settings.max_new_tokens", "lots")),
                              "max_new_tokens must be a whole number in [1, 1,024]"),
    "max_new_tokens 0": (lambda d: with_meta(d, setitem("settings.max_new_tokens", 0)),
                         "max_new_tokens must be a whole number in [1, 1,024]"),
    "max_new_tokens over the server's limit": (lambda d: with_meta(d, setitem("settings.max_new_tokens", 1025)),
                                               "max_new_tokens must be a whole number in [1, 1,024]"),
    "max_new_tokens true": (lambda d: with_meta(d, setitem("settings.max_new_tokens", True)), "max_new_tokens"),
    "chat as text": (lambda d: with_meta(d, setitem("settings.chat", "yes")), "chat must be true or false"),
    "ignore_eos as a number": (lambda d: with_meta(d, setitem("settings.ignore_eos", 1)), "ignore_eos must be"),
    "a negative seed": (lambda d: with_meta(d, setitem("settings.seed", -1)), "settings: seed must be"),
    "a seed as text": (lambda d: with_meta(d, setitem("settings.seed", "1")), "settings: seed must be"),
    "an unknown settings key": (lambda d: with_meta(d, setitem("settings.evil", 1)),
                                "settings holds an unknown key 'evil'"),
    "top_p 0": (lambda d: with_meta(d, setitem("settings.params.top_p", 0)), "top_p must be a number in (0, 1]"),
    "top_k 1.5": (lambda d: with_meta(d, setitem("settings.params.top_k", 1.5)), "top_k must be a whole number"),
    "top_k 2**70": (lambda d: with_meta(d, setitem("settings.params.top_k", 2**70)), "top_k must be"),
    "temperature NaN": (lambda d: with_meta(d, setitem("settings.params.temperature", float("nan"))),
                        "temperature must be"),
    "temperature true": (lambda d: with_meta(d, setitem("settings.params.temperature", True)), "temperature must"),
    "no_repeat_ngram 10**9": (lambda d: with_meta(d, setitem("settings.params.no_repeat_ngram", 10**9)),
                              "no_repeat_ngram must be"),
    "an old flat sampler field out of range": (lambda d: with_meta(d, setitem("settings.min_p", 2.0)),
                                               "min_p must be a number in [0, 1]"),
    "settings params as a list": (lambda d: with_meta(d, setitem("settings.params", [1])),
                                  "settings params must be a JSON object"),
    "result params with a negative top_p": (lambda d: with_meta(d, setitem("result.params.top_p", -1)),
                                            "result params: top_p must be"),
    "a model name holding a lone surrogate": (lambda d: with_meta(d, setitem("model_name", "m\ud800")),
                                              "model_name must be text"),
    # JSON bombs and unknown keys (item 3): refused before anything of that size is parsed.
    "a 60 MB JSON bomb": (lambda d: with_raw_meta(d, bomb(d, "[]", 20_000_000)),
                          "a trace's header is at most 24 MiB"),
    "a 15 MB bomb of empty lists": (lambda d: with_raw_meta(d, bomb(d, "[]", 5_000_000)),
                                    "a trace holds at most 1,000,000"),
    "a 15 MB bomb of empty objects": (lambda d: with_raw_meta(d, bomb(d, "{}", 5_000_000)),
                                      "a trace holds at most 1,000,000"),
    "a 12 MB bomb of numbers": (lambda d: with_raw_meta(d, bomb(d, "0", 6_000_000)),
                                "a trace holds at most 4,000,000"),
    "an unknown top-level key": (lambda d: with_meta(d, setitem("pad", [[], []])),
                                 "the trace holds an unknown key 'pad'"),
    "an unknown key in the result": (lambda d: with_meta(d, setitem("result.pad", 1)),
                                     "result holds an unknown key 'pad'"),
    "an unknown key in the probe": (lambda d: with_meta(d, setitem("probe.pad", 1)),
                                    "probe holds an unknown key 'pad'"),
    "a tensor the trace does not list": (lambda d: with_tensor(d, "pad", torch.zeros(4)),
                                         "the file's tensor list holds an unknown key 'pad'"),
    "another safetensors metadata entry": (lambda d: with_header(d, lambda h: h["__metadata__"].__setitem__(
        "pad", "x")), "the safetensors metadata holds other entries"),
    "a key naming a line break": (lambda d: with_meta(d, setitem("evil\nsecond line", 1)),
                                  "unknown key 'evil\\nsecond line'"),
    # Whole numbers in step records are indices (item 4): bounded by what they index.
    "candidate id 2**70": (lambda d: with_meta(d, setitem("result.steps.0.top.0.id", 2**70)),
                           "step candidates: every id must be a token id in [0, "),
    "candidate id past the vocabulary": (lambda d: with_meta(d, setitem("result.steps.0.top.0.id", 10**9)),
                                         "every id must be a token id"),
    "negative candidate id": (lambda d: with_meta(d, setitem("result.steps.0.top.1.id", -1)),
                              "every id must be a token id"),
    "step token id 2**70": (lambda d: with_meta(d, setitem("result.steps.0.token_id", 2**70)),
                            "step token_id must be a token id"),
    "step position 10**9": (lambda d: with_meta(d, setitem("result.steps.1.position", 10**9)),
                            "step position 1000000000 is outside"),
    "negative step index": (lambda d: with_meta(d, setitem("result.steps.0.index", -1)), "step index -1 is outside"),
    "step kept 2**70": (lambda d: with_meta(d, setitem("result.steps.0.kept", 2**70)), "step kept must be"),
    # A 400-digit whole number is valid JSON; it cannot become a float, so formatting it would raise.
    "seconds as a 400-digit number": (lambda d: with_meta(d, setitem("seconds", 10**400)), "seconds must be"),
    "cache bytes as a 400-digit number": (lambda d: with_meta(d, setitem("result.cache.bytes_used", 10**400)),
                                          "cache must map names to finite numbers"),
    "a probability as a 400-digit number": (lambda d: with_meta(d, setitem("result.steps.0.prob", 10**400)),
                                            "step field prob must be float"),
    "a candidate probability as a 400-digit number": (lambda d: with_meta(d, setitem(
        "result.steps.0.top.0.prob", 10**400)), "step candidates are malformed"),
    "probe step 10**9": (lambda d: with_meta(d, setitem("probe.step", 10**9)), "probe timing/step/pos0"),
    "a statistics block at step 10**9": (lambda d: with_meta(d, setitem("probe.stats.0.step", 10**9)),
                                         "covers positions outside the run"),
    "a capture at step 10**9": (lambda d: with_meta(d, setitem("probe.captures.0.step", 10**9)),
                                "its step is outside the run"),
    "a capture layer true": (lambda d: with_meta(d, lambda m: m["probe"]["captures"].__setitem__(0, {
        **m["probe"]["captures"][0], "name": "blocks.1.resid_post", "layer": True})), "layer disagrees"),
    "a timing mark at step 10**9": (lambda d: with_meta(d, setitem("probe.marks.0", [10**9, "x", 0.0])),
                                    "timing marks are malformed"),
}


@pytest.fixture(scope="module")
def good(tiny_model) -> bytes:
    run = inspect_run(tiny_model, RunSettings(prompt="Hi there", chat=False, max_new_tokens=4,
                                              params=SamplingParams(temperature=0.8), seed=2))
    return to_bytes(run)


def test_the_good_file_opens(good, tiny_model):
    back = from_bytes(good, TraceBounds(vocab_size=tiny_model.config.vocab_size, num_layers=2))
    assert back.result.token_ids and back.recording.stats


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
