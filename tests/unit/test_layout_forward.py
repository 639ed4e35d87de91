"""The layout promises of the forward (issue 45): the model has one forward over batch descriptions
(engine.forward_batch.Batch), which a lone run's forward, the batched decode and the packed prefill all go
through, and the attention arithmetic (scores, their scale, their softmax) has one home, engine.attention_math,
which the model's attention, the batch's padded rows, the blocked statistics and the Attention view compute with.
(The engine's other layout rules: tests/unit/test_layout.py.)"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.source_trees import parse_once, parsed, walked  # noqa: F401  (parse_once: the trees, parsed once)
from tests.unit.test_layout import ROOT, named

pytestmark = pytest.mark.unit

ATTENTION_HOME = "engine/attention_math.py"
# modules on attention's path: any softmax there is one of attention's (elsewhere a softmax of logits is the sampler's,
# a lens's or a router's business)
ATTENTION_PATH = re.compile(r"^engine/(attention[^/]*|batch/[^/]+|inspection/attention_[^/]+)\.py$|"
                            r"^inspector/views/attention\.py$")


def _product_sources() -> dict[str, str]:
    """Path -> text of every .py file of the engine, the inspector and the pages."""
    return {str(p.relative_to(ROOT)): p.read_text() for d in ("engine", "inspector", "pages")
            for p in sorted((ROOT / d).rglob("*.py"))}


def _softmax(node: ast.AST) -> bool:
    """A softmax call: torch.softmax, F.softmax, x.softmax, torch.ops.aten._softmax(.out)."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return named(f) in ("softmax", "_softmax") or (named(f) == "out" and named(getattr(f, "value", None)) == "_softmax")


def _score_scale(node: ast.AST) -> bool:
    """A product with attention's score scale: a family's attn_scale, or a head size's ** -0.5."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
        return False
    return any(named(s) == "attn_scale" or (isinstance(s, ast.BinOp) and isinstance(s.op, ast.Pow)
                                             and ast.unparse(s.right).replace(" ", "") in ("-0.5", "(-0.5)"))
               for s in (node.left, node.right))


def attention_arithmetic(path: str, text: str) -> list[str]:
    """Where a module computes attention's arithmetic itself rather than through engine.attention_math: a softmax of
    scores (a softmax whose argument names scores, or any softmax on attention's path) or a product with the score
    scale."""
    found = []
    for node in walked(text):
        if _softmax(node) and (ATTENTION_PATH.match(path) or "score" in ast.unparse(node.args[0] if node.args else
                                                                                   node).lower()):
            found.append(f"{path}:{node.lineno} softmax {ast.unparse(node)}")
        if _score_scale(node):
            found.append(f"{path}:{node.lineno} scale {ast.unparse(node)}")
    return found


def test_the_attention_arithmetic_has_one_home():
    found = [hit for path, text in _product_sources().items() if path != ATTENTION_HOME
             for hit in attention_arithmetic(path, text)]
    assert found == [], found
    # the check finds what it is for: the batch's own padded product, the view's softmax, the blocked statistics'
    # scale and in-place softmax; a softmax of logits elsewhere is no attention's
    old_rows = ("s = (q @ keys.transpose(-1, -2)).view(B, H, S) * self.cfg.attn_scale\n"
                "p = torch.softmax(scores.float(), dim=-1).to(qh.dtype)\n")
    assert [h.split(" ", 1)[1] for h in attention_arithmetic("engine/batch/rows.py", old_rows)] == [
        "scale (q @ keys.transpose(-1, -2)).view(B, H, S) * self.cfg.attn_scale",
        "softmax torch.softmax(scores.float(), dim=-1)"]
    assert len(attention_arithmetic("inspector/views/attention.py", "pattern = torch.softmax(s, dim=-1)\n")) == 1
    assert len(attention_arithmetic("engine/inspection/attention_partials.py",
                                    "q = qh.float() * hd ** -0.5\np = torch.ops.aten._softmax.out(X, -1, False, out=X)\n"
                                    )) == 2
    assert attention_arithmetic("engine/sampling.py", "probs = torch.softmax(logits, dim=-1)\n") == []


def _model_class() -> ast.ClassDef:
    tree = parsed((ROOT / "engine/model.py").read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model")


def _calls(fn: ast.FunctionDef) -> set[str]:
    """self.<method> names a method calls."""
    return {c.func.attr for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
            and isinstance(c.func.value, ast.Name) and c.func.value.id == "self"}


def test_the_model_has_one_forward_over_batches_and_every_forward_goes_through_it():
    """Model's forward entries are forward (a lone run's convenience) and forward_batch (any Batch); only
    forward_batch runs the PyTorch forward or the native steps, and forward calls it; the batch layer's old entries
    (forward_rows, forward_segments) are named nowhere."""
    methods = {f.name: f for f in _model_class().body if isinstance(f, ast.FunctionDef)}
    assert sorted(m for m in methods if m.startswith("forward")) == ["forward", "forward_batch"]
    assert "forward_batch" in _calls(methods["forward"])
    runners = sorted(m for m, f in methods.items() if "_forward" in _calls(f) or "_on_native_step" in _calls(f))
    assert runners == ["forward_batch"], runners
    texts = {str(p.relative_to(ROOT)): p.read_text() for d in ("engine", "inspector", "pages", "tests", "docs")
             for p in sorted((ROOT / d).rglob("*")) if p.suffix in (".py", ".md", ".c", ".h")
             and p != Path(__file__)}
    old = [path for path, text in texts.items() if re.search(r"\bforward_(rows|segments)\b", text)]
    assert old == [], old
