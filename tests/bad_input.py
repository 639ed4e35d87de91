"""What the bad-input tests share (tests/app/test_bad_input_*.py): "still works" (the
answer the tiny model gives: the good_answer fixture of tests/conftest.py), and the ways a model folder is broken."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from engine import RunSettings
from inspector.session.run import inspect_run
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
GOOD = "What is the capital of France?"


def _tensors(d: Path, edit) -> None:
    t = load_file(str(d / "model.safetensors"))
    edit(t)
    save_file(t, str(d / "model.safetensors"))


def _config(d: Path, **over) -> None:
    (d / "config.json").write_text(json.dumps(tiny_config(**over)))


def _truncate(d: Path, keep: float) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: int(len(data) * keep)])


def _set(name, value):
    def edit(t):
        t[name] = value if not callable(value) else value(t[name])
    return edit


def _nan(t):
    t = t.clone()
    t[1, 1] = float("nan")
    return t


def _ids(cases):
    return [c.values[0] if hasattr(c, "values") else c[0] for c in cases]


def broken_copy(tmp_path: Path, good: Path, name: str, breaker) -> Path:
    d = tmp_path / re.sub(r"\W+", "-", name).strip("-")
    shutil.copytree(good, d)
    breaker(d)
    return d


def _template(d: Path, template) -> None:
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


def still_works(model, good_answer) -> None:
    assert inspect_run(model, RunSettings(prompt=GOOD, max_new_tokens=3)).result.token_ids == good_answer
    assert model.live_hooks == 0
