"""python -m engine show FILE [--json]: open a trace with the app's validation and print its summary."""
from __future__ import annotations

import argparse
import json

from engine.cli.debug import strict_json
from engine.inspection.trace import load_trace, summary
from engine.inspection.trace_check import TraceBounds


def cmd_show(a: argparse.Namespace) -> int:
    trace = load_trace(a.file, TraceBounds())
    info = summary(trace)
    if a.json:
        print(json.dumps(strict_json(info)))
        return 0
    nf = info["first_nonfinite"]
    print(f"model {info['model']}; {info['prompt_tokens']} prompt + {info['generated_tokens']} generated tokens; "
          f"stop: {info['stop_reason']}")
    print(f"{info['stat_blocks']} statistics blocks, {info['captures']} captures; loops: {info['loops']}; "
          + ("every stage finite" if nf is None else
             f"first non-finite: {nf['stage']} (layer {nf['layer']}), position {nf['position']}, step {nf['step']}"))
    print(repr(trace.result.text))
    return 0


def add_commands(sub) -> None:
    s = sub.add_parser("show", help="open a trace file (validated as the app does) and print its summary")
    s.add_argument("file")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    s.set_defaults(fn=cmd_show)
