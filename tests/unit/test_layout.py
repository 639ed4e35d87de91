"""The layout promises of README 'Layout': a stage's hook name is written where the stage is computed, the
engine imports nothing from the app, no import circles, views keep no state and run the model only where README
says, files and functions stay small, tools run the model through its public forward, and every long job reports
through one progress protocol."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from engine.inspection.stages import LAYER_STAGES, hook_names
from tests.source_trees import parse_once, parsed, walked  # noqa: F401  (parse_once: the trees, parsed once)

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "inspector", "pages")


def _sources(*dirs: str) -> dict[str, Path]:
    """Module name -> file, for every .py file under the given top-level folders."""
    out = {}
    for d in dirs:
        for p in sorted((ROOT / d).rglob("*.py")):
            mod = ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            out[mod] = p
    return out


def _imports(mod: str, path: Path, known: set[str]) -> set[str]:
    """Modules of this repository that `mod` imports (a package's __init__ counts as the package)."""
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = set()
    for node in walked(path.read_text()):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != mod:
                found.add(name)
    return found


def test_every_hook_name_is_written_where_its_stage_is_computed():
    text = "\n".join(p.read_text() for p in (ROOT / "engine").rglob("*.py"))
    stages = {re.sub(r"^blocks\.\d+\.", "", n) for n in hook_names(2)} | set(LAYER_STAGES) | {"logits_uncapped"}
    missing = [s for s in sorted(stages) if not re.search(r'\(\s*"' + re.escape(s) + r'"\s*,', text)]
    assert not missing, f"no line in engine/ offers these stages by name: {missing}"


def test_the_engine_imports_nothing_from_the_app_and_there_are_no_import_circles():
    mods = _sources(*PACKAGES)
    graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    upward = [(m, d) for m, deps in graph.items() if m.startswith("engine") for d in deps
              if not d.startswith("engine")]
    assert not upward, upward
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in graph[m]:
            assert state.get(d) != 1, "import circle: " + " -> ".join(stack[stack.index(d):] + [d]) \
                if d in stack else d
            if d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


# The run's layers, bottom to top: what the forward needs (the inspection layer, engine.progress, engine.results ...),
# the model, the generation loop, the batch layer. An import points down this list, never up it.
RUN_LAYERS = ("engine.model", "engine.generate", "engine.batch")


def _run_layer(mod: str) -> int:
    """0 below the model, 1 the model, 2 the generation loop, 3 the batch layer; -1 neither (a tool, the app)."""
    for i, top in enumerate(RUN_LAYERS, 1):
        if mod == top or mod.startswith(top + "."):
            return i
    return 0 if mod.startswith("engine.inspection") or mod in ("engine.progress", "engine.results") else -1


def _upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Imports that point up the run's layers: a module under the model (all that engine.model imports, directly or
    through another, and the inspection layer) importing the model, the loop or the batch layer; the model importing
    the loop or the batch layer; the loop importing the batch layer. Imports inside functions count (an arrow is
    an arrow, taken at load time or at call time)."""
    below, stack = set(), ["engine.model"]
    while stack:
        for d in graph.get(stack.pop(), ()):
            if d not in below and _run_layer(d) <= 0:
                below.add(d)
                stack.append(d)
    found = []
    for m, deps in sorted(graph.items()):
        level = 0 if m in below else _run_layer(m)
        if level < 0:
            continue
        found += [f"{m} (layer {level}) imports {d} (layer {_run_layer(d)})" for d in sorted(deps)
                  if _run_layer(d) > level]
    return found


def test_the_generation_loop_and_the_batch_layer_sit_above_the_model():
    """Progress, STOP, Stopped (engine.progress) and the run's results (engine.results) live below engine.model; the
    forward, the inspection layer and what they import reach neither engine.generate nor engine.batch."""
    mods = _sources("engine")
    graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    assert not _upward_arrows(graph), _upward_arrows(graph)
    # the check finds the arrows it is for: the record imported from the loop, the trace reading the loop's types,
    # a module the model reaches through another importing the batch layer, the model's own call-time import
    old = {"engine.model": {"engine.progress", "engine.kv_cache", "engine.generate"},
           "engine.progress": {"engine.generate"}, "engine.kv_cache": {"engine.errors"},
           "engine.errors": {"engine.batch.rows"}, "engine.inspection.trace": {"engine.generate"},
           "engine.generate": {"engine.model", "engine.batch.rows"}, "engine.batch.rows": {"engine.model"}}
    assert _upward_arrows(old) == ["engine.errors (layer 0) imports engine.batch.rows (layer 3)",
                                   "engine.generate (layer 2) imports engine.batch.rows (layer 3)",
                                   "engine.inspection.trace (layer 0) imports engine.generate (layer 2)",
                                   "engine.model (layer 1) imports engine.generate (layer 2)",
                                   "engine.progress (layer 0) imports engine.generate (layer 2)"]


def test_pure_views_use_no_streamlit_threads_or_environment():
    for mod, path in _sources("inspector/views").items():
        text = path.read_text()
        for banned in ("streamlit", "threading", "os.environ", "getenv"):
            assert banned not in text, f"{mod} uses {banned}"


# What runs the model: its forward and the calls around it, and the generation loop.
MODEL_CALLS = {"forward", "generate", "logits", "unembed", "run_blocks", "new_cache", "GenerationRun"}


def model_runners(sources: dict[str, str]) -> set[str]:
    """module.function (module relative to its folder; a method as module.Class.method) of every function that runs
    the model: calls one of MODEL_CALLS."""
    found = set()
    for mod, text in sources.items():
        for node in ast.parse(text).body:
            fns = [(node.name, node)] if isinstance(node, ast.FunctionDef) else [
                (f"{node.name}.{f.name}", f) for f in node.body if isinstance(f, ast.FunctionDef)] \
                if isinstance(node, ast.ClassDef) else []
            for name, fn in fns:
                if any(isinstance(c, ast.Call) and named(c.func) in MODEL_CALLS for c in ast.walk(fn)):
                    found.add(f"{mod}.{name}")
    return found


def test_views_run_the_model_only_in_the_computations_the_readme_names():
    """README 'Layout' lists the views' on-demand computations (each one forward or generation on the model it is
    handed); no other view function runs the model."""
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("      views/"):readme.index("      session/")]
    named = set(re.findall(r"\b([a-z_]+\.[a-z_]+)\b", block.split("device_slot):")[1].split("(tests/")[0]))
    views = {p.stem: p.read_text() for p in sorted((ROOT / "inspector/views").glob("*.py"))}
    assert model_runners(views) == named
    assert model_runners({"old": "def lens(model, ids):\n    return model.forward(ids, model.new_cache(3))\n"
                                 "def table(df):\n    return df\n"}) == {"old.lens"}


def test_no_file_over_400_lines_and_no_function_over_80_outside_tests():
    for mod, path in _sources(*PACKAGES).items():
        text = path.read_text()
        assert text.count("\n") <= 400, f"{mod}: {text.count(chr(10))} lines"
        for node in walked(text):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                assert n <= 80, f"{mod}.{node.name}: {n} lines"


def _side_doors(mod: str, text: str) -> list[str]:
    """Ways around the public forward in one module: a call of the model's private block (outside the model),
    and a replace hook (a function taking x, ctx) that raises a private exception (_Stop, _Done, _NonFinite ...)
    to cut a forward short."""
    found = [f"{mod} calls the model's private block; use Model.run_blocks"] \
        if mod != "engine.model" and "._block(" in text else []
    for fn in walked(text):
        params = [a.arg for a in fn.args.args] if isinstance(fn, ast.FunctionDef) else []
        if ["x", "ctx"] not in (params[:2], params[1:3]):
            continue
        for r in ast.walk(fn):
            exc = r.exc.func if isinstance(r, ast.Raise) and isinstance(r.exc, ast.Call) else getattr(r, "exc", None)
            if isinstance(r, ast.Raise) and re.match(r"_[A-Z]", getattr(exc, "id", "")):
                found.append(f"{mod}.{fn.name} raises {exc.id} to end a forward; use Model.forward(stop_after=...)")
    return found


def _duck_typing(text: str) -> list[str]:
    """Where a module asks an object what it is instead of calling its declared interface: hasattr / getattr, and
    isinstance or type() of a cache or a probe (a weight's type, a QuantMatrix, is the weight's own business)."""
    found = []
    for node in walked(text):
        if isinstance(node, ast.Call) and named(node.func) in ("hasattr", "getattr"):
            found.append(f"line {node.lineno}: {named(node.func)}")
        if isinstance(node, ast.Call) and named(node.func) in ("isinstance", "type") and node.args \
                and re.search(r"cache|probe|rows|segments|^p$", named(node.args[0])):
            found.append(f"line {node.lineno}: {named(node.func)}({named(node.args[0])})")
    return sorted(found)


def test_the_forward_asks_its_cache_and_probe_only_their_declared_interfaces():
    """engine.model calls engine.cache_protocol.Cache and engine.inspection.stage_sink's sinks, never asks a form
    what it is (tests/unit/test_cache_forms.py holds every form to its protocol)."""
    assert _duck_typing((ROOT / "engine/model.py").read_text()) == []
    assert _duck_typing('x = x[c.last_rows] if hasattr(c, "last_rows") else x[-1:]\n'
                        'if isinstance(cache, Rows): pass\nw = isinstance(embed, QuantMatrix)\n') == [
        "line 1: hasattr", "line 2: isinstance(cache)"]


def test_tools_run_the_model_through_its_public_forward():
    """Spans of blocks go through Model.run_blocks, early stops through Model.forward's stop_after."""
    found = [s for mod, path in _sources(*PACKAGES).items() for s in _side_doors(mod, path.read_text())]
    assert not found, found


# The one progress record and what tells it (engine.progress); everything else reports through them.
PROGRESS_CLASSES = {("engine.progress", "Progress"), ("engine.progress", "LayerProgress")}
# A model load's (fraction, message) callback is no job one viewer stops: one load serves every session waiting.
LOAD_PATH = {"engine.gguf_import", "engine.loader", "engine.sources", "engine.weights", "inspector.session.models"}


def named(node: ast.AST) -> str:
    return getattr(node, "id", None) or getattr(node, "attr", None) or ""


def _progress_protocols(mod: str, text: str) -> list[str]:
    """Progress reported other than by the one protocol: another class named *Progress*, a weight lookup used as a
    progress tick (a class other than inspection.probe's Probe with layer_weights), a (fraction, message)-style alias
    `...Progress = Callable[...]`, a callback named *progress* called with two arguments or a two-argument lambda
    handed in as one."""
    found = []
    for node in walked(text):
        if isinstance(node, ast.ClassDef):
            methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
            if "progress" in node.name.lower() and (mod, node.name) not in PROGRESS_CLASSES:
                found.append(f"{mod}.{node.name}: a second progress type; use engine.progress")
            if "layer_weights" in methods and mod not in ("engine.inspection.probe", "engine.inspection.probe_views",
                                                          "engine.inspection.stage_sink"):       # (its protocol)
                found.append(f"{mod}.{node.name} wraps the probe's weight lookup; use Model.forward(on_layer=...)")
        if mod in LOAD_PATH:
            continue
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Subscript) \
                and named(node.value.value) == "Callable" \
                and any("progress" in named(t).lower() and named(t) != "OnProgress" for t in node.targets):
            found.append(f"{mod}: {named(node.targets[0])} is a progress callback of its own; use OnProgress")
        if isinstance(node, ast.Call) and "progress" in named(node.func).lower() and len(node.args) == 2 \
                and named(node.func) != "tell_units":
            found.append(f"{mod}:{node.lineno} calls {named(node.func)}(a, b): a (fraction, message) callback")
        if isinstance(node, ast.keyword) and node.arg in ("progress", "on_progress") \
                and isinstance(node.value, ast.Lambda) and len(node.value.args.args) == 2:
            found.append(f"{mod}:{node.value.lineno} hands a two-argument lambda in as {node.arg}")
    return found


def test_one_progress_protocol_for_every_long_job():
    """engine.progress: every long computation tells engine.progress.Progress records to one callback that may
    answer STOP (tests/unit/test_progress_stop.py checks each job stops there)."""
    found = [s for mod, path in _sources(*PACKAGES).items() for s in _progress_protocols(mod, path.read_text())]
    assert not found, found


# The engine's packages and what each may import of the engine (engine/__init__.py states the core's boundary).
HIGHER = ("engine.tools", "engine.report", "engine.bench", "engine.cli")


def _layer(mod: str) -> str:
    return next((p for p in HIGHER if mod == p or mod.startswith(p + ".")), "core")


def test_the_core_and_inspection_import_no_tool_report_bench_or_cli():
    mods = _sources("engine")
    found = [(m, d) for m, p in mods.items() if _layer(m) == "core" and m not in ("engine", "engine.__main__")
             for d in _imports(m, p, set(mods)) if _layer(d) != "core"]
    assert not found, found
    flat = sorted(m for m in mods if m.count(".") == 1 and mods[m].name != "__init__.py")
    tools = {"doctor", "why_loop", "rescue", "explain", "patching", "attribution", "breakpoints", "quant", "report",
             "bench", "probe", "stats", "trace"}
    assert not [m for m in flat if m.split(".")[1] in tools], flat     # they live in their packages


def test_pages_holds_exactly_the_pages_and_only_the_app_layers_use_streamlit():
    """pages/ holds the files app.py navigates to (st.Page) and nothing else; the Streamlit glue they share is
    inspector.ui; the engine, inspector.views and inspector.session never import Streamlit."""
    navigated = set(re.findall(r'st\.Page\("pages/([^"]+)"', (ROOT / "app.py").read_text()))
    assert navigated and {p.name for p in (ROOT / "pages").iterdir() if p.suffix == ".py"} == navigated
    assert not [p for p in (ROOT / "pages").iterdir() if p.is_dir() and p.name != "__pycache__"]
    for mod, path in _sources("engine", "inspector/views", "inspector/session").items():
        assert not re.search(r"^\s*(import|from) streamlit\b", path.read_text(), re.M), f"{mod} uses Streamlit"


def test_the_native_accelerator_is_chosen_in_one_place():
    """engine.accelerator chooses the native decode step and statistics backend when a model is built; nothing
    else in the product imports engine.native, and only the model calls the decode step it was given."""
    mods = _sources(*PACKAGES)
    importers = sorted(m for m, p in mods.items() if not m.startswith("engine.native")
                       and any(d.startswith("engine.native") for d in _imports(m, p, set(mods))))
    assert importers == ["engine.accelerator"], importers
    callers = sorted(m for m, p in mods.items() if re.search(r"accelerator\.decode\(|\._native\b|native_allowed",
                                                             p.read_text()))
    assert callers == [], callers


def test_models_are_built_in_two_places():
    """engine.loader builds the models it loads; every other model (a precision plan, a cast or a quantised
    copy) is a variant made by engine.variants.derive."""
    builders = sorted(m for m, p in _sources(*PACKAGES).items() if re.search(r"(?<![\w.])Model\(", p.read_text()))
    assert builders == ["engine.loader", "engine.variants"], builders


# ---- per-session state: one typed object; widget values under their widget keys ----------------------------------
# the probe (configuration and hooks), its recording (results) and the statistics batcher, apart
_KEPT_APART = {"engine.inspection.probe": "Probe", "engine.inspection.probe_views": "LayerProbe",
               "engine.inspection.recording": "Recording", "engine.inspection.stats": "StatsBatcher"}
BATCHER_API = {"add", "flush", "take", "rows_out", "forget_moments", "backend"}


def _private_fields(mods: dict[str, Path]) -> dict[str, str]:
    """Private attributes (self._x) of the classes kept apart, by name -> their module."""
    out = {}
    for mod, cls in _KEPT_APART.items():
        tree = parsed(mods[mod].read_text())
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        out.update({n.attr: mod for n in ast.walk(node) if isinstance(n, ast.Attribute) and n.attr.startswith("_")
                    and not n.attr.startswith("__") and isinstance(n.value, ast.Name) and n.value.id == "self"})
    return out


def test_no_module_touches_the_private_fields_of_the_probe_its_recording_or_the_batcher():
    """A trace file reopens a run through Recording's constructor, and no other module reads or writes a probe's,
    a recording's or the batcher's private fields (a test may read one, to see a cache at work, never write)."""
    mods = _sources(*PACKAGES, "tests")
    private = _private_fields(mods)
    bad = []
    for mod, path in mods.items():
        for n in walked(path.read_text()):
            if isinstance(n, ast.Attribute) and private.get(n.attr, mod) != mod \
                    and not (isinstance(n.value, ast.Name) and n.value.id == "self") \
                    and not (mod.startswith("tests.") and isinstance(n.ctx, ast.Load)):
                bad.append(f"{mod}:{n.lineno} {ast.unparse(n)}")
    assert not bad, bad


def test_statistics_enter_the_batcher_by_one_door():
    """StatsBatcher.add is the one way in (stage tensors and sources of statistics alike), and what other
    modules use of a batcher is its public API."""
    mods = _sources(*PACKAGES)
    tree = parsed(mods["engine.inspection.stats"].read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StatsBatcher")
    public = {f.name for f in cls.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}
    assert public == BATCHER_API, public ^ BATCHER_API
    used = []
    for mod, path in mods.items():
        for n in walked(path.read_text()):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) \
                    and n.value.attr in ("stats_batcher", "_batcher") and n.attr not in BATCHER_API:
                used.append(f"{mod}:{n.lineno} {ast.unparse(n)}")
    assert not used, used


def test_test_files_have_unique_names_across_the_tiers():
    """pytest imports a test file by its basename (no packages under tests/<tier>/): two tiers with the same file name
    fail the whole collection ("import file mismatch"), as tests/model/ and tests/unit/test_quant_scoreboard.py did."""
    names: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}


def _family_literal(node: ast.AST, consts: dict) -> str | None:
    """A family named by a literal: `<x>.model_type == "llama"` (or !=, in, not in a literal collection, or a module
    constant bound to one), or `FAMILIES[...]` with a string literal anywhere in its index; the literal, else None."""
    def literal(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            return n.value
        if isinstance(n, (ast.Tuple, ast.List, ast.Set)) and n.elts:
            got = [literal(e) for e in n.elts]
            return ",".join(got) if all(got) else None
        if isinstance(n, ast.Name):
            return consts.get(n.id)
        return None
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        named = any((isinstance(s, ast.Attribute) and s.attr == "model_type") or
                    (isinstance(s, ast.Name) and s.id == "model_type") for s in sides)
        lits = [literal(s) for s in sides]
        return next((x for x in lits if x), None) if named else None
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "FAMILIES":
        return next((n.value for n in ast.walk(node.slice) if isinstance(n, ast.Constant) and isinstance(n.value, str)),
                    None)
    return None


def _literal_constants(tree: ast.Module) -> dict:
    """Module-level names bound to a string or a collection of strings (NATIVE_FAMILIES = ("llama", ...))."""
    out = {}
    for n in tree.body:
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            v = n.value
            if isinstance(v, ast.Constant) and isinstance(v.value, str):
                out[n.targets[0].id] = v.value
            elif isinstance(v, (ast.Tuple, ast.List, ast.Set)) and v.elts and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in v.elts):
                out[n.targets[0].id] = ",".join(e.value for e in v.elts)
    return out


def family_literals(text: str) -> list[str]:
    """Where `text` names a declared family by a literal (engine.family.FAMILIES' keys)."""
    from engine.family import FAMILIES
    consts, out = _literal_constants(parsed(text)), []
    for n in walked(text):
        got = _family_literal(n, consts)
        if got and any(part in FAMILIES for part in got.split(",")):
            out.append(f"{n.lineno} {got!r}")
    return out


def test_no_module_outside_the_family_declarations_names_a_model_type():
    """Family knowledge lives in engine/family (issue 45): elsewhere a family is read from its declaration's fields,
    never told by its model_type (the native step's allow-list, the GGUF import's Mixtral-as-llama rule and the
    tools' refusals all read the declaration)."""
    files = [p for m, p in _sources(*PACKAGES).items() if not m.startswith("engine.family")] + [ROOT / "app.py"]
    found = [f"{p.relative_to(ROOT)}:{hit}" for p in files for hit in family_literals(p.read_text())]
    assert found == [], found
