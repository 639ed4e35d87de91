"""Which tier folders (tests/<tier>/) a marker expression (`pytest -m ...`) cannot select from, so that the run need
not import them: `-m unit` then imports tests/unit/ alone instead of every test module of the suite (each import
costs its module's assertion rewrite; on a 2-core machine the whole suite's took 15-20 s of the unit tier's time).

A test's tier is its folder's unless the test names another tier's marker (tests/conftest.py), so a folder's tests
can carry only its own tier or a tier whose marker its files name (`mark.model` in tests/app/...). A folder is
left out only if no combination of those tiers satisfies the expression; an expression that names anything but
tiers, `and`, `or`, `not` and parentheses leaves every folder in."""
from __future__ import annotations

import itertools
import re
from pathlib import Path

TOKEN = re.compile(r"\s*(\(|\)|[^\s()]+)")


def _tokens(expr: str) -> list[str] | None:
    out, pos = [], 0
    expr = expr.rstrip()
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if not m:
            return None
        out.append(m.group(1))
        pos = m.end()
    return out


def selects(expr: str, tiers: frozenset[str], known: tuple[str, ...]) -> bool | None:
    """Whether a test marked with exactly `tiers` satisfies `expr`; None if `expr` names more than tiers."""
    toks = _tokens(expr)
    if not toks or any(t not in known and t not in ("and", "or", "not", "(", ")") for t in toks):
        return None
    py = " ".join(t if t in ("and", "or", "not", "(", ")") else str(t in tiers) for t in toks)
    try:
        return bool(eval(py, {"__builtins__": {}}, {}))     # only True/False, and/or/not and parentheses
    except SyntaxError:
        return None


def possible_tiers(folder: Path, known: tuple[str, ...]) -> set[str]:
    """The folder's own tier and every tier whose marker one of its files names."""
    found = {folder.name}
    for f in folder.rglob("*.py"):
        text = f.read_text(encoding="utf-8", errors="replace")
        found.update(t for t in known if re.search(rf"\bmark\.{t}\b", text))
    return found


def unselectable(folder: Path, expr: str, known: tuple[str, ...]) -> bool:
    """True if no test in `folder` (a tier's folder) can be selected by `expr`."""
    tiers = sorted(possible_tiers(folder, known))
    for n in range(1, len(tiers) + 1):
        for combo in itertools.combinations(tiers, n):
            verdict = selects(expr, frozenset(combo), known)
            if verdict is None or verdict:
                return False
    return True
