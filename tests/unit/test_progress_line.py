"""The command line's progress piped to a file (issue 33, item 9): whole lines, a handful per job, never one long
line of carriage-return updates; on a terminal, one line updated in place."""
from __future__ import annotations

import io

import pytest

from engine.cli.progress_line import ProgressLine

pytestmark = pytest.mark.unit


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def feed(line: ProgressLine) -> None:
    for i in range(1, 401):                   # a why-loop-like job: 40 reruns, 10 updates each
        line.show(i / 400, f"rerun {(i - 1) // 10 + 1}: zero L8h1")


def test_piped_progress_is_whole_lines_one_per_step_and_the_last():
    out = io.StringIO()
    feed(ProgressLine("why-loop ", stream=out))
    text = out.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and text.endswith("\n")
    assert len(lines) == 40 + 1 and lines[-1] == "[why-loop 100.0%] rerun 40: zero L8h1"   # each rerun, then done
    assert max(len(x) for x in lines) < 80


def test_a_terminal_gets_one_line_updated_in_place():
    out = Tty()
    feed(ProgressLine(stream=out))
    text = out.getvalue()
    assert text.count("\r") == 400 and text.count("\n") == 1 and text.endswith("\n")
