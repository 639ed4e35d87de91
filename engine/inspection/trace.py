"""Trace: the one record of a run (its settings, the engine's result, the probe's Recording: everything it saw),
and trace files: one run in one safetensors file, reopened as the same type without unpickling anything.

Layout: every tensor the run's probe recorded is a safetensors tensor (`stats.{i}.values` (G, T, 7),
`stats.{i}.names` / `stats.{i}.layers` int32 (G,), `capture.{i}`); everything else (settings, tokens,
per-step sampling records, timings, cache memory, timing marks, loops, the first non-finite value) is one
JSON document stored as the string metadata entry "llm_inspector_trace". Reading parses JSON and raw
tensor bytes only (safetensors), so a trace from anywhere is safe to open.

A trace keeps no probe: a probe is configuration and code (replace functions, weight overrides), its
Recording the data (engine.inspection.recording). What was watched is data (Recording.watched) and travels;
the replace patterns and weight names are kept in `Trace.interventions`. The JSON document's "probe" entry
holds the Recording (the name is the file format's, kept for traces written before the two were apart).
"""
from __future__ import annotations

import dataclasses
import json
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from engine.inspection.loops import Loop, find_loops
from engine.inspection.nonfinite import locate_nonfinite
from engine.inspection.plans import split_name
from engine.inspection.probe import Probe
from engine.inspection.recording import Capture, Recording, Watched
from engine.inspection.stats import StatsBlock
from engine.results import Candidate, GenerationResult, Step
from engine.inspection.trace_check import (
    META_KEY,
    TraceBounds,
    TraceError,
    check_header_length,
    check_header_size,
    check_meta,
    check_meta_text,
    need,
)
from engine.sampling import SamplingParams
from engine.settings import RunSettings

FORMAT, VERSION = "llm-inspector-trace", 1


@dataclass(eq=False)
class Trace:
    """One run: what the app keeps per session, what the CLI writes, what a trace file reopens as."""
    settings: RunSettings
    result: GenerationResult
    recording: Recording | None      # what the run's probe saw (None: run without one)
    model_name: str
    seconds: float
    created: float = field(default_factory=time.time)
    loops: list[Loop] = field(default_factory=list)
    first_nonfinite: dict | None = None      # step, stage, layer, position (nonfinite.FirstNonFinite.as_dict())
    interventions: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # JSON-able notes (injections, model dtype, ...)
    notes: list[str] = field(default_factory=list)   # what the app changed or wants the user to know

    @property
    def ids(self) -> list[int]:
        return self.result.all_ids

    @property
    def n_prompt(self) -> int:
        return len(self.result.prompt_ids)


def make_trace(settings: RunSettings, result: GenerationResult, probe: Probe | None, model_name: str,
               seconds: float, *, created: float | None = None, extra: dict | None = None,
               notes: list[str] | None = None) -> Trace:
    """A Trace of one generation (probe: the run's, for its recording and interventions; None: the result's
    recording); loops and the first non-finite value are computed here."""
    rec = probe.recording if probe is not None else result.recording
    nf = locate_nonfinite(rec) if rec is not None else None
    inter = probe.interventions() if probe is not None else []
    said = list(notes or []) + (probe.notes() if probe is not None else [])     # an override on stored blocks
    return Trace(settings, result, rec, model_name, float(seconds),
                 time.time() if created is None else float(created), find_loops(result.token_ids),
                 None if nf is None else nf.as_dict(), inter, dict(extra or {}), said)


# ---- writing --------------------------------------------------------------------------------------
def _sets(x) -> list[int] | None:
    return None if x is None else sorted(x)


def to_bytes(trace: Trace) -> bytes:
    r, p = trace.result, trace.recording
    tensors: dict[str, torch.Tensor] = {}
    names: dict[str, int] = {}
    blocks = []
    for i, b in enumerate(p.stats if p is not None else []):
        tensors[f"stats.{i}.values"] = b.values.detach().cpu().contiguous()
        tensors[f"stats.{i}.names"] = torch.tensor([names.setdefault(n, len(names)) for n in b.names],
                                                   dtype=torch.int32)
        tensors[f"stats.{i}.layers"] = torch.tensor([-1 if x is None else x for x in b.layers], dtype=torch.int32)
        blocks.append({"step": b.step, "pos0": b.pos0})
    caps = []
    for i, c in enumerate(p.captures if p is not None else []):
        is_t = isinstance(c.value, torch.Tensor)
        if is_t:
            tensors[f"capture.{i}"] = c.value.detach().cpu().contiguous()
        caps.append({"step": c.step, "name": c.name, "layer": c.layer, "positions": c.positions,
                     "tensor": is_t, "value": None if is_t else c.value})
    result = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)
              if f.name not in ("steps", "params", "recording")}
    result["steps"] = [dataclasses.asdict(s) for s in r.steps]
    result["params"] = dataclasses.asdict(r.params)
    w = p.watched if p is not None else None
    probe = None if p is None else {
        "timing": w.timing, "step": p.step, "pos0": p.pos0, "norm_eps": w.norm_eps, "stat_names": list(names),
        "stats": blocks, "captures": caps, "marks": [list(m) for m in p.marks],
        "capture_specs": [[list(pats), _sets(layers), _sets(pos)] for pats, layers, pos in w.capture_specs],
        "stats_specs": list(w.stats_specs)}
    meta = {"format": FORMAT, "version": VERSION, "settings": trace.settings.as_dict(), "result": result,
            "probe": probe,
            "model_name": trace.model_name, "seconds": trace.seconds, "created": trace.created,
            "loops": [lp.as_dict() for lp in trace.loops], "first_nonfinite": trace.first_nonfinite,
            "interventions": trace.interventions, "extra": trace.extra, "notes": trace.notes}
    return st_save(tensors, metadata={META_KEY: json.dumps(meta)})


def save_trace(trace: Trace, path: str | Path) -> Path:
    """Write a Trace to path."""
    path = Path(path)
    path.write_bytes(to_bytes(trace))
    return path


# ---- reading --------------------------------------------------------------------------------------
def _meta(data: bytes, bounds: TraceBounds) -> tuple[dict, dict]:
    """The trace's JSON metadata and the safetensors header (tensor names -> dtype, shape, offsets)."""
    if len(data) < 8:
        raise TraceError("not a trace file: too short to be safetensors")
    if len(data) > bounds.max_bytes:
        raise TraceError(f"the file is {len(data) / 2**20:,.0f} MiB; this server opens traces of at most "
                         f"{bounds.max_bytes / 2**20:,.0f} MiB")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise TraceError("not a trace file: bad safetensors header")
    raw = data[8:8 + n]
    check_header_size(raw)                       # before anything is parsed: a JSON bomb is refused unread
    try:
        header = json.loads(raw)
        text = header["__metadata__"][META_KEY]
        check_meta_text(text)
        meta = json.loads(text)
    except RecursionError:
        raise TraceError("damaged trace file: its JSON is nested too deeply") from None
    except (ValueError, KeyError, TypeError):
        raise TraceError("not an LLM Inspector trace (a safetensors file without the trace metadata)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise TraceError("not an LLM Inspector trace")
    if meta.get("version") != VERSION:
        raise TraceError(f"trace format version {str(meta.get('version'))[:20]} is not supported "
                         f"(this reads {VERSION})")
    return meta, header


def _recording(m: dict | None, t: dict[str, torch.Tensor]) -> Recording | None:
    if m is None:
        return None
    watched = Watched(m["timing"], tuple(m["stats_specs"]),
                      tuple((tuple(pats), None if ly is None else frozenset(ly), None if ps is None else frozenset(ps))
                            for pats, ly, ps in m["capture_specs"]), m["norm_eps"])
    names, layers = m["stat_names"], [split_name(n)[0] for n in m["stat_names"]]
    stats = []
    for i, b in enumerate(m["stats"]):
        idx, lay = t[f"stats.{i}.names"].tolist(), t[f"stats.{i}.layers"].tolist()
        need(all(0 <= j < len(names) for j in idx), f"statistics block {i} names a stage that is not listed")
        need(all((None if x < 0 else x) == layers[j] for j, x in zip(idx, lay)),
             f"statistics block {i}: a layer index disagrees with its stage name")
        stats.append(StatsBlock(b["step"], b["pos0"], [names[j] for j in idx], [layers[j] for j in idx],
                                t[f"stats.{i}.values"]))
    captures = [Capture(c["step"], c["name"], c["layer"], c["positions"],
                        t[f"capture.{i}"] if c["tensor"] else c["value"])
                for i, c in enumerate(m["captures"])]
    return Recording(stats, captures, [tuple(x) for x in m["marks"]], watched, m["step"], m["pos0"])


def from_bytes(data: bytes, bounds: TraceBounds | None = None) -> Trace:
    """A trace from a file's bytes, validated against bounds (the server's limits, the loaded model) before
    anything is built. Loops and the first non-finite value are recomputed, never taken from the file."""
    bounds = bounds or TraceBounds()
    meta, header = _meta(data, bounds)
    check_meta(meta, header, bounds)
    settings = RunSettings.from_dict(meta["settings"])
    try:
        tensors = st_load(data)
    except Exception as e:          # safetensors raises its own error types for bad offsets and the like
        raise TraceError(f"damaged trace file: its tensors cannot be read ({type(e).__name__})") from None
    rec = _recording(meta["probe"], tensors)
    r = meta["result"]
    try:
        steps = [Step(**{**s, "top": [Candidate(**c) for c in s["top"]]}) for s in r["steps"]]
        params = SamplingParams(**r["params"])
    except TypeError as e:
        raise TraceError(f"damaged trace file: {e}") from None
    result = GenerationResult(r["prompt_ids"], r["token_ids"], r["text"], steps, r["stop_reason"], params,
                              r["seed"], r["timings"], r["cache"], rec)
    nf = locate_nonfinite(rec) if rec is not None else None
    return Trace(settings, result, rec, meta["model_name"], meta["seconds"], meta["created"],
                 find_loops(result.token_ids), None if nf is None else nf.as_dict(), meta.get("interventions", []),
                 meta["extra"], list(meta.get("notes", [])))


def load_trace(path: str | Path, bounds: TraceBounds | None = None) -> Trace:
    """A trace file, validated as from_bytes does. The header's declared length is checked before the rest of
    the file is read, so an oversized header is refused as fast as a genuine file opens."""
    path = Path(path)
    limit = (bounds or TraceBounds()).max_bytes
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise TraceError(f"{path.name} is {size / 2**20:,.0f} MiB; traces of at most "
                                 f"{limit / 2**20:,.0f} MiB are opened")
            head = f.read(8)
            if len(head) == 8 and struct.unpack("<Q", head)[0] <= size - 8:
                check_header_length(struct.unpack("<Q", head)[0])
            data = head + f.read(limit + 1 - len(head))      # a device or pipe has no size to check beforehand
            if len(data) > limit:
                raise TraceError(f"{path.name} holds more than {limit / 2**20:,.0f} MiB; traces of at most that "
                                 "are opened")
    except OSError as e:
        raise TraceError(f"cannot read {path.name}: {e.strerror or e}") from None
    return from_bytes(data, bounds)


def summary(trace: Trace) -> dict[str, Any]:
    """A few headline facts (for listings and the CLI)."""
    r = trace.result
    return {"model": trace.model_name, "prompt_tokens": len(r.prompt_ids), "generated_tokens": len(r.token_ids),
            "stop_reason": r.stop_reason, "loops": len(trace.loops), "first_nonfinite": trace.first_nonfinite,
            "stat_blocks": len(trace.recording.stats) if trace.recording else 0,
            "captures": len(trace.recording.captures) if trace.recording else 0, "cache": r.cache}
