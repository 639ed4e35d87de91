"""python -m engine bench --tools --json: one JSON object with each tool's time over one plain generation of the
same prompt and length (why_loop, rescue, patch_grid, head_scan, attribution, quant, scoreboard, tuned_lens `_over_plain`; the
scoreboard's plain is its formats' plain runs: one plain generation per format), each the
median of the rounds' own ratios, a round's ratio being the tool's time over the mean of the plain generations
just before and just after it (interleaved), with the target it is held to."""
from __future__ import annotations

import json
import statistics

import pytest

import engine.bench.tools as bt
from engine.cli import main

pytestmark = [pytest.mark.unit, pytest.mark.alone]      # its speed ratios: by itself (tests/alone.py)
KEYS = ("why_loop", "rescue", "patch_grid", "head_scan", "attribution", "quant", "scoreboard")


def test_bench_tools_json_has_every_tools_ratio_and_target(tiny_model_dir, capsys):
    assert main(["bench", "--tools", "--json", "--repeats", "1", "--model", str(tiny_model_dir), "--device", "cpu",
                 "--tools-prompt", "one two three four five six"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for k in KEYS:
        assert out[f"{k}_over_plain"] > 0 and out[f"{k}_target"] == (10 if k in ("why_loop", "rescue") else 5)
        assert out[f"{k}_meets"] == (out[f"{k}_over_plain"] <= out[f"{k}_target"])
    assert out["why_loop_plain_tokens"] == 64 and out["rescue_plain_tokens"] == 8 and out["quant_plain_tokens"] == 32
    assert out["scoreboard_plain_tokens"] == 32 and out["scoreboard_plain_runs"] == 2 and out["quant_plain_runs"] == 1
    assert out["tuned_lens_over_plain"] > 0 and out["tuned_lens_target"] == 2 and out["tuned_lens_plain_tokens"] == 32


def test_a_ratio_is_the_median_of_the_rounds_tool_over_its_neighbouring_plains(tiny_model, monkeypatch):
    clock = iter(range(1000))
    tools = iter([4.0, 10.0, 3.0])
    monkeypatch.setattr(bt, "plain_seconds", lambda *a: next(plains))
    monkeypatch.setattr(bt.time, "perf_counter", lambda: next(clock))      # each tool call "takes" 1 s ...
    jobs = {"quant": (32, lambda: [next(clock) for _ in range(int(next(tools)) - 1)])}   # ... plus what it ticks
    monkeypatch.setattr(bt, "tool_jobs", lambda *a, **k: jobs)
    plains = iter([9.0, 1.0, 3.0, 2.0, 2.0, 4.0, 8.0])                        # the warm-up, then plain, tool, plain
    out = bt.run_tools_bench(tiny_model, rounds=3, tools=("quant",), quiet=True)
    assert out["quant_over_plain"] == statistics.median([4 / 2, 10 / 2, 3 / 6]) == 2.0
    assert out["quant_seconds"] == 4.0 and out["quant_plain_seconds"] == 2.0 and out["quant_meets"]


def test_the_scoreboard_is_held_against_one_plain_run_per_format(tiny_model, monkeypatch):
    clock = iter(range(1000))
    monkeypatch.setattr(bt, "plain_seconds", lambda *a: next(plains))
    monkeypatch.setattr(bt.time, "perf_counter", lambda: next(clock))      # the tool call "takes" 1 s + 5 ticks
    monkeypatch.setattr(bt, "tool_jobs", lambda *a, **k: {"scoreboard": (32, lambda: [next(clock) for _ in range(5)])})
    plains = iter([9.0, 1.0, 2.0])                                           # the warm-up, then plain, tool, plain
    out = bt.run_tools_bench(tiny_model, rounds=1, tools=("scoreboard",), quiet=True)
    assert out["scoreboard_plain_runs"] == len(bt.DEFAULT_FORMATS) == 2
    assert out["scoreboard_plain_seconds"] == 2 * 1.5 and out["scoreboard_over_plain"] == 6 / 3
