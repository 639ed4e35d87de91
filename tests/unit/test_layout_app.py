"""The layout promises of README 'Layout' for the app's code (app.py, pages/, inspector/ui/): its own session state
is one typed object behind inspector/ui/state.py, and the frame work-around runs once per script run. (The
engine's and the views' layout: tests/unit/test_layout.py.)"""
from __future__ import annotations

import ast

import pytest

from tests.source_trees import parse_once, parsed  # noqa: F401  (parse_once: the trees, parsed once)
from tests.unit.test_layout import ROOT, named

pytestmark = pytest.mark.unit

STATE_ACCESSOR = "inspector/ui/state.py"


def _app_code() -> dict[str, str]:
    """app.py, the pages and the Streamlit glue (inspector/ui), by path."""
    files = [ROOT / "app.py", *sorted((ROOT / "pages").glob("*.py")), *sorted((ROOT / "inspector/ui").glob("*.py"))]
    return {str(p.relative_to(ROOT)): p.read_text() for p in files}


def _string_constants(tree: ast.AST) -> dict[str, str]:
    """A module's top-level string constants (`A = "a"`, `A, B = "a", "b"`, `C = A + "_c"`)."""
    out: dict[str, str] = {}

    def value(v: ast.AST):
        if isinstance(v, ast.Constant) and isinstance(v.value, str):
            return v.value
        if isinstance(v, ast.Name):
            return out.get(v.id)
        if isinstance(v, ast.BinOp) and isinstance(v.op, ast.Add):
            left, right = value(v.left), value(v.right)
            return left + right if isinstance(left, str) and isinstance(right, str) else None
        return None
    for n in tree.body:
        for t in n.targets if isinstance(n, ast.Assign) else []:
            pairs = zip(t.elts, n.value.elts) if isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple) \
                else [(t, n.value)]
            out |= {a.id: v for a, v in ((a, value(v)) for a, v in pairs) if isinstance(a, ast.Name) and v is not None}
    return out


def _session_state_aliases(tree: ast.AST) -> set[str]:
    """Names bound to st.session_state (`s = st.session_state`, `d, s = DEMOS[name], st.session_state`)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                pairs = zip(t.elts, n.value.elts) if isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple) \
                    else [(t, n.value)]
                out |= {a.id for a, v in pairs if isinstance(a, ast.Name) and _is_st_state(v, set())}
    return out


def _is_st_state(node: ast.AST, aliases: set[str]) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "session_state" and isinstance(node.value, ast.Name)
            and node.value.id == "st") or (isinstance(node, ast.Name) and node.id in aliases)


def _state_keys(tree: ast.AST, aliases: set[str]) -> list[tuple[int, ast.AST]]:
    """(line, key expression) of every st.session_state[k], .get/.pop/.setdefault(k) and `k in st.session_state`."""
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and _is_st_state(n.value, aliases):
            found.append((n.lineno, n.slice))
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.args
              and n.func.attr in ("get", "pop", "setdefault") and _is_st_state(n.func.value, aliases)):
            found.append((n.lineno, n.args[0]))
        elif isinstance(n, ast.Compare) and any(_is_st_state(c, aliases) for c in n.comparators):
            found.append((n.lineno, n.left))
    return found


def session_state_misuse(files: dict[str, str]) -> list[str]:
    """Where app code outside the accessor (inspector/ui/state.py) keeps its own state in st.session_state: a key
    written as a string (or a module's string constant) that no widget of the app uses as its key= (exact, or
    the fixed start of an f-string key). Keys computed at run time (a widget key helper's) are widget keys."""
    trees = {path: parsed(text) for path, text in files.items()}
    consts = {path: _string_constants(t) for path, t in trees.items()}
    shared = {k: v for c in consts.values() for k, v in c.items()}
    widgets, prefixes = set(), set()
    for path, tree in trees.items():
        for n in ast.walk(tree):
            for kw in (n.keywords if isinstance(n, ast.Call) else []):
                if kw.arg != "key":
                    continue
                v = kw.value
                if isinstance(v, ast.Constant) and isinstance(v.value, str):
                    widgets.add(v.value)
                elif isinstance(v, ast.Name) and v.id in consts[path] | shared:
                    widgets.add((shared | consts[path])[v.id])
                elif isinstance(v, ast.JoinedStr) and v.values and isinstance(v.values[0], ast.Constant):
                    prefixes.add(v.values[0].value)
    bad = []
    for path, tree in trees.items():
        if path == STATE_ACCESSOR:
            continue
        for line, k in _state_keys(tree, _session_state_aliases(tree)):
            key = k.value if isinstance(k, ast.Constant) else (shared | consts[path]).get(k.id) \
                if isinstance(k, ast.Name) else None
            if isinstance(key, str) and key not in widgets and not key.startswith(tuple(prefixes) or ("\0",)):
                bad.append(f"{path}:{line} {key!r}")
    return bad


def test_the_apps_own_session_state_is_one_typed_object():
    """Runs, memos, the debugger, the room seat and the app's flags live in one SessionState, reached through
    inspector.ui.state.session(); st.session_state holds it under one key, and otherwise only widget values."""
    assert session_state_misuse(_app_code()) == []
    old = ('import streamlit as st\nRUN_KEY = "run"\nst.text_input("Prompt", key="sb_prompt")\n'
           'st.session_state["sb_prompt"] = "ok"\nst.session_state[RUN_KEY] = None\ns = st.session_state\n'
           'memo = s.setdefault("att_maps", {})\nif "_frame_rerun" not in s:\n    pass\n')
    assert session_state_misuse({"pages/old.py": old}) == [
        "pages/old.py:5 'run'", "pages/old.py:7 'att_maps'", "pages/old.py:8 '_frame_rerun'"]
    accessor = (ROOT / STATE_ACCESSOR).read_text()
    assert accessor.count("state[KEY] = SessionState()") == 1


def test_the_frame_work_around_runs_once_per_script_run():
    """Each page calls ensure_frame() once, at its top level; nothing else does (not current_run, which pages
    call many times)."""
    for path, text in _app_code().items():
        tree = parsed(text)
        top = [n for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
               and named(n.value.func) == "ensure_frame"]
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and named(n.func) == "ensure_frame"]
        if path.startswith("pages/"):
            assert len(top) == len(calls) == 1, f"{path}: ensure_frame() at top level {len(top)}, in all {len(calls)}"
        else:
            assert not calls, f"{path} calls ensure_frame(): pages do, once each"
