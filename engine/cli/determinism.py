"""The doctor's --determinism (engine.tools.determinism): the same request alone K times, inside batches of other
runs, on one thread, on the other decode path and in another dtype, each compared bit for bit with the first.

    python -m engine doctor "PROMPT" --temperature 0 --max-new-tokens 16 --determinism [--determinism-repeats K]
        [--determinism-batches 2,8] [--determinism-dtype bfloat16|float16|float32|none] --json
        -> adds determinism: {headline, distinct_outputs, reference, token_ids, text, skipped,
           trials: [{label, axis, why, same_tokens, bit_identical, first_step, logits_max_abs, first_stage, ...}]}
"""
from __future__ import annotations

import argparse

import torch

from engine.cli.args import run_settings
from engine.cli.progress_line import progress_printer
from engine.errors import InputError
from engine.model import Model
from engine.tools.determinism import MAX_BATCH, check_determinism
from engine.variants import cast_model


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--determinism", action="store_true",
                   help="run the request again alone, in batches of other runs, on one thread, on the other decode "
                        "path and in another dtype; compare each with the first bit for bit")
    p.add_argument("--determinism-repeats", type=int, default=3, metavar="K", help="runs alone (default 3)")
    p.add_argument("--determinism-batches", default="2,8", metavar="N[,N...]",
                   help=f"batch sizes to run the request in, the request counted (2..{MAX_BATCH}; default 2,8)")
    p.add_argument("--determinism-dtype", default=None, metavar="DTYPE",
                   help="the dtype trial (default: bfloat16 for a float32 model, else float32; 'none' for none)")


def _batches(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InputError(f"--determinism-batches takes whole numbers separated by commas, got {text!r}") from None
    return out


def _other_dtype(model: Model, a: argparse.Namespace) -> Model | None:
    want = a.determinism_dtype or ("bfloat16" if model.dtype == torch.float32 else "float32")
    if want == "none":
        return None
    if want not in ("float32", "bfloat16", "float16"):
        raise InputError(f"--determinism-dtype must be float32, bfloat16, float16 or none, got {want!r}")
    if getattr(torch, want) == model.dtype:
        raise InputError(f"--determinism-dtype {want} is the model's own dtype; choose another or none")
    return cast_model(model, want)


def extend(model: Model, a: argparse.Namespace, report: dict) -> dict:
    """Add determinism (its report's dict) to the doctor's report when --determinism is given."""
    if not getattr(a, "determinism", False):
        return report
    line = progress_printer(prefix="determinism ", width=60)

    def show(p) -> None:
        line(p.fraction, p.what)
    rep = check_determinism(model, run_settings(a, ignore_eos=a.ignore_eos), repeats=a.determinism_repeats,
                            batches=_batches(a.determinism_batches), other_dtype=_other_dtype(model, a),
                            on_progress=show)
    report["determinism"] = rep.as_dict()
    return report


def human_lines(report: dict) -> list[str]:
    d = report.get("determinism")
    if d is None:
        return []
    lines = [f"determinism: {d['headline']} (reference: {d['reference']})"]
    for t in d["trials"]:
        if t["bit_identical"]:
            lines.append(f"  {t['label']:18s} bit-identical")
            continue
        where = "" if t["first_step"] is None else f"; logits differ from step {t['first_step']} (by " \
                                                    f"{t['logits_max_abs']:.3g})"
        s = t["first_stage"]
        stage = "" if s is None else f"; first statistic that differs: step {s['step']}, {s['stage']}, position " \
                                     f"{s['position']}" + ("" if s["by"] is None else f" (by {s['by']:.3g})")
        lines.append(f"  {t['label']:18s} {'same tokens' if t['same_tokens'] else 'OTHER TOKENS'}{where}{stage}"
                     f" — {t['why']}")
    lines += [f"  not tried: {s}" for s in d["skipped"]]
    return lines
