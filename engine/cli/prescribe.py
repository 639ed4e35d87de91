"""Command line for the prescribing doctors: `python -m engine quant ...`, and the doctor's --why-loop,
--rescue and --fp32.

    python -m engine quant "PROMPT" [--formats Q8_0,Q4_0] [--threshold T] [--embed] [generation flags] [--json]
    python -m engine doctor "PROMPT" [generation flags] --why-loop [--why-loop-tokens N] --json
        -> adds causes: [{kind, change, outcome, verdict, loop, loop_gone, text_after, tokens, stopped, detail}]
           (outcome: engine.tools.loop_verdict) and why_loop ({headline, status, loop, horizon, rerun_horizon,
           run_tokens, looked_further, ...}): the run of --max-new-tokens is the one diagnosed; only when it holds
           no loop does --why-loop-tokens N rerun it further
    python -m engine doctor "PROMPT" --dtype float16 [--preset P | --inject ...] --rescue --json
        -> adds rescue: {fp32: [units], reruns, finite, top1_agreement, near_ties, ties, complement, trials,
           check (the command that checks the set), ...}
    python -m engine doctor "PROMPT" --dtype float16 [--preset P | --inject ...] --fp32 UNIT[,UNIT...]
        -> the doctor runs with those units in fp32 (engine.variants.precision_plan); adds fp32: [units]
    ... --fp32 UNIT[,UNIT...] --verify   (or --verify alone: the float16 / bfloat16 run as it is)
        -> adds fp32_check: the plan judged against the fp32 run as the rescue search judges each rerun
           (engine.tools.rescue_runs.check_plan): {passes, finite, top1_agreement, ties, disagreements, near_ties, ...}

The doctor calls doctor_model(model, args) on its loaded model before run_doctor (so --fp32 changes the
run), then extend_doctor(model, args, report_dict) with that same model. Bad input is an InputError.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import shlex
from dataclasses import fields

import torch

from engine.cli.args import SAMPLER_FLAGS
from engine.cli.progress_line import progress_printer
from engine.errors import InputError
from engine.loader import load_model
from engine.model import Model
from engine.progress import Progress
from engine.sampling import SamplingParams
from engine.settings import RunSettings
from engine.tools.quant import FORMATS, THRESHOLD, check_formats, quant_report
from engine.tools.rescue import MAX_NEW_TOKENS, RescueReport, find_rescue
from engine.tools.rescue_runs import TIE_ULPS, check_plan
from engine.tools.why_loop import LOOK_FURTHER, MAX_RERUNS, why_loop
from engine.variants import precision_plan


def add_commands(sub, common) -> None:
    """Register `quant` on the engine CLI's subparsers; common: the shared argument builders."""
    q = sub.add_parser("quant", help="quantization damage per stage: Q8_0 / Q5_x / Q4_x copies vs the model")
    common.prompt_args(q), common.sampling_args(q), common.model_args(q)
    q.add_argument("--formats", default="Q8_0,Q4_0", help=f"comma-separated GGUF formats (e.g. {','.join(FORMATS)})")
    q.add_argument("--threshold", type=float, default=THRESHOLD,
                   help="relative error of the residual stream that counts as 'over' (first_layer_over)")
    q.add_argument("--embed", action="store_true", help="also quantize the token embedding (tied lm_head)")
    q.add_argument("--json", action="store_true", help="print the report as JSON")
    q.set_defaults(fn=functools.partial(cmd_quant, common=common))


def add_doctor_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--why-loop", action="store_true",
                   help=f"if the run (--max-new-tokens) ends in a loop, rerun it with candidate causes removed (at "
                        f"most {MAX_RERUNS} reruns) and list them")
    p.add_argument("--why-loop-tokens", type=int, default=None, metavar="N",
                   help=f"with --why-loop, when the run holds no loop: rerun the same prompt and seed for N tokens "
                        f"(e.g. {LOOK_FURTHER}) and diagnose a loop there")
    p.add_argument("--rescue", action="store_true",
                   help="find the smallest set of units that must run in fp32 (needs --dtype float16/bfloat16)")
    p.add_argument("--rescue-tokens", type=int, default=MAX_NEW_TOKENS,
                   help=f"generated tokens the rescue compares (default {MAX_NEW_TOKENS}; float16 on a CPU is slow)")
    p.add_argument("--fp32", default=None, metavar="UNIT[,UNIT...]",
                   help="run these units in fp32: embed, blocks.I.attn, blocks.I.mlp, blocks.I.resid, final_norm, "
                        "logits")
    p.add_argument("--verify", action="store_true",
                   help="judge this float16 / bfloat16 run (with --fp32: that plan) against the fp32 run as the "
                        "--rescue search judges each rerun: finite, top-1 agreement, ties")


def parse_units(text: str) -> list[str]:
    units = [u.strip() for u in text.split(",") if u.strip()]
    if not units:
        raise InputError("--fp32 needs at least one unit, e.g. --fp32 blocks.11.mlp,blocks.11.resid")
    return units


def fp32_source(model: Model, a: argparse.Namespace) -> Model:
    """The float32 weights (the model itself when it is float32; else the same source loaded again, once per
    command: --fp32 and --verify / --rescue share it)."""
    if model.dtype == torch.float32:
        return model
    if getattr(a, "_fp32_source", None) is None:
        a._fp32_source = load_model(a.model, device=a.device, dtype="float32")
    return a._fp32_source


def doctor_model(model: Model, a: argparse.Namespace) -> Model:
    """The model the doctor should run: with --fp32, precision_plan(model, units) (fp32 copies from the float32
    weights, not upcast from the low-precision ones); else model itself."""
    if not getattr(a, "fp32", None):
        return model
    units = parse_units(a.fp32)
    if model.dtype == torch.float32:
        raise InputError("--fp32 keeps units of a float16 / bfloat16 run in fp32; add --dtype float16 or bfloat16")
    return precision_plan(model, units, source=fp32_source(model, a))


def settings_of(a: argparse.Namespace, **changes) -> RunSettings:
    """The run the doctor's flags describe (sampler settings by SamplingParams' own field names)."""
    params = SamplingParams(**{f.name: getattr(a, f.name) for f in fields(SamplingParams) if hasattr(a, f.name)})
    kw = dict(prompt=a.prompt, chat=getattr(a, "chat", False), system=getattr(a, "system", None),
              allow_special=getattr(a, "allow_special", False), max_new_tokens=a.max_new_tokens, params=params,
              seed=getattr(a, "seed", 0), ignore_eos=getattr(a, "ignore_eos", False))
    return RunSettings(**{**kw, **changes})


def job_progress(what: str):
    """on_progress (engine.progress) printing one line that updates in place; never answers STOP (Ctrl-C)."""
    line = progress_printer(prefix=f"{what} ", width=60)

    def show(p: Progress) -> None:
        line(p.fraction, p.what)
    return show


def extend_doctor(model: Model, a: argparse.Namespace, report: dict) -> dict:
    """Add fp32 (the plan that ran), causes / why_loop (--why-loop) and rescue (--rescue) to the doctor's
    report dict (run_doctor(...).as_dict()); model is the model the doctor ran."""
    if getattr(a, "fp32", None):
        report["fp32"] = list(model.fp32_units)
    if getattr(a, "rescue", False):
        if model.fp32_units:
            raise InputError("--rescue searches for the fp32 units itself; leave out --fp32")
        if model.dtype == torch.float32:
            raise InputError("--rescue looks for the units a float16 / bfloat16 run needs in fp32; add --dtype "
                             "float16 (or a preset with a dtype, e.g. --preset fp16-overflow)")
        if a.rescue_tokens < 1:
            raise InputError(f"--rescue-tokens must be >= 1, got {a.rescue_tokens}")
        ref = fp32_source(model, a)
        rep = find_rescue(ref, model, settings_of(a), injections=report.get("injections", []),
                          norm_eps=report.get("norm_eps"), max_new_tokens=min(a.max_new_tokens, a.rescue_tokens),
                          on_progress=job_progress("rescue"))
        report["rescue"] = rep.as_dict()
        report["rescue"]["check"] = check_command(settings_of(a), rep, device=a.device, model=a.model)
    if getattr(a, "verify", False):
        report["fp32_check"] = verify(model, a, report)
    further = getattr(a, "why_loop_tokens", None)
    if further is not None and not getattr(a, "why_loop", False):
        raise InputError("--why-loop-tokens goes with --why-loop")
    if further is not None and further <= a.max_new_tokens:
        raise InputError(f"--why-loop-tokens looks further than the run: it must be above --max-new-tokens "
                         f"({a.max_new_tokens}), got {further}")
    if getattr(a, "why_loop", False):
        rep = why_loop(model, settings_of(a), look_further=further, on_progress=job_progress("why-loop"))
        d = rep.as_dict()
        report["causes"] = d.pop("causes")
        report["why_loop"] = d
    return report


def verify(model: Model, a: argparse.Namespace, report: dict) -> dict:
    """--verify: engine.tools.rescue_runs.check_plan on the doctor's model (its --fp32 plan, if any), the doctor's
    faults and --max-new-tokens generated tokens."""
    if model.dtype == torch.float32:
        raise InputError("--verify judges a float16 / bfloat16 run against fp32; add --dtype float16 or bfloat16")
    reference, t = check_plan(fp32_source(model, a), model, settings_of(a), injections=report.get("injections", []),
                              norm_eps=report.get("norm_eps"), max_new_tokens=a.max_new_tokens)
    near = reference.near_ties
    # the doctor's own run records every stage's statistics (explicit attention): it rounds otherwise, and
    # may take the other token of a near tie; where it first leaves fp32's tokens is said, and whether a tie
    ran = report.get("token_ids") or []
    left = next((i for i, (x, y) in enumerate(zip(ran, reference.tokens)) if x != y), None)
    return {"units": t.units, "passes": t.passes(), "finite": t.finite, "first_nonfinite": t.first_nonfinite,
            "top1_agreement": t.top1_agreement, "ties": t.ties, "disagreements": t.disagreements,
            "near_ties": near, "tokens": len(reference.tokens), "logit_rel_err": t.logit_rel_err,
            "tie_ulps": TIE_ULPS, "dtype": str(model.dtype).removeprefix("torch."),
            "doctor_run_leaves_fp32_at": None if left is None else
            {"step": left, "near_tie": any(n["step"] == left for n in near)}}


def check_command(settings: RunSettings, report: RescueReport, *, device: str | None = None,
                  model: str | None = None) -> str | None:
    """The doctor command that checks a rescue report's set with --verify (the search's own judgement of a
    rerun, so it gives the search's verdict); None when no set was found. settings: the run searched."""
    if report.fp32 is None:
        return None
    defaults = SamplingParams()
    parts = ["python -m engine doctor"] + ([] if settings.prompt.startswith("-") else [shlex.quote(settings.prompt)])
    parts += ["--chat"] if settings.chat else []
    parts += [f"--system {shlex.quote(settings.system)}"] if settings.chat and settings.system else []
    parts += ["--allow-special"] if settings.allow_special else []
    parts += [f"--model {shlex.quote(str(model))}"] if model else []
    parts += [f"--device {shlex.quote(str(device))}"] if device else []
    parts += [f"--dtype {report.dtype}"] + [f"--inject {shlex.quote(i)}" for i in report.injections]
    parts += [] if report.norm_eps is None else [f"--norm-eps {report.norm_eps!r}"]
    parts += [f"{flag} {getattr(settings.params, name)!r}" for flag, (name, _, _) in SAMPLER_FLAGS.items()
              if getattr(settings.params, name) != getattr(defaults, name)]
    parts += [f"--seed {settings.seed}"] if settings.seed else []
    parts += [f"--max-new-tokens {report.tokens}"]
    parts += [f"--fp32 {','.join(report.fp32)}"] if report.fp32 else []
    parts += ["--verify"] + (["--", shlex.quote(settings.prompt)] if settings.prompt.startswith("-") else [])
    return " ".join(parts)


def _ties_text(near: list[dict], dtype: str) -> str:
    if not near:
        return f"no near ties (fp32's top two within {TIE_ULPS} {dtype} spacings)"
    return f"near ties (fp32's top two within {TIE_ULPS} {dtype} spacings; a different top-1 there is a tie): " + \
        ", ".join(f"step {t['step']} ({t['gap']:.4f} < {t['margin']:.4g})" for t in near)


def human_lines(report: dict) -> list[str]:
    """Plain-text lines for what extend_doctor added (the doctor prints them after its own)."""
    lines = []
    if "fp32" in report:
        lines.append(f"fp32 units: {', '.join(report['fp32'])}")
    if "rescue" in report:
        r = report["rescue"]
        what = "none needed" if r["fp32"] == [] else ("none found" if r["fp32"] is None else ", ".join(r["fp32"]))
        lines.append(f"fp32 rescue set: {what} ({r['reruns']} reruns, bound {r['bound']}); finite {r['finite']}, "
                     f"top-1 agreement {r['top1_agreement']:.3f} outside ties"
                     + (f"; ties at steps {r['ties']}" if r["ties"] else "") + (f"; {r['note']}" if r["note"] else ""))
        lines.append("  " + _ties_text(r["near_ties"], r["dtype"]))
        if r["complement"]:
            c = r["complement"]
            lines.append(f"  complement ({c['units']} units): finite {c['finite']}, fixes it: {c['fixes']}")
        if r.get("check"):
            lines.append(f"  check it: {r['check']}")
    if "fp32_check" in report:
        v = report["fp32_check"]
        lines.append(f"fp32 check ({', '.join(v['units']) or 'no unit'} in fp32; fp32's {v['tokens']} tokens replayed "
                     f"step by step with the KV cache, as the rescue search judges a rerun): "
                     f"{'passes' if v['passes'] else 'fails'}; finite {v['finite']}"
                     + (f" (first non-finite: {v['first_nonfinite']})" if v["first_nonfinite"] else "")
                     + f", top-1 agreement {v['top1_agreement']:.3f} outside ties; ties at steps {v['ties'] or 'none'}"
                     + f"; disagreements at steps {v['disagreements'] or 'none'}")
        lines.append("  " + _ties_text(v["near_ties"], v["dtype"]))
        if (left := v["doctor_run_leaves_fp32_at"]) is not None:
            lines.append(f"  the doctor's run above (every stage's statistics recorded, which rounds otherwise) "
                         f"leaves fp32's tokens at step {left['step']}"
                         + (", a near tie" if left["near_tie"] else ", not a near tie"))
    if "why_loop" in report:
        w = report["why_loop"]
        lines.append(f"why the loop: {w['headline']}")
        if w["status"] == "no loop" and not w["looked_further"]:
            lines.append(f"  to look further: add --why-loop-tokens {LOOK_FURTHER} (reruns the same prompt and seed "
                         f"for {LOOK_FURTHER} tokens)")
        if report["causes"]:
            lines.append(f"  causes ({w['reruns']} reruns, each judged past the run's {w['horizon']} tokens, up to "
                         f"{w['rerun_horizon']}):")
        for c in report["causes"]:
            # a delayed loop shows at the end of the text: its last characters, the others' first
            text = c["text_after"][-120:] if c["outcome"] == "loop delayed" else c["text_after"][:60]
            lines.append(f"  [{c['outcome'].removeprefix('loop ')}] {c['kind']:8s} {c['change']}: {c['verdict']} "
                         f"({c['tokens']} tokens): {text!r}")
    return lines


def strict(x):
    """Non-finite floats -> 'NaN' / 'Infinity' / '-Infinity' (strict JSON has no such numbers)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if x != x else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(x, dict):
        return {k: strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict(v) for v in x]
    return x


def cmd_quant(a: argparse.Namespace, common) -> int:
    formats = check_formats(a.formats.split(","))           # before the model loads
    model = common.load(a)
    settings = settings_of(a, params=common.sampling_params(a))
    report = quant_report(model, settings, formats, threshold=a.threshold, embed=a.embed,
                          on_progress=job_progress("quant")).as_dict()
    if a.json:
        print(json.dumps(strict(report)))
        return 0
    print(f"{report['reference']}: {report['positions']} positions, {report['steps']} generated steps; "
          f"threshold {report['threshold']:g} (relative error of the residual stream)")
    print(f"{'format':8s} {'KL mean':>10s} {'same top':>9s} {'first layer over':>17s}  resid_post error by layer")
    for fmt, r in report["formats"].items():
        resid = [x["rel_err"] for x in r["per_stage"] if x["stage_in_layer"] == "resid_post"]
        over = "-" if r["first_layer_over"] is None else str(r["first_layer_over"])
        print(f"{fmt:8s} {r['kld_mean']:10.4g} {r['same_top']:9.3f} {over:>17s}  "
              + " ".join(f"{e:.3f}" for e in resid[::max(1, len(resid) // 10)]))
    return 0
