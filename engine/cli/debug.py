"""Command line for the debugging tools: `python -m engine trace ...` and `python -m engine doctor ...`.

    python -m engine trace "prompt" [generation flags] [--inject KIND@STAGE[:N]]... --out run.trace
    python -m engine doctor "prompt" [generation flags] [--dtype D] [--inject KIND@STAGE[:N]]... [--preset P]
                            [--norm-eps E] [--compare float16|bfloat16] --json

The doctor's JSON: first_nonfinite ({step, stage, layer, position, stage_in_layer, stats} or null), lead_up
(statistics of the stages before it at that position), loops ([{start, period, count, end}], indices into
the generated tokens), stop_reason and nonfinite_logits, and with --compare a precision report. Non-finite
numbers are written as the strings "NaN", "Infinity" and "-Infinity" so that the output is strict JSON.

stop_reason: the engine's (eos, stop_string, max_new_tokens, context), "non-finite logits" (a step's logits
held NaN/Inf: nothing was drawn from them; nonfinite_logits = {step, position, nan, inf} names that step),
"nonfinite" (a stage went NaN/Inf while the logits stayed finite; --keep-going carries on), or "error" (a
sampler stage could not be drawn from; see error).
"""
from __future__ import annotations

import argparse
import json
import math
import time

from engine.cli.args import load, model_args, prompt_args, run_settings, sampling_args
from engine.cli.determinism import add_flags as add_determinism_flags
from engine.cli.determinism import extend as extend_determinism
from engine.cli.determinism import human_lines as determinism_lines
from engine.cli.prescribe import add_doctor_flags, doctor_model, extend_doctor, human_lines
from engine.errors import InputError
from engine.inspection.stat_columns import STAT_NAMES
from engine.inspection.trace import make_trace, save_trace, summary
from engine.tools.doctor import PRESETS, fault_probe, precision_compare, run_doctor
from engine.variants import cast_model


def debug_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--inject", action="append", default=[], metavar="KIND@STAGE[:N]",
                   help="fault: KIND nan|inf|zero|scale=F at a stage (N = position) or weight (N = element); "
                        "repeatable")
    p.add_argument("--preset", default=None, help="a teaching preset: " + ", ".join(PRESETS))
    p.add_argument("--norm-eps", type=float, default=None, help="RMSNorm epsilon for this run (0 to break it)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def add_commands(sub) -> None:
    """Register `trace` and `doctor` on the engine CLI's subparsers."""
    t = sub.add_parser("trace", help="run with full inspection and save everything to one trace file")
    prompt_args(t), sampling_args(t), model_args(t), debug_args(t)
    t.add_argument("--out", required=True, help="trace file to write (safetensors; open it in the app)")
    t.set_defaults(fn=cmd_trace)
    d = sub.add_parser("doctor", help="where does a NaN/Inf first appear; loops; fp32 vs fp16/bf16")
    prompt_args(d), sampling_args(d), model_args(d), debug_args(d)
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    d.add_argument("--keep-going", action="store_true", help="do not stop at the first step with a NaN/Inf")
    d.add_argument("--lead-up", type=int, default=10, help="stages shown before the first non-finite one")
    add_doctor_flags(d)                      # --why-loop, --rescue, --fp32
    add_determinism_flags(d)                 # --determinism
    d.add_argument("--compare", default=None, metavar="DTYPE",
                   help="also compare this model against a float16 or bfloat16 copy over the prompt")
    d.set_defaults(fn=cmd_doctor)


def faults_of(a: argparse.Namespace) -> tuple[list[str], float | None]:
    """Injections and epsilon from --preset, --inject and --norm-eps; a preset's dtype fills in --dtype."""
    injections, eps = [], a.norm_eps
    if a.preset is not None:
        if a.preset not in PRESETS:
            raise InputError(f"unknown preset {a.preset!r}; presets are {', '.join(PRESETS)}")
        pr = PRESETS[a.preset]
        injections += pr.injections
        eps = pr.norm_eps if eps is None else eps
        a.dtype = a.dtype or pr.dtype
    return injections + list(a.inject), eps


def generation_kwargs(a: argparse.Namespace) -> dict:
    return run_settings(a, ignore_eos=a.ignore_eos).generation_kwargs()


def cmd_trace(a: argparse.Namespace) -> int:
    injections, eps = faults_of(a)
    model = load(a)
    probe = fault_probe(model, injections, eps, timing=True).capture("logits")
    t0 = time.perf_counter()
    rep = run_doctor(model, a.prompt, probe=probe, injections=injections, norm_eps=eps, stop_at_nonfinite=False,
                     **generation_kwargs(a))
    trace = make_trace(run_settings(a, ignore_eos=a.ignore_eos), rep.result, probe, model.name,
                       time.perf_counter() - t0,
                       extra={"injections": rep.injections, "norm_eps": eps, "error": rep.error,
                              "dtype": str(model.dtype).removeprefix("torch."), "device": model.device.type})
    path = save_trace(trace, a.out)
    print(json.dumps(strict_json({"out": str(path), "bytes": path.stat().st_size, **summary(trace)})))
    return 0


def cmd_doctor(a: argparse.Namespace) -> int:
    injections, eps = faults_of(a)
    model = doctor_model(load(a), a)         # the precision plan of --fp32, if any
    rep = run_doctor(model, a.prompt, injections=injections, norm_eps=eps, stop_at_nonfinite=not a.keep_going,
                     lead_up_k=a.lead_up, **generation_kwargs(a))
    out = rep.as_dict()
    if a.compare:
        out["precision"] = precision_compare(model, cast_model(model, a.compare), rep.result.prompt_ids).as_dict()
    out = extend_doctor(model, a, out)       # causes (--why-loop), rescue (--rescue)
    out = extend_determinism(model, a, out)
    print(json.dumps(strict_json(out)) if a.json else "\n".join([_human(out), *human_lines(out),
                                                                  *determinism_lines(out)]))
    return 0


def strict_json(x):
    """Non-finite floats -> 'NaN' / 'Infinity' / '-Infinity' (strict JSON has no such numbers)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if x != x else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(x, dict):
        return {k: strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    return x


def _human(r: dict) -> str:
    lines = [f"{r['prompt_tokens']} prompt tokens, {r['generated_tokens']} generated ({r['model_dtype']}); "
             f"stop: {r['stop_reason']}" + (f"; {r['error']}" if r["error"] else "")]
    if r.get("nonfinite_logits"):
        b = r["nonfinite_logits"]
        held = "NaN or Inf" if b["nan"] is None else f"{b['nan']} NaN and {b['inf']} Inf"
        lines.append(f"step {b['step']} (position {b['position']}): the logits held {held} values; no token was "
                     "drawn from them")
    if r["injections"] or r["norm_eps"] is not None:
        lines.append(f"faults: {', '.join(r['injections']) or '-'}; RMSNorm eps: {r['norm_eps']}")
    nf = r["first_nonfinite"]
    if nf is None:
        lines.append("every stage stayed finite")
    else:
        lines.append(f"first non-finite: step {nf['step']}, stage {nf['stage']}, layer {nf['layer']}, position "
                     f"{nf['position']} (NaN {nf['stats']['nan']:g}, Inf {nf['stats']['inf']:g})")
        lines.append(f"  {'stage':28s} " + " ".join(f"{h:>10s}" for h in STAT_NAMES))
        for row in r["lead_up"]:
            lines.append(f"  {row['stage']:28s} " + " ".join(f"{row[h]:10.4g}" for h in STAT_NAMES))
    loops = r["loops"]
    lines.append("loops: " + ("none" if not loops else "; ".join(
        f"start {lp['start']}, period {lp['period']}, count {lp['count']}" for lp in loops)))
    if "precision" in r:
        p, d = r["precision"], r["precision"]["divergence"]
        lines.append(f"precision {p['dtype']}: top-1 agreement {p['top1_agreement']:.3f}; divergence (rel. error > "
                     f"{p['threshold']:.3g}): " + ("none" if d is None else f"{d['stage']} ({d['rel_err']:.3g})"))
    return "\n".join(lines)

