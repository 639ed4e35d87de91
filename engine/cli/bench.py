"""python -m engine bench: speed of this engine against transformers (see engine.bench)."""
from __future__ import annotations

import argparse

import torch

from ..bench import run_bench
from ..errors import InputError
from .args import load, model_args


def cmd_bench(a: argparse.Namespace) -> int:
    if a.threads is not None:
        if a.threads < 1:
            raise InputError(f"--threads must be >= 1, got {a.threads}")
        torch.set_num_threads(a.threads)
    return run_bench(load(a), a)


def add_commands(sub) -> None:
    b = sub.add_parser("bench", help="prefill/decode speed: engine vs engine+stats vs transformers")
    model_args(b)
    b.add_argument("--prompt-tokens", type=int, default=128)
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the best of each is reported")
    b.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    b.add_argument("--app", action="store_true", help="also full inspection vs plain prefill at 512 and 2,048 tokens")
    b.set_defaults(fn=cmd_bench)
