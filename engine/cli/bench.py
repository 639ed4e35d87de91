"""python -m engine bench: speed of this engine against transformers and the memory-bandwidth floor (see
engine.bench.speed)."""
from __future__ import annotations

import argparse
import json

import torch

from engine.bench.class_run import class_bench
from engine.bench.held import held_figures
from engine.bench.sizes import GGUF_ENTRIES, SHAPES, sizes_bench
from engine.bench.speed import run_bench
from engine.bench.tools import TARGETS, run_tools_bench
from engine.cli.args import load, model_args
from engine.errors import InputError
from engine.memory import process_rss


def cmd_bench(a: argparse.Namespace) -> int:
    if a.threads is not None:
        if a.threads < 1:
            raise InputError(f"--threads must be >= 1, got {a.threads}")
        torch.set_num_threads(a.threads)
    if a.prompt_tokens < 2:
        raise InputError(f"--prompt-tokens must be >= 2, got {a.prompt_tokens}")
    if a.new_tokens < 2:
        raise InputError(f"--new-tokens must be >= 2 (decode speed needs a token after the first), got "
                         f"{a.new_tokens}")
    if a.tools:
        return _tools(a)
    if a.class_:
        return _class(a)
    if a.sizes:
        return _sizes(a)
    a.repeats = 5 if a.repeats is None else a.repeats
    if a.repeats < 1:
        raise InputError(f"--repeats must be >= 1, got {a.repeats}")
    if any(n < 2 for n in a.app_lengths):
        raise InputError(f"--app-lengths must be >= 2 tokens each, got {a.app_lengths}")
    before = process_rss()
    model = load(a)
    return run_bench(model, a, held=held_figures(model, before))


def _tools(a: argparse.Namespace) -> int:
    rounds = 3 if a.repeats is None else a.repeats
    if rounds < 1:
        raise InputError(f"--repeats must be >= 1, got {rounds}")
    kwargs = {"prompt": a.tools_prompt} if a.tools_prompt else {}
    out = run_tools_bench(load(a), rounds=rounds, tools=tuple(a.tool_names or TARGETS), quiet=a.json, **kwargs)
    if a.json:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}))
    else:
        for name in a.tool_names or TARGETS:
            print(f"{name}_over_plain {out[name + '_over_plain']:.2f} (target {TARGETS[name]:g}, "
                  f"{'met' if out[name + '_meets'] else 'NOT met'})")
    return 0


def _sizes(a: argparse.Namespace) -> int:
    names = tuple(a.size_names or (*SHAPES, *GGUF_ENTRIES))
    out = sizes_bench(names, say=(lambda *_: None) if a.json else print)
    if a.json:
        print(json.dumps({k: {n: (round(v, 4) if isinstance(v, float) else v) for n, v in r.items()}
                          for k, r in out.items()}))
    return 0


def _class(a: argparse.Namespace) -> int:
    rounds = 3 if a.repeats is None else a.repeats
    if rounds < 1:
        raise InputError(f"--repeats must be >= 1, got {rounds}")
    if any(n < 1 for n in a.class_sizes):
        raise InputError(f"--class-sizes must be >= 1 student each, got {a.class_sizes}")
    sizes = tuple(dict.fromkeys([1, *a.class_sizes]))
    out = class_bench(load(a), sizes=sizes, rounds=rounds, say=(lambda *_: None) if a.json else print)
    if a.json:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()
                          if not k.endswith("_rounds")}))
    return 0


def add_commands(sub) -> None:
    b = sub.add_parser("bench", help="prefill/decode speed: engine vs engine+stats vs transformers vs bandwidth")
    model_args(b)
    b.add_argument("--prompt-tokens", type=int, default=128)
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=None,
                   help="rounds: ratios are the median of the rounds' own ratios, speeds the best round's "
                        "(default 5; with --tools 3)")
    b.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    b.add_argument("--app", action="store_true",
                   help="also the app's full inspection vs plain prefill (512, 2,048, 8,000 tokens: time, kept and "
                        "peak memory) and its decode time per token")
    b.add_argument("--app-lengths", type=int, nargs="+", default=[512, 2048, 8000], metavar="N",
                   help="prompt lengths for --app")
    b.add_argument("--tools", action="store_true",
                   help="instead: each doctor's and explainer's time as a multiple of one plain generation of the "
                        "same prompt and length (engine.bench.tools)")
    b.add_argument("--tool", dest="tool_names", action="append", choices=list(TARGETS), default=None,
                   help="with --tools: only this tool (repeatable)")
    b.add_argument("--tools-prompt", default=None, help="with --tools: the prompt (default: a looping one)")
    b.add_argument("--class", dest="class_", action="store_true",
                   help="instead: a class pressing Run at once through the app's run path (1, 8, 30 students of "
                        "32 tokens: the last finish over one alone; engine.bench.class_run)")
    b.add_argument("--class-sizes", type=int, nargs="+", default=[8, 30], metavar="N",
                   help="with --class: class sizes beside the lone student")
    b.add_argument("--sizes", action="store_true",
                   help="instead: models of public shapes (Qwen3-0.6B, Llama-3.2-1B, Gemma-3-1B in fp32 and bf16 and as "
                        "Q8_0 and Q4_K GGUFs, a Llama-3.1-8B Q4_K GGUF), each in a fresh process: bytes held over the weights', decode over "
                        "the floor, over transformers (engine.bench.sizes; writes the weights once, ~15 GB of disk)")
    b.add_argument("--size", dest="size_names", action="append", choices=[*SHAPES, *GGUF_ENTRIES],
                   default=None, help="with --sizes: only this model (repeatable)")
    b.add_argument("--json", action="store_true", help="print the figures as one JSON object instead of tables")
    b.set_defaults(fn=cmd_bench)
