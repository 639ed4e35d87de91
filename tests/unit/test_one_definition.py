"""Lists the code would otherwise restate by hand have one definition each: the stage names and the lists made of
them live in engine/inspection/stages.py (LAYER_STAGES, PLAIN_STAGES, ATTENTION_MAPS, HEAD_STAGES, GLOBAL_STAGES,
layer_stages, global_stages, hook_names, forward_stages); no two product classes share a name; and what cannot be
one definition (a room's page names, which a room document carries, beside app.py's pages) is tied by a test."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from engine.inspection.stages import GLOBAL_STAGES, LAYER_STAGES, SAMPLER_STAGES, forward_stages, hook_names
from inspector.session.rooms_state import ROOM_PAGES
from tests.source_trees import parse_once, parsed  # noqa: F401  (parse_once: the module's trees, parsed once)

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
STAGES_HOME = "engine/inspection/stages.py"
STAGE_WORDS = set(LAYER_STAGES) | set(GLOBAL_STAGES) | set(SAMPLER_STAGES) | {"sampler."}


def _product() -> dict[str, ast.AST]:
    files = [ROOT / "app.py", *(p for d in ("engine", "inspector", "pages") for p in sorted((ROOT / d).rglob("*.py")))]
    return {str(p.relative_to(ROOT)): parsed(p.read_text()) for p in files}


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _named_lists() -> dict[frozenset, str]:
    """stages.py's named lists of stage names, by their members."""
    import engine.inspection.stages as stages
    return {frozenset(v): k for k, v in vars(stages).items() if k.isupper() and isinstance(v, tuple) and len(v) > 1}


def stage_lists(trees: dict[str, ast.AST]) -> list[str]:
    """Where a module outside stages.py restates one of its lists (a tuple, list or set literal holding the same
    names, or holding both attention maps), or filters hook_names() by stage names (a comprehension over it whose
    condition names stages) instead of calling forward_stages."""
    named, found = _named_lists(), []
    for path, tree in trees.items():
        if path == STAGES_HOME:
            continue
        for n in ast.walk(tree):
            if isinstance(n, (ast.Tuple, ast.List, ast.Set)):
                names = frozenset(e.value for e in n.elts if isinstance(e, ast.Constant) and isinstance(e.value, str))
                if names in named or {"attn.scores", "attn.pattern"} <= names:
                    found.append(f"{path}:{n.lineno} restates stages.{named.get(names, 'ATTENTION_MAPS')}")
            if isinstance(n, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
                over_hooks = any(isinstance(g.iter, ast.Call) and getattr(g.iter.func, "attr",
                                 getattr(g.iter.func, "id", "")) == "hook_names" for g in n.generators)
                conds = [s for g in n.generators for c in g.ifs for s in _strings(c)]
                if over_hooks and any(s in STAGE_WORDS for s in conds):
                    found.append(f"{path}:{n.lineno} filters hook_names() by hand ({conds})")
    return found


def test_stage_lists_and_stage_filters_are_written_once_in_stages_py():
    assert stage_lists(_product()) == []


def test_the_check_finds_a_hand_written_filter_and_a_restated_pair():
    old = ast.parse('SKIP = ("attn.scores", "attn.pattern")\n'
                    'names = [n for n in model.hook_names() if n not in ("tokenizer", "detokenizer")\n'
                    '         and not n.startswith("sampler.")]\n')
    found = stage_lists({"engine/tools/old.py": old})
    assert [f.split(" ")[0] for f in found] == ["engine/tools/old.py:1", "engine/tools/old.py:2"], found


def test_forward_stages_is_every_forward_stage_in_order():
    """Independent of forward_stages' own filter: the hook names between `tokenizer` and the sampler."""
    names = hook_names(2)
    assert forward_stages(2) == names[1:names.index("sampler.penalties")]
    assert forward_stages(2, maps=False) == [n for n in names[1:names.index("sampler.penalties")]
                                             if not re.search(r"attn\.(scores|pattern)$", n)]


def test_no_two_product_classes_share_a_name():
    where: dict[str, list[str]] = {}
    for path, tree in _product().items():
        for n in tree.body:
            if isinstance(n, ast.ClassDef):
                where.setdefault(n.name, []).append(path)
    assert {k: v for k, v in where.items() if len(v) > 1} == {}


def test_a_rooms_pages_are_the_pages_app_py_navigates_to_in_its_order():
    """A room document names the teacher's page (validated against ROOM_PAGES); a page app.py adds must be
    followable, a page it drops must not be accepted."""
    navigated = re.findall(r'st\.Page\("pages/([^"]+)\.py"', (ROOT / "app.py").read_text())
    assert tuple(navigated) == ROOM_PAGES
