"""Command line: python -m engine <command> (see README 'Command line'). One module per group of commands,
each with add_commands(sub); the shared argument builders live in args.py."""
from __future__ import annotations

import argparse
import sys

from engine.cli import (args, atlas, bench, debug, explain, lens, prescribe, qk, report, run, scoreboard, show, steer,
                        stored)
from engine.errors import EngineError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description="LLM Inspector engine")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for group in (run, bench, debug, show, report):
        group.add_commands(sub)
    prescribe.add_commands(sub, args)
    explain.add_commands(sub, args)
    steer.add_commands(sub, args)
    qk.add_commands(sub, args)
    atlas.add_commands(sub, args)
    lens.add_commands(sub, args)
    scoreboard.add_commands(sub, args)
    stored.add_commands(sub, args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:       # an unwritable --csv / --out, a full disk: the file and the reason, no traceback
        print(f"error: {e.filename or ''}: {e.strerror or e}".replace(": : ", ": "), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
