"""The command line's progress on stderr: one line updated in place on a terminal; on a pipe or a file, whole lines
(a `\\r` update is no update there: a why-loop piped to a file used to leave one 20 KB line of them), one when the
step named changes or the percentage has moved by STEP_PERCENT, and the last one always."""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

STEP_PERCENT = 10.0
QUIET_S = 2.0


class StatusLine:
    """show(fraction, what) prints the progress of one job; prefix: what the job is ("why-loop "), width: the
    message's width on a terminal."""

    def __init__(self, prefix: str = "", width: int = 70, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.prefix, self.width, self.stream, self.clock = prefix, width, stream, clock
        self._said: tuple[float, str, float] | None = None         # (percent, message, when) of the last line

    def show(self, fraction: float, what: str) -> None:
        out = self.stream or sys.stderr
        pct = fraction * 100
        if out.isatty():
            print(f"\r[{self.prefix}{pct:5.1f}%] {what[:self.width]:{self.width}s}", end="" if fraction < 1 else "\n",
                  file=out, flush=True)
            return
        last, now = self._said, self.clock()
        if fraction < 1 and last is not None and pct - last[0] < STEP_PERCENT \
                and (what == last[1] or now - last[2] < QUIET_S):
            return
        self._said = (pct, what, now)
        print(f"[{self.prefix}{pct:5.1f}%] {what}", file=out, flush=True)


def progress_printer(prefix: str = "", width: int = 70) -> Callable[[float, str], None]:
    return StatusLine(prefix, width).show
