"""The command line's progress on stderr: one line updated in place on a terminal; on a pipe or a file, whole lines
(a `\\r` update is no update there: a why-loop piped to a file used to leave one 20 KB line of them), one when the
step named changes or the percentage has moved by STEP_PERCENT, and the last one always."""
from __future__ import annotations

import sys
from typing import Callable, TextIO

STEP_PERCENT = 10.0


class ProgressLine:
    """show(fraction, what) prints the progress of one job; prefix: what the job is ("why-loop "), width: the
    message's width on a terminal."""

    def __init__(self, prefix: str = "", width: int = 70, stream: TextIO | None = None) -> None:
        self.prefix, self.width, self.stream = prefix, width, stream
        self._said: tuple[float, str] | None = None

    def show(self, fraction: float, what: str) -> None:
        out = self.stream or sys.stderr
        pct = fraction * 100
        if out.isatty():
            print(f"\r[{self.prefix}{pct:5.1f}%] {what[:self.width]:{self.width}s}", end="" if fraction < 1 else "\n",
                  file=out, flush=True)
            return
        last = self._said
        if fraction < 1 and last is not None and what == last[1] and pct - last[0] < STEP_PERCENT:
            return
        self._said = (pct, what)
        print(f"[{self.prefix}{pct:5.1f}%] {what}", file=out, flush=True)


def progress_printer(prefix: str = "", width: int = 70) -> Callable[[float, str], None]:
    return ProgressLine(prefix, width).show
