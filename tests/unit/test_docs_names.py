"""What the docs tell a reader to import exists: every `import` / `from ... import` line in the code of README.md and
docs/*.md (fenced blocks and indented blocks), and every dotted `engine.…` / `inspector.…` name the docs write in
backticks, resolves to a module or a name in it. A doc that names a module the code left, or a function it never
had, fails here."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FROM = re.compile(r"^\s*from\s+((?:engine|inspector)[\w.]*)\s+import\s+\(?([\w\s,]+)")
IMPORT = re.compile(r"^\s*import\s+((?:engine|inspector)[\w.]*)")
DOTTED = re.compile(r"(?<![\w./-])((?:engine|inspector)(?:\.[A-Za-z_]\w*)+)")


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the code in a Markdown text: fenced blocks and lines indented by four spaces."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            out.append((i, line))
    return out


def resolves(dotted: str) -> bool:
    """A module, or a chain of attributes from the longest importable module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                try:       # a submodule not imported by its package yet
                    obj = importlib.import_module(f"{obj.__name__}.{name}")
                    continue
                except (ModuleNotFoundError, AttributeError):
                    return False
            obj = getattr(obj, name)
        return True
    return False


def doc_names() -> list[tuple[str, str]]:
    """(where, dotted name) for every name the docs import or write in backticks."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for i, line in code_lines(text):
            where = f"{doc.name}:{i}"
            if m := FROM.match(line):
                names = [n.strip() for n in m.group(2).split(",") if n.strip()]
                found += [(where, f"{m.group(1)}.{n.split()[0]}") for n in names]
            elif m := IMPORT.match(line):
                found.append((where, m.group(1)))
        for i, line in enumerate(text.splitlines(), 1):
            for span in re.findall(r"`([^`]+)`", line):
                found += [(f"{doc.name}:{i}", d) for d in DOTTED.findall(span)]
    return found


def test_every_name_the_docs_import_or_name_exists():
    names = doc_names()
    assert len(names) > 50                         # the docs do name the API (a broken scan would find nothing)
    missing = [f"{where}: {name}" for where, name in names if not resolves(name)]
    assert missing == []


def test_the_scan_catches_a_module_that_was_left_and_a_name_that_never_was():
    assert resolves("engine.variants.cast_model") and resolves("engine.inspection.stages.forward_stages")
    assert not resolves("engine.doctor.cast_model") and not resolves("engine.generate.run_model")
    assert FROM.match("from engine.tools.doctor import Injection, run_doctor").group(2).split(",")[1].strip() \
        == "run_doctor"
