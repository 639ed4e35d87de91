"""Command line for a GGUF file as stored against its dequantised self (engine.tools.quant_stored):

    python -m engine quant-stored "PROMPT" [--model FILE.gguf] [--tolerance T] [generation flags] [--json]

The file is loaded twice (quant="stored" and dequantised to float32, on the CPU); without --model, the bundled
GGUF. --json prints the StoredReport's as_dict(); else the headline figures and the stages above the tolerance.
"""
from __future__ import annotations

import argparse
import functools
import json

from engine.cli.prescribe import job_progress, settings_of, strict
from engine.cli.progress_line import progress_printer
from engine.errors import InputError
from engine.tools.quant_stored import TOLERANCE, load_pair, stored_report


def add_commands(sub, common) -> None:
    """Register `quant-stored` on the engine CLI's subparsers; common: the shared argument builders."""
    q = sub.add_parser("quant-stored", help="a GGUF file as stored vs the same file dequantised, stage by stage")
    common.prompt_args(q), common.sampling_args(q)
    q.add_argument("--model", default=None, help="a .gguf file (default: the bundled model's GGUF)")
    q.add_argument("--tolerance", type=float, default=TOLERANCE,
                   help="the relative L2 difference a stage may show (float32 summation order)")
    q.add_argument("--json", action="store_true", help="print the report as JSON")
    q.set_defaults(fn=functools.partial(cmd_stored, common=common))


def cmd_stored(a: argparse.Namespace, common) -> int:
    if a.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {a.max_new_tokens}")
    settings = settings_of(a, params=common.sampling_params(a))        # a bad flag is said before the loads
    stored, dequant = load_pair(a.model, progress_printer())
    report = stored_report(stored, dequant, settings, tolerance=a.tolerance, on_progress=job_progress("stored"))
    d = report.as_dict()
    if a.json:
        print(json.dumps(strict(d)))
        return 0
    print(f"{report.stored} against {report.dequantized}: {report.positions} positions, {report.steps} steps; "
          f"tolerance {report.tolerance:g} (relative L2)")
    print(f"logits: max |Δ| {report.logits_max_abs:.3g}, relative L2 {report.logits_rel_l2:.3g}; KL mean "
          f"{report.kl_mean:.3g} nats, max {report.kl_max:.3g}; same top token {report.same_top:.1%}")
    worst = max(report.per_stage, key=lambda r: r["rel_l2"])
    print(f"largest stage difference: {worst['stage']} (max |Δ| {worst['max_abs']:.3g}, relative L2 "
          f"{worst['rel_l2']:.3g}); first stage over the tolerance: {report.first_stage_over or 'none'}")
    own = report.own_first_divergence
    print("generating on its own, the stored model writes " + ("the same tokens" if own is None else
                                                              f"other tokens from step {own}"))
    return 0
