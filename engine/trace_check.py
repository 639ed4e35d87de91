"""Validation of a trace file's contents before anything is built from them. A trace may come from anywhere
(a student's upload, a shared link), so every field is checked against a schema and the server's bounds:
types, lengths (token ids within the prompt / new-token limits and the vocabulary), stage names that are
real hook names of a model with a plausible layer count, layer indices that agree with the names, tensor
shapes that agree with the metadata, finite numbers. Anything else is one EngineError naming what is wrong.

The checks run on the parsed JSON and the safetensors header only; no tensor is built before its shape
is known to fit, so a few-KB file cannot make the server allocate gigabytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import EngineError
from .probe import split_name
from .stages import LAYER_STAGES, SAMPLER_STAGES

GLOBAL_STAGES = ("tokenizer", "embed", "final_norm", "logits", "detokenizer", *SAMPLER_STAGES)
STOP_REASONS = ("eos", "stop_string", "max_new_tokens", "context", "running", "nonfinite", "error",
                "non-finite logits", "stopped")
STEP_FIELDS = {"index": int, "position": int, "token_id": int, "text": str, "prob": float, "model_prob": float,
               "entropy": float, "kept": int, "top": list, "seconds": dict}


@dataclass(frozen=True)
class TraceBounds:
    """What a trace may hold on this server. The defaults are the app's default limits (the app passes its
    configured ones, and the loaded model's vocabulary and layer count)."""
    max_prompt_tokens: int = 4_096
    max_new_tokens: int = 1_024
    max_layers: int = 256              # more layers than any model this app serves
    max_vocab: int = 1 << 20
    max_text_chars: int = 200_000      # generated text, prompt, notes, model name
    max_captures: int = 20_000
    max_capture_elements: int = 64 << 20
    max_stat_blocks: int = 20_000
    max_marks: int = 200_000
    max_top: int = 64
    max_bytes: int = 256 << 20
    vocab_size: int | None = None      # the loaded model's, when known: ids are checked against it
    num_layers: int | None = None      # the loaded model's, when known


class TraceError(EngineError):
    """A trace file that is not what it claims to be; the message names the field."""


def need(ok: bool, what: str) -> None:
    if not ok:
        raise TraceError(f"damaged trace file: {what}")


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v) -> bool:
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


def check_str(v, what: str, b: TraceBounds) -> None:
    need(isinstance(v, str) and len(v) <= b.max_text_chars, f"{what} must be text of at most "
         f"{b.max_text_chars:,} characters")


def check_ids(ids, what: str, limit: int, b: TraceBounds) -> None:
    need(isinstance(ids, list) and len(ids) <= limit, f"{what} must be a list of at most {limit:,} token ids")
    vocab = b.vocab_size or b.max_vocab
    need(all(is_int(i) and 0 <= i < vocab for i in ids), f"{what}: every id must be a whole number in "
         f"[0, {vocab:,})")


def check_stage(name, b: TraceBounds) -> int | None:
    """A real hook name of a plausible model; returns its layer."""
    need(isinstance(name, str) and len(name) <= 64, f"stage name {str(name)[:40]!r} is not a stage name")
    layer, stage = split_name(name)
    if layer is None:
        need(name in GLOBAL_STAGES, f"{name[:40]!r} is not a stage name")
        return None
    layers = b.num_layers or b.max_layers
    need(stage in LAYER_STAGES and layer < layers, f"{name[:40]!r} is not a stage of a model with at most "
         f"{layers} layers")
    return layer


def check_result(r, b: TraceBounds) -> None:
    need(isinstance(r, dict), "result must be a JSON object")
    check_ids(r.get("prompt_ids"), "prompt_ids", b.max_prompt_tokens, b)
    need(len(r["prompt_ids"]) >= 1, "prompt_ids is empty")
    check_ids(r.get("token_ids"), "token_ids", b.max_new_tokens, b)
    check_str(r.get("text"), "text", b)
    need(r.get("stop_reason") in STOP_REASONS, f"stop_reason must be one of {', '.join(STOP_REASONS)}")
    need(is_int(r.get("seed")) and 0 <= r["seed"] < 2 ** 63, "seed must be a whole number in [0, 2**63)")
    for key in ("timings", "cache"):
        d = r.get(key)
        need(isinstance(d, dict) and len(d) <= 16 and all(isinstance(k, str) and is_num(v) for k, v in d.items()),
             f"{key} must map names to finite numbers")
    steps = r.get("steps")
    need(isinstance(steps, list) and len(steps) <= len(r["token_ids"]) + 1,
         "steps must be a list with at most one step per generated token")
    for s in steps:
        check_step(s, b)


def check_step(s, b: TraceBounds) -> None:
    need(isinstance(s, dict) and set(s) == set(STEP_FIELDS), f"a step must have exactly {', '.join(STEP_FIELDS)}")
    for k, kind in STEP_FIELDS.items():
        v = s[k]
        ok = is_int(v) if kind is int else (isinstance(v, (int, float)) and not isinstance(v, bool)
                                            if kind is float else isinstance(v, kind))
        need(ok, f"step field {k} must be {kind.__name__}")
    check_str(s["text"], "step text", b)
    need(len(s["top"]) <= b.max_top and all(isinstance(c, dict) and set(c) == {"id", "text", "prob"}
                                             and is_int(c["id"]) and isinstance(c["text"], str)
                                             and len(c["text"]) <= 256 and isinstance(c["prob"], (int, float))
                                             for c in s["top"]), "step candidates are malformed")
    need(all(isinstance(k, str) and is_num(v) for k, v in s["seconds"].items()) and len(s["seconds"]) <= 8,
         "step seconds must be finite numbers")


def check_probe(m, header: dict, n_positions: int, b: TraceBounds) -> None:
    """The probe's JSON part against the safetensors header (dtype and shape of every tensor)."""
    need(isinstance(m, dict), "probe must be a JSON object")
    need(isinstance(m.get("timing"), bool) and is_int(m.get("step")) and is_int(m.get("pos0")),
         "probe timing/step/pos0 are malformed")
    need(m.get("norm_eps") is None or (is_num(m["norm_eps"]) and m["norm_eps"] >= 0), "norm_eps must be >= 0")
    names = m.get("stat_names")
    need(isinstance(names, list) and len(names) <= 64 * b.max_layers, "stat_names must be a list")
    for n in names:
        check_stage(n, b)
    blocks = m.get("stats")
    need(isinstance(blocks, list) and len(blocks) <= b.max_stat_blocks, "too many statistics blocks")
    for i, blk in enumerate(blocks):
        need(isinstance(blk, dict) and is_int(blk.get("step")) and is_int(blk.get("pos0")),
             f"statistics block {i} is malformed")
        vals = tensor_info(header, f"stats.{i}.values", ("F32",), 3)
        g, t = vals[0], vals[1]
        need(vals[2] == 7 and 0 <= blk["pos0"] and blk["pos0"] + t <= n_positions and blk["step"] >= 0,
             f"statistics block {i} covers positions outside the run")
        need(tensor_info(header, f"stats.{i}.names", ("I32",), 1) == [g], f"statistics block {i}: names shape")
        need(tensor_info(header, f"stats.{i}.layers", ("I32",), 1) == [g], f"statistics block {i}: layers shape")
    check_captures(m.get("captures"), header, n_positions, b)
    marks = m.get("marks")
    need(isinstance(marks, list) and len(marks) <= b.max_marks and all(
        isinstance(x, list) and len(x) == 3 and is_int(x[0]) and isinstance(x[1], str) and len(x[1]) <= 64
        and is_num(x[2]) for x in marks), "timing marks are malformed")
    for key in ("capture_specs", "stats_specs"):
        need(isinstance(m.get(key), list) and len(m[key]) <= 64, f"{key} is malformed")
    need(all(isinstance(p, str) and len(p) <= 200 for p in m["stats_specs"]), "stats_specs are malformed")
    for spec in m["capture_specs"]:
        need(isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], list)
             and all(isinstance(p, str) and len(p) <= 200 for p in spec[0])
             and all(x is None or (isinstance(x, list) and len(x) <= n_positions + b.max_layers
                                   and all(is_int(v) for v in x)) for x in spec[1:]), "capture_specs are malformed")


def check_captures(caps, header: dict, n_positions: int, b: TraceBounds) -> None:
    need(isinstance(caps, list) and len(caps) <= b.max_captures, "captures must be a list of bounded length")
    total = 0
    for i, c in enumerate(caps):
        need(isinstance(c, dict) and set(c) == {"step", "name", "layer", "positions", "tensor", "value"},
             f"capture {i} is malformed")
        layer = check_stage(c["name"], b)
        need(c["layer"] == layer and is_int(c["step"]) and c["step"] >= 0, f"capture {i}: layer disagrees with "
             f"its name {c['name']!r}")
        pos = c["positions"]
        need(isinstance(pos, list) and all(is_int(p) and 0 <= p <= n_positions for p in pos)
             and len(pos) <= n_positions + 1, f"capture {i}: positions outside the run")
        if c["tensor"] is True:
            shape = tensor_info(header, f"capture.{i}", ("F32", "F16", "BF16", "F64", "I64", "I32"), None)
            need(len(shape) <= 4, f"capture {i}: more than 4 dimensions")
            total += math.prod(shape)
            need(total <= b.max_capture_elements, "captures hold more numbers than this server opens")
        else:
            need(c["tensor"] is False and (c["value"] is None or is_int(c["value"])
                                           or (isinstance(c["value"], (str, list)) and len(c["value"]) <=
                                               b.max_text_chars)), f"capture {i}: value is malformed")


def tensor_info(header: dict, key: str, dtypes: tuple[str, ...], ndim: int | None) -> list[int]:
    """The shape the safetensors header declares for key, checked against dtype, rank and byte range."""
    info = header.get(key)
    need(isinstance(info, dict) and info.get("dtype") in dtypes, f"tensor {key} is missing or not {dtypes}")
    shape, offs = info.get("shape"), info.get("data_offsets")
    need(isinstance(shape, list) and all(is_int(s) and 0 <= s <= 1 << 31 for s in shape)
         and (ndim is None or len(shape) == ndim), f"tensor {key} has a bad shape")
    need(isinstance(offs, list) and len(offs) == 2 and all(is_int(o) for o in offs), f"tensor {key}: bad offsets")
    size = {"F32": 4, "I32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8}[info["dtype"]]
    need(offs[1] - offs[0] == size * math.prod(shape), f"tensor {key}: byte range disagrees with its shape")
    return shape


def check_meta(meta: dict, header: dict, b: TraceBounds) -> None:
    """Every part of a trace's metadata (the caller has checked format and version)."""
    check_result(meta.get("result"), b)
    need(isinstance(meta["result"].get("params"), dict), "result params must be a JSON object")
    r = meta["result"]
    n_positions = len(r["prompt_ids"]) + len(r["token_ids"])
    check_str(meta.get("model_name"), "model_name", b)
    need(len(meta["model_name"]) <= 300, "model_name is too long")
    need(is_num(meta.get("seconds")) and meta["seconds"] >= 0, "seconds must be a finite number >= 0")
    need(is_num(meta.get("created")) and 0 <= meta["created"] < 1e11, "created must be a time stamp")
    need(isinstance(meta.get("settings"), dict), "settings must be a JSON object")
    for key in ("interventions", "notes"):
        v = meta.get(key, [])
        need(isinstance(v, list) and len(v) <= 64 and all(isinstance(x, str) and len(x) <= 2000 for x in v),
             f"{key} must be a short list of text")
    extra = meta.get("extra")
    need(isinstance(extra, dict) and len(extra) <= 32 and all(
        isinstance(k, str) and (v is None or isinstance(v, (bool, str)) or is_num(v)
                                or (isinstance(v, list) and len(v) <= 64 and all(isinstance(x, str) for x in v)))
        for k, v in extra.items()), "extra must map names to numbers, text or lists of text")
    if meta.get("probe") is not None:
        check_probe(meta["probe"], header, n_positions, b)
