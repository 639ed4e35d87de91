"""The command line's progress piped to a file (issue 33, item 9): whole lines, a handful per job, never one long
line of carriage-return updates; on a terminal, one line updated in place."""
from __future__ import annotations

import io

import pytest

from engine.cli.progress_line import StatusLine

pytestmark = pytest.mark.unit


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def feed(line: StatusLine, clock: Clock | None = None, seconds_per_update: float = 0.0) -> None:
    for i in range(1, 401):                   # a why-loop-like job: 40 reruns, 10 updates each
        if clock is not None:
            clock.t += seconds_per_update
        line.show(i / 400, f"rerun {(i - 1) // 10 + 1}: zero L8h1")


def test_piped_progress_is_whole_lines_every_ten_percent_and_the_last():
    out = io.StringIO()
    feed(StatusLine("why-loop ", stream=out, clock=Clock()))          # instant reruns: by the percentage
    text = out.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and text.endswith("\n")
    assert len(lines) == 11 and lines[0] == "[why-loop   0.2%] rerun 1: zero L8h1"
    assert lines[-1] == "[why-loop 100.0%] rerun 40: zero L8h1" and max(len(x) for x in lines) < 80


def test_piped_progress_names_each_slow_step():
    out, clock = io.StringIO(), Clock()
    feed(StatusLine("why-loop ", stream=out, clock=clock), clock, seconds_per_update=0.3)   # 3 s a rerun
    lines = out.getvalue().splitlines()
    assert [f"rerun {k}:" in " ".join(lines) for k in range(1, 41)] == [True] * 40 and len(lines) == 41


def test_a_terminal_gets_one_line_updated_in_place():
    out = Tty()
    feed(StatusLine(stream=out))
    text = out.getvalue()
    assert text.count("\r") == 400 and text.count("\n") == 1 and text.endswith("\n")
