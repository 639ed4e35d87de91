"""Command line for the quantization scoreboard (engine.tools.quant_scoreboard): llama.cpp's --kl-divergence
figures per GGUF format over a set of texts.

    python -m engine quant-scoreboard [TEXT ...] [--texts-file FILE] [--formats Q8_0,Q4_0] [--embed]
                                      [--max-tokens N] [model flags] [--json]

Without TEXT or --texts-file the built-in texts are scored (quant_scoreboard.PROMPTS); a file holds texts with a
blank line between two. --json prints the Scoreboard's as_dict(); else one block per format in perplexity.cpp's
names and order.
"""
from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

from engine.cli.prescribe import job_progress, strict
from engine.tools.quant import FORMATS, check_formats
from engine.tools.quant_scoreboard import DEFAULT_FORMATS, FEW_TOKENS, MAX_TOKENS, PROMPTS, scoreboard, split_texts


def add_commands(sub, common) -> None:
    """Register `quant-scoreboard` on the engine CLI's subparsers; common: the shared argument builders."""
    s = sub.add_parser("quant-scoreboard", help="llama.cpp's --kl-divergence figures per GGUF format over texts")
    s.add_argument("texts", nargs="*", help="texts to score (default: the built-in set)")
    s.add_argument("--texts-file", default=None, help="a file of texts, a blank line between two")
    s.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                   help=f"comma-separated GGUF formats (e.g. {','.join(FORMATS)})")
    s.add_argument("--embed", action="store_true", help="also quantize the token embedding (tied lm_head)")
    s.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="refuse texts holding more tokens than this")
    common.model_args(s)
    s.add_argument("--json", action="store_true", help="print the scoreboard as JSON")
    s.set_defaults(fn=functools.partial(cmd_scoreboard, common=common))


def texts_of(a: argparse.Namespace) -> list[str]:
    texts = list(a.texts)
    if a.texts_file is not None:
        texts += split_texts(Path(a.texts_file).read_text(encoding="utf-8"))
    return texts if texts or a.texts_file is not None else list(PROMPTS)


def _pm(value, unc, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:10.6f}" + ("" if unc is None else f" ± {unc:10.6f}") + (f" {unit}" if unit else "")


def cmd_scoreboard(a: argparse.Namespace, common) -> int:
    formats = check_formats(a.formats.split(","))           # before the model loads
    texts = texts_of(a)
    board = scoreboard(common.load(a), texts, formats, embed=a.embed, max_tokens=a.max_tokens,
                       on_progress=job_progress("scoreboard"))
    if a.json:
        print(json.dumps(strict(board.as_dict())))
        return 0
    print(f"{board.reference}: {board.texts} texts, {board.tokens} tokens, {board.count} scored positions"
          + (f" (llama.cpp prints its statistics only from {FEW_TOKENS})" if board.count < FEW_TOKENS else ""))
    for r in board.formats:
        print(f"\n====== {r.format} ======")
        for name, value, unc, unit in r.llama_rows():
            print(f"{name:31s}: {_pm(value, unc, unit)}")
    return 0
