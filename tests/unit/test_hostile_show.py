"""`python -m engine show` and `report --from-trace` (in-process, through the CLI's main) on crafted traces:
each refused with exactly one `error: …` line and exit status 2; a JSON bomb refused about as fast as a genuine
trace opens (timings compared on this machine, never an absolute time); the model and dtype a report loads come
from the command line, never from the file. (In separate processes: tests/model/test_hostile_cli.py.)"""
from __future__ import annotations

import dataclasses
import time

import pytest

import engine.cli.report as report_cli
from engine import InputError, RunSettings, SamplingParams, make_trace
from engine.cli import main
from engine.inspection.trace import to_bytes
from inspector.session.run import inspect_run
from tests.unit.test_hostile_traces import CASES, setitem, with_meta

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def good(tiny_model) -> bytes:
    run = inspect_run(tiny_model, RunSettings(prompt="Hi there", chat=False, max_new_tokens=4,
                                              params=SamplingParams(temperature=0.8), seed=2))
    return to_bytes(run)


@pytest.mark.parametrize("name", list(CASES))
def test_show_refuses_each_crafted_trace_with_one_error_line(good, tmp_path, capsys, name):
    craft, words = CASES[name]
    path = tmp_path / "crafted.trace"
    path.write_bytes(craft(good))
    code = main(["show", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (name, out)
    assert err.startswith("error: ") and err.count("\n") == 1 and err.endswith("\n"), (name, err[:500])
    assert words in err, (name, err[:500])


def _best(argv: list[str], capsys, rounds: int = 3) -> tuple[float, int]:
    """The best of a few in-process runs of the CLI (seconds) and its exit status."""
    best, code = float("inf"), None
    for _ in range(rounds):
        t0 = time.perf_counter()
        code = main(argv)
        best = min(best, time.perf_counter() - t0)
        capsys.readouterr()
    return best, code


@pytest.mark.alone          # compares two timings: by itself (tests/alone.py)
def test_a_bomb_is_refused_about_as_fast_as_a_genuine_trace_opens(good, tiny_model, tmp_path, capsys):
    genuine = tmp_path / "genuine.trace"
    genuine.write_bytes(good)
    t_small, code = _best(["show", str(genuine)], capsys)
    assert code == 0
    # A genuine trace of 48 steps (a ~10 MB file): what a bomb of similar size is compared with.
    bigger = to_bytes(inspect_run(tiny_model, RunSettings(prompt="Hi there", chat=False, max_new_tokens=48,
                                                          ignore_eos=True, params=SamplingParams(temperature=0.8))))
    (tmp_path / "bigger.trace").write_bytes(bigger)
    t_bigger, code = _best(["show", str(tmp_path / "bigger.trace")], capsys)
    assert code == 0
    for name, compared_with in (("a 60 MB JSON bomb", t_small), ("a 15 MB bomb of empty lists", t_bigger),
                                ("a 15 MB bomb of empty objects", t_bigger), ("a 12 MB bomb of numbers", t_bigger)):
        bomb = tmp_path / "bomb.trace"
        bomb.write_bytes(CASES[name][0](good))
        t_bomb, code = _best(["show", str(bomb)], capsys)
        assert code == 2
        assert t_bomb < 3 * compared_with, (name, t_bomb, compared_with)


def test_report_from_an_int_prompt_trace_is_one_error_line(good, tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "int.trace"
    path.write_bytes(with_meta(good, setitem("settings.prompt", 12345)))
    code = main(["report", "--from-trace", str(path), "--model", str(tiny_model_dir), "--out",
                 str(tmp_path / "r.html")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err[-500:]
    assert "the prompt must be text" in err and not (tmp_path / "r.html").exists()


@pytest.fixture()
def chosen(monkeypatch):
    """What the report would load: records --model/--dtype/--device and stops before loading anything."""
    seen = []

    def load(a):
        seen.append((a.model, a.dtype, a.device))
        raise InputError("stopped before loading (test)")
    monkeypatch.setattr(report_cli, "load", load)
    return seen


def test_report_from_trace_takes_the_model_and_dtype_from_the_command_line_only(tiny_model, tmp_path, capsys,
                                                                                 chosen):
    run = inspect_run(tiny_model, RunSettings(prompt="Hi there", chat=False, max_new_tokens=2))
    planted = make_trace(run.settings, run.result, None, tiny_model.name, 0.1,
                         extra={"model_source": "/srv/shared/planted-model", "dtype": "bfloat16", "device": "cuda"})
    path = tmp_path / "planted.trace"
    path.write_bytes(to_bytes(planted))
    out = str(tmp_path / "r.html")
    assert main(["report", "--from-trace", str(path), "--out", out]) == 2
    assert main(["report", "--from-trace", str(path), "--model", "my-model", "--dtype", "float32", "--out", out]) == 2
    assert chosen == [(None, None, None), ("my-model", "float32", None)]
    assert "stopped before loading" in capsys.readouterr().err


def test_report_from_trace_of_another_model_names_it_on_one_line(tiny_model, tiny_model_dir, tmp_path, capsys):
    run = inspect_run(tiny_model, RunSettings(prompt="Hi there", chat=False, max_new_tokens=2))
    other = dataclasses.replace(run, model_name="evil\nsecond line")
    path = tmp_path / "other.trace"
    path.write_bytes(to_bytes(other))
    code = main(["report", "--from-trace", str(path), "--model", str(tiny_model_dir), "--out",
                 str(tmp_path / "r.html")])
    last = capsys.readouterr().err.strip().splitlines()[-1]       # after the model's loading progress
    assert code == 2 and last.startswith("error: ") and "made with 'evil\\nsecond line'" in last, last
