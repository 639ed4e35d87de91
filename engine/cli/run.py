"""python -m engine generate | hooks | stats: stream a generation, list the stage names, per-stage statistics."""
from __future__ import annotations

import argparse
import csv
import sys
import time

from engine.cli.args import load, model_args, prompt_args, run_settings, sampling_args
from engine.generate import generate, prompt_ids
from engine.inspection.probe import Probe
from engine.inspection.stages import hook_names
from engine.inspection.stat_columns import STAT_NAMES, pool


def cmd_generate(a: argparse.Namespace) -> int:
    model = load(a)
    t0 = time.perf_counter()
    settings = run_settings(a)
    result = generate(model, a.prompt, on_token=lambda s: print(s.text, end="", flush=True),
                      **settings.generation_kwargs())
    wall = time.perf_counter() - t0
    n, t = len(result.token_ids), result.timings
    print()
    print(f"[{n} tokens, stop: {result.stop_reason}; prefill {len(result.prompt_ids)} tokens in "
          f"{t['prefill']:.3f}s ({len(result.prompt_ids) / max(t['prefill'], 1e-9):.1f} tok/s); decode "
          f"{1 / max(t['per_token_decode'], 1e-9):.1f} tok/s; total {wall:.2f}s]", file=sys.stderr)
    return 0


def cmd_hooks(a: argparse.Namespace) -> int:
    if a.model is None and a.layers is not None:
        names = hook_names(a.layers)
    else:
        names = load(a).hook_names()
    print("\n".join(names))
    return 0


def aggregate(values) -> list[float]:
    """(T, 7) per-position stats -> one row over all positions (engine.inspection.stat_columns.pool)."""
    p = pool([(["x"], values[None])])
    return [float(p.cols[k][0]) for k in ("min", "max", "mean", "std", "absmax")] + \
        [int(p.cols[k][0]) for k in ("nan", "inf")]


def cmd_stats(a: argparse.Namespace) -> int:
    model = load(a)
    ids = prompt_ids(model, a.prompt, chat=a.chat, system=a.system, allow_special=a.allow_special)
    probe = Probe().record_stats(a.stages)
    model.logits(ids, probe)
    rows = [[r.name, "" if r.layer is None else r.layer, *aggregate(r.values)] for r in probe.recording.stat_records()]
    header = ["stage", "layer", *STAT_NAMES]
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            csv.writer(f).writerows([header, *rows])
        print(f"wrote {len(rows)} rows to {a.csv}", file=sys.stderr)
    print(f"{len(ids)} positions; statistics over all positions of one forward")
    print(f"{'stage':28s} {'layer':>5s} " + " ".join(f"{h:>11s}" for h in STAT_NAMES))
    for r in rows:
        print(f"{r[0]:28s} {str(r[1]):>5s} " + " ".join(f"{x:11.4g}" if isinstance(x, float) else f"{x:11d}"
                                                      for x in r[2:]))
    return 0


def add_commands(sub) -> None:
    g = sub.add_parser("generate", help="stream a generation and print tok/s")
    prompt_args(g), sampling_args(g), model_args(g)
    g.set_defaults(fn=cmd_generate)
    h = sub.add_parser("hooks", help="list every stage name a probe can hook")
    model_args(h)
    h.add_argument("--layers", type=int, default=None, help="list names for N layers without loading a model")
    h.set_defaults(fn=cmd_hooks)
    s = sub.add_parser("stats", help="per-stage, per-layer statistics of one forward")
    prompt_args(s), model_args(s)
    s.add_argument("--stages", default="*", help="glob of stages (default: every stage)")
    s.add_argument("--csv", default=None, help="also write the table to this CSV file")
    s.set_defaults(fn=cmd_stats)
