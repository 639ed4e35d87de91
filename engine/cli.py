"""Command line: python -m engine {generate,hooks,stats,bench} ... (see README 'Command line')."""
from __future__ import annotations

import argparse
import csv
import sys
import time

from .errors import EngineError


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory, .gguf file or org/name (default: bundled SmolLM2)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on cuda, fp32 on cpu)")


def _prompt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--allow-special", action="store_true",
                   help="let special-token text in the prompt act as control tokens")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--no-repeat-ngram", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def generation_kwargs(a: argparse.Namespace) -> dict:
    return dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                min_p=a.min_p, repetition_penalty=a.repetition_penalty, frequency_penalty=a.frequency_penalty,
                presence_penalty=a.presence_penalty, no_repeat_ngram=a.no_repeat_ngram, seed=a.seed,
                stop=a.stop, chat=a.chat, system=a.system, allow_special=a.allow_special)


def load(a: argparse.Namespace):
    from .loader import load_model

    def progress(f: float, msg: str) -> None:
        print(f"\r[{f * 100:5.1f}%] {msg[:70]:70s}", end="" if f < 1 else "\n", file=sys.stderr, flush=True)
    return load_model(a.model, device=a.device, dtype=a.dtype, progress=progress)


def cmd_generate(a: argparse.Namespace) -> int:
    model = load(a)
    t0 = time.perf_counter()
    result = model.generate(a.prompt, on_token=lambda s: print(s.text, end="", flush=True), **generation_kwargs(a))
    wall = time.perf_counter() - t0
    n, t = len(result.token_ids), result.timings
    print()
    print(f"[{n} tokens, stop: {result.stop_reason}; prefill {len(result.prompt_ids)} tokens in "
          f"{t['prefill']:.3f}s ({len(result.prompt_ids) / max(t['prefill'], 1e-9):.1f} tok/s); decode "
          f"{1 / max(t['per_token_decode'], 1e-9):.1f} tok/s; total {wall:.2f}s]", file=sys.stderr)
    return 0


def cmd_hooks(a: argparse.Namespace) -> int:
    if a.model is None and a.layers is not None:
        from .stages import hook_names
        names = hook_names(a.layers)
    else:
        names = load(a).hook_names()
    print("\n".join(names))
    return 0


def aggregate(values) -> list[float]:
    """(T, 7) per-position stats -> one row over all positions (pooled mean and std)."""
    v = values.double()
    mean = v[:, 2].mean()
    std = (v[:, 3] ** 2 + (v[:, 2] - mean) ** 2).mean().sqrt()  # pooled over equally sized rows
    return [float(v[:, 0].min()), float(v[:, 1].max()), float(mean), float(std), float(v[:, 4].max()),
            int(v[:, 5].sum()), int(v[:, 6].sum())]


def cmd_stats(a: argparse.Namespace) -> int:
    from .generate import prompt_ids
    from .probe import Probe
    from .stats import STAT_NAMES

    model = load(a)
    ids = prompt_ids(model, a.prompt, chat=a.chat, system=a.system, allow_special=a.allow_special)
    probe = Probe().record_stats(a.stages)
    model.logits(ids, probe)
    rows = [[r.name, "" if r.layer is None else r.layer, *aggregate(r.values)] for r in probe.stat_records()]
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


def cmd_bench(a: argparse.Namespace) -> int:
    from .bench import run_bench
    return run_bench(a)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description="LLM Inspector engine")
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="stream a generation and print tok/s")
    _prompt_args(g), _sampling_args(g), _model_args(g)
    g.set_defaults(fn=cmd_generate)
    h = sub.add_parser("hooks", help="list every stage name a probe can hook")
    _model_args(h)
    h.add_argument("--layers", type=int, default=None, help="list names for N layers without loading a model")
    h.set_defaults(fn=cmd_hooks)
    s = sub.add_parser("stats", help="per-stage, per-layer statistics of one forward")
    _prompt_args(s), _model_args(s)
    s.add_argument("--stages", default="*", help="glob of stages (default: every stage)")
    s.add_argument("--csv", default=None, help="also write the table to this CSV file")
    s.set_defaults(fn=cmd_stats)
    b = sub.add_parser("bench", help="prefill/decode speed: engine vs engine+stats vs transformers")
    _model_args(b)
    b.add_argument("--prompt-tokens", type=int, default=128)
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the best of each is reported")
    b.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    b.add_argument("--app", action="store_true", help="also the app benchmarks (full inspection, sampling redraw)")
    b.set_defaults(fn=cmd_bench)
    from .cli_debug import add_debug_commands
    add_debug_commands(sub)                  # trace, doctor
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
