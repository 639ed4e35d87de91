"""python -m engine: generate, hooks, stats, bench, and error exit codes."""
from __future__ import annotations

import csv
import subprocess

import pytest

from tests.helpers import engine_cli


def cli(*args: str) -> subprocess.CompletedProcess:
    """The command through its entry point in this process (the real `python -m engine` process is run by
    tests/app/test_bad_input_models.py, tests/model/test_hostile_cli.py and tests/browser/test_report_offline.py)."""
    return engine_cli(*args)


@pytest.mark.model
def test_generate_streams_and_reports_speed(bundled_model):
    r = cli("generate", "What is the capital of France?", "--chat", "--max-new-tokens", "24")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr and "stop: eos" in r.stderr


@pytest.mark.model                  # the command loads the model itself: slower than the unit loop
def test_hooks_lists_every_stage(tiny_model_dir, tiny_model):
    r = cli("hooks", "--model", str(tiny_model_dir))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == tiny_model.hook_names()


@pytest.mark.model                  # the command loads the model itself: slower than the unit loop
def test_stats_csv(tiny_model_dir, tiny_model, tmp_path):
    out = tmp_path / "s.csv"
    r = cli("stats", "hello world", "--model", str(tiny_model_dir), "--csv", str(out))
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(out.open()))
    layer_rows = [row for row in rows if row["layer"] != ""]
    assert len(layer_rows) == 17 * tiny_model.config.num_layers
    emb = next(row for row in rows if row["stage"] == "embed")
    ids = tiny_model.tokenizer.encode("hello world")
    want = tiny_model.weights.embed[ids]
    assert abs(float(emb["max"]) - float(want.max())) < 1e-5 and abs(float(emb["min"]) - float(want.min())) < 1e-5
    assert "blocks.1.resid_post" in r.stdout


@pytest.mark.model                  # the command loads the model itself: slower than the unit loop
def test_errors_exit_2_with_message(tiny_model_dir):
    r = cli("generate", "   ", "--model", str(tiny_model_dir))
    assert r.returncode == 2 and "error: the prompt is empty" in r.stderr
    r = cli("generate", "hi", "--model", str(tiny_model_dir), "--top-p", "0")
    assert r.returncode == 2 and "top_p must be in (0, 1]" in r.stderr
    r = cli("generate", "hi", "--model", "/nonexistent/model")
    assert r.returncode == 2 and "model not found" in r.stderr


@pytest.mark.reference
def test_bench_prints_ratios(tiny_model_dir):
    r = cli("bench", "--model", str(tiny_model_dir), "--prompt-tokens", "16", "--new-tokens", "4", "--repeats", "1")
    assert r.returncode == 0, r.stderr
    assert "ratio b/a" in r.stdout and "ratio a/c" in r.stdout
    assert "c: transformers generate" in r.stdout
