"""Validation of a trace file's contents before anything is built from them. A trace may come from anywhere
(a student's upload, a shared link), so every field is checked against a schema and the server's bounds:
types, lengths (token ids within the prompt / new-token limits and the vocabulary), stage names that are
real hook names of a model with a plausible layer count, layer indices that agree with the names, tensor
shapes that agree with the metadata, finite numbers. Anything else is one EngineError naming what is wrong.

The checks run on the parsed JSON and the safetensors header only; no tensor is built before its shape
is known to fit, so a few-KB file cannot make the server allocate gigabytes. Before any JSON is parsed, the
header's size and the number of values it could hold are bounded (`check_header_size`): parsing is where a
"JSON bomb" (tens of MB of `[],[],...`) costs seconds and a GB, so nothing that large is parsed at all.

The run settings get the same schema the server applies to a request (`check_settings_schema`): a file's
prompt reaches the tokenizer on every rerun and its stop strings are scanned at every decode step, so the
file may hold nothing the sidebar could not have sent.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from engine.errors import EngineError
from engine.inspection.plans import split_name
from engine.inspection.stages import GLOBAL_STAGES, LAYER_STAGES
from engine.sampling import SamplingParams
from engine.settings import MAX_STOP_CHARS, MAX_STOP_STRINGS, RunSettings

STOP_REASONS = ("eos", "stop_string", "max_new_tokens", "context", "running", "nonfinite", "error",
                "non-finite logits", "stopped")
META_KEY = "llm_inspector_trace"          # the safetensors metadata entry that holds the trace's JSON
# Real traces hold about 2.5 KB of metadata (3.3 KB of header) and ~60 JSON values a generated token; these
# leave room for several thousand steps. The header holds the metadata JSON as an escaped string plus one entry
# per tensor; every JSON value sits after a comma or opens a container, so counting ',', '[' and '{' bytes
# bounds what parsing can build (an empty list costs 56 bytes of Python for 3 bytes of file).
MAX_META_BYTES = 16 << 20
MAX_HEADER_BYTES = 24 << 20
MAX_JSON_CONTAINERS = 1_000_000
MAX_JSON_VALUES = 4_000_000
META_KEYS = frozenset({"format", "version", "settings", "result", "probe", "model_name", "seconds", "created",
                       "loops", "first_nonfinite", "interventions", "extra", "notes"})
RESULT_KEYS = frozenset({"prompt_ids", "token_ids", "text", "steps", "stop_reason", "params", "seed", "timings",
                         "cache"})
PROBE_KEYS = frozenset({"timing", "step", "pos0", "norm_eps", "stat_names", "stats", "captures", "marks",
                        "capture_specs", "stats_specs"})
SAMPLER_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams))
SETTINGS_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunSettings)}   # what a missing key becomes
SETTINGS_KEYS = frozenset(SETTINGS_DEFAULTS)
SETTINGS_BOOLS = tuple(k for k, v in SETTINGS_DEFAULTS.items() if isinstance(v, bool))
_SURROGATE = re.compile("[\ud800-\udfff]")
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
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
    max_text_chars: int = 200_000      # generated text, notes, model name
    max_prompt_chars: int = 20_000     # the prompt and the system message (the server's max_prompt_chars)
    max_captures: int = 20_000
    max_capture_elements: int = 64 << 20
    max_stat_blocks: int = 20_000
    max_marks: int = 200_000
    max_top: int = 64
    max_bytes: int = 256 << 20
    vocab_size: int | None = None      # the loaded model's, when known: ids are checked against it
    num_layers: int | None = None      # the loaded model's, when known


class TraceError(EngineError):
    """A trace file that is not what it claims to be; the message names the field. It is one line of printable
    text whatever the file held (a name quoted from the file cannot add lines to `error: ...`)."""

    def __init__(self, message: str):
        super().__init__(_UNPRINTABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", message))


def need(ok: bool, what: str) -> None:
    if not ok:
        raise TraceError(f"damaged trace file: {what}")


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v) -> bool:
    """A finite number that converts to a float (JSON allows a 400-digit integer; formatting it would raise)."""
    return (is_int(v) and abs(v) < 2 ** 63) or (isinstance(v, float) and math.isfinite(v))


def is_real(v) -> bool:
    """A float, NaN and infinities included (a probability of a run that went non-finite), or a bounded int."""
    return isinstance(v, float) or (is_int(v) and abs(v) < 2 ** 63)


def is_text(v, limit: int) -> bool:
    """Text of at most limit characters that is valid Unicode (a lone surrogate, possible in JSON, cannot be
    printed, encoded for the browser or tokenized)."""
    return isinstance(v, str) and len(v) <= limit and not _SURROGATE.search(v)


def check_str(v, what: str, b: TraceBounds, limit: int | None = None) -> None:
    limit = b.max_text_chars if limit is None else limit
    need(is_text(v, limit), f"{what} must be text of at most {limit:,} characters (valid Unicode)")


def check_keys(d: dict, allowed, what: str) -> None:
    extra = sorted(str(k)[:40] for k in d if k not in allowed)
    need(not extra, f"{what} holds an unknown key {extra[0]!r}" if extra else "")


def check_header_length(n: int) -> None:
    need(n <= MAX_HEADER_BYTES, f"its header is {n / 2**20:,.1f} MiB; a trace's header is at most "
         f"{MAX_HEADER_BYTES >> 20} MiB (a real one holds about 3.3 KB a generated token)")


def check_header_size(raw: bytes) -> None:
    """Before the safetensors header (which holds the metadata) is parsed: its size and how many JSON values it
    could make. Counting bytes is C-speed; parsing a bomb is what took seconds and gigabytes."""
    check_header_length(len(raw))
    containers = raw.count(b"[") + raw.count(b"{")
    need(containers <= MAX_JSON_CONTAINERS, f"its metadata holds {containers:,} lists or objects; a trace holds at "
         f"most {MAX_JSON_CONTAINERS:,}")
    values = containers + raw.count(b",")
    need(values <= MAX_JSON_VALUES, f"its metadata holds {values:,} values; a trace holds at most "
         f"{MAX_JSON_VALUES:,}")


def check_meta_text(text) -> None:
    """The metadata entry (a JSON document in a string) before it is parsed."""
    if not isinstance(text, str):
        raise TraceError("not an LLM Inspector trace (its metadata entry is not text)")
    need(len(text) <= MAX_META_BYTES, f"its metadata is {len(text) / 2**20:,.1f} MiB; a trace's metadata is at "
         f"most {MAX_META_BYTES >> 20} MiB (a real one holds about 2.5 KB a generated token)")


def _whole(v) -> bool:
    return is_num(v) and float(v).is_integer()


def check_sampler(d, what: str, b: TraceBounds) -> None:
    """Sampler settings (SamplingParams' fields) with the ranges SamplingParams enforces, whole numbers bounded."""
    need(isinstance(d, dict), f"{what} must be a JSON object")
    check_keys(d, SAMPLER_KEYS, what)
    most_n = b.max_prompt_tokens + b.max_new_tokens
    ranges = {   # name -> (test, what it must be)
        "temperature": (lambda v: is_num(v) and 0 <= v <= 100, "a number in [0, 100]"),
        "top_k": (lambda v: _whole(v) and 0 <= v <= b.max_vocab, f"a whole number in [0, {b.max_vocab:,}]"),
        "top_p": (lambda v: is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
        "min_p": (lambda v: is_num(v) and 0 <= v <= 1, "a number in [0, 1]"),
        "repetition_penalty": (lambda v: is_num(v) and v > 0, "a finite number > 0"),
        "frequency_penalty": (lambda v: is_num(v) and abs(v) <= 100, "a number in [-100, 100]"),
        "presence_penalty": (lambda v: is_num(v) and abs(v) <= 100, "a number in [-100, 100]"),
        "no_repeat_ngram": (lambda v: _whole(v) and 0 <= v <= most_n, f"a whole number in [0, {most_n:,}]"),
    }
    for name, v in d.items():
        ok, must = ranges[name]
        need(ok(v), f"{what}: {name} must be {must}")


def check_settings_schema(s, b: TraceBounds) -> None:
    """A trace's run settings (RunSettings.as_dict(), or the older layout with the sampler fields flat beside the
    prompt) against the server's limits: what the sidebar could have sent, nothing else."""
    need(isinstance(s, dict), "settings must be a JSON object")
    check_keys(s, SETTINGS_KEYS | set(SAMPLER_KEYS), "settings")
    need("prompt" in s, "settings have no prompt")
    check_str(s["prompt"], "the prompt", b, b.max_prompt_chars)
    if s.get("system") is not None:
        check_str(s["system"], "the system message", b, b.max_prompt_chars)
    for key in SETTINGS_BOOLS:
        need(key not in s or isinstance(s[key], bool), f"settings: {key} must be true or false")
    n = s.get("max_new_tokens", SETTINGS_DEFAULTS["max_new_tokens"])
    need(is_int(n) and 1 <= n <= b.max_new_tokens, f"settings: max_new_tokens must be a whole number in "
         f"[1, {b.max_new_tokens:,}]")
    seed = s.get("seed", SETTINGS_DEFAULTS["seed"])
    need(is_int(seed) and 0 <= seed < 2 ** 63, "settings: seed must be a whole number in [0, 2**63)")
    stop = s.get("stop", [])
    need(isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS and all(is_text(x, MAX_STOP_CHARS) for x in stop),
         f"settings: stop must be a list of at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
         "characters")
    if "params" in s:
        check_sampler(s["params"], "settings params", b)
    check_sampler({k: v for k, v in s.items() if k in SAMPLER_KEYS}, "settings", b)


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
    check_keys(r, RESULT_KEYS, "result")
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
    check_sampler(r.get("params"), "result params", b)
    n_tokens = len(r["token_ids"])
    for s in steps:
        check_step(s, b, n_tokens, len(r["prompt_ids"]) + n_tokens)


def check_step(s, b: TraceBounds, n_tokens: int, n_positions: int) -> None:
    """One step record. Every whole number in it is an index somewhere (a step, a position, a row of the
    vocabulary), so each is bounded by what it indexes."""
    need(isinstance(s, dict) and set(s) == set(STEP_FIELDS), f"a step must have exactly {', '.join(STEP_FIELDS)}")
    for k, kind in STEP_FIELDS.items():
        v = s[k]
        ok = is_int(v) if kind is int else is_real(v) if kind is float else isinstance(v, kind)
        need(ok, f"step field {k} must be {kind.__name__}")
    check_str(s["text"], "step text", b)
    vocab = b.vocab_size or b.max_vocab
    need(0 <= s["index"] <= n_tokens, f"step index {s['index']} is outside the run's {n_tokens} steps")
    need(0 <= s["position"] <= n_positions, f"step position {s['position']} is outside the run's {n_positions} "
         "positions")
    need(0 <= s["token_id"] < vocab, f"step token_id must be a token id in [0, {vocab:,})")
    need(0 <= s["kept"] <= vocab, f"step kept must be a count in [0, {vocab:,}]")
    need(len(s["top"]) <= b.max_top and all(isinstance(c, dict) and set(c) == {"id", "text", "prob"}
                                             and is_int(c["id"]) and is_text(c["text"], 256)
                                             and is_real(c["prob"])
                                             for c in s["top"]), "step candidates are malformed")
    need(all(0 <= c["id"] < vocab for c in s["top"]), f"step candidates: every id must be a token id in "
         f"[0, {vocab:,})")
    need(all(isinstance(k, str) and is_num(v) for k, v in s["seconds"].items()) and len(s["seconds"]) <= 8,
         "step seconds must be finite numbers")


def check_probe(m, header: dict, n_positions: int, b: TraceBounds) -> None:
    """The probe's JSON part against the safetensors header (dtype and shape of every tensor)."""
    need(isinstance(m, dict), "probe must be a JSON object")
    check_keys(m, PROBE_KEYS, "probe")
    need(isinstance(m.get("timing"), bool) and is_int(m.get("step")) and is_int(m.get("pos0"))
         and 0 <= m["step"] <= n_positions and 0 <= m["pos0"] <= n_positions, "probe timing/step/pos0 are malformed")
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
        need(vals[2] == 7 and 0 <= blk["pos0"] and blk["pos0"] + t <= n_positions and 0 <= blk["step"] <= n_positions,
             f"statistics block {i} covers positions outside the run")
        need(tensor_info(header, f"stats.{i}.names", ("I32",), 1) == [g], f"statistics block {i}: names shape")
        need(tensor_info(header, f"stats.{i}.layers", ("I32",), 1) == [g], f"statistics block {i}: layers shape")
    check_captures(m.get("captures"), header, n_positions, b)
    marks = m.get("marks")
    need(isinstance(marks, list) and len(marks) <= b.max_marks and all(
        isinstance(x, list) and len(x) == 3 and is_int(x[0]) and 0 <= x[0] <= n_positions and is_text(x[1], 64)
        and is_num(x[2]) for x in marks), "timing marks are malformed")
    for key in ("capture_specs", "stats_specs"):
        need(isinstance(m.get(key), list) and len(m[key]) <= 64, f"{key} is malformed")
    need(all(is_text(p, 200) for p in m["stats_specs"]), "stats_specs are malformed")
    for spec in m["capture_specs"]:
        need(isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], list)
             and all(is_text(p, 200) for p in spec[0])
             and all(x is None or (isinstance(x, list) and len(x) <= n_positions + b.max_layers
                                   and all(is_int(v) for v in x)) for x in spec[1:]), "capture_specs are malformed")


def check_captures(caps, header: dict, n_positions: int, b: TraceBounds) -> None:
    need(isinstance(caps, list) and len(caps) <= b.max_captures, "captures must be a list of bounded length")
    total = 0
    for i, c in enumerate(caps):
        need(isinstance(c, dict) and set(c) == {"step", "name", "layer", "positions", "tensor", "value"},
             f"capture {i} is malformed")
        layer = check_stage(c["name"], b)
        need((c["layer"] is None if layer is None else is_int(c["layer"]) and c["layer"] == layer)
             and is_int(c["step"]) and 0 <= c["step"] <= n_positions, f"capture {i}: layer "
             f"disagrees with its name {c['name']!r} or its step is outside the run")
        pos = c["positions"]
        need(isinstance(pos, list) and all(is_int(p) and 0 <= p <= n_positions for p in pos)
             and len(pos) <= n_positions + 1, f"capture {i}: positions outside the run")
        if c["tensor"] is True:
            shape = tensor_info(header, f"capture.{i}", ("F32", "F16", "BF16", "F64", "I64", "I32"), None)
            need(len(shape) <= 4, f"capture {i}: more than 4 dimensions")
            total += math.prod(shape)
            need(total <= b.max_capture_elements, "captures hold more numbers than this server opens")
        else:
            v = c["value"]
            need(c["tensor"] is False and (v is None or is_int(v) or is_text(v, b.max_text_chars)
                                           or (isinstance(v, list) and len(v) <= b.max_text_chars)),
                 f"capture {i}: value is malformed")


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


def check_header_keys(header: dict, meta: dict) -> None:
    """The safetensors header names the trace's tensors and nothing else (each one listed would be read)."""
    md = header.get("__metadata__")
    need(isinstance(md, dict) and set(md) == {META_KEY}, "the safetensors metadata holds other entries")
    p = meta.get("probe") or {"stats": [], "captures": []}
    want = {f"stats.{i}.{part}" for i in range(len(p["stats"])) for part in ("values", "names", "layers")}
    want |= {f"capture.{i}" for i, c in enumerate(p["captures"]) if c["tensor"] is True}
    check_keys(header, want | {"__metadata__"}, "the file's tensor list")


def check_meta(meta: dict, header: dict, b: TraceBounds) -> None:
    """Every part of a trace's metadata (the caller has checked format and version)."""
    check_keys(meta, META_KEYS, "the trace")
    check_result(meta.get("result"), b)
    r = meta["result"]
    n_positions = len(r["prompt_ids"]) + len(r["token_ids"])
    check_str(meta.get("model_name"), "model_name", b)
    need(len(meta["model_name"]) <= 300, "model_name is too long")
    need(is_num(meta.get("seconds")) and meta["seconds"] >= 0, "seconds must be a finite number >= 0")
    need(is_num(meta.get("created")) and 0 <= meta["created"] < 1e11, "created must be a time stamp")
    check_settings_schema(meta.get("settings"), b)
    for key in ("interventions", "notes"):
        v = meta.get(key, [])
        need(isinstance(v, list) and len(v) <= 64 and all(is_text(x, 2000) for x in v),
             f"{key} must be a short list of text")
    extra = meta.get("extra")
    need(isinstance(extra, dict) and len(extra) <= 32 and all(
        is_text(k, 200) and (v is None or isinstance(v, bool) or is_text(v, b.max_text_chars) or is_num(v)
                             or (isinstance(v, list) and len(v) <= 64 and all(is_text(x, 2000) for x in v)))
        for k, v in extra.items()), "extra must map names to numbers, text or lists of text")
    need(isinstance(meta.get("loops", []), list) and len(meta.get("loops", [])) <= b.max_new_tokens,
         "loops must be a list")                # recomputed from the tokens; only its size matters here
    need(meta.get("first_nonfinite") is None or (isinstance(meta["first_nonfinite"], dict)
                                                 and len(meta["first_nonfinite"]) <= 8),
         "first_nonfinite must be a short JSON object")       # recomputed as well
    if meta.get("probe") is not None:
        check_probe(meta["probe"], header, n_positions, b)
    check_header_keys(header, meta)
