"""Shared fixtures: a tiny random-weight Llama in HF layout (with the real SmolLM2 tokenizer), and the
bundled model itself, each built once per test session."""
from __future__ import annotations

import os
import re
import runpy
import shutil
import sys
from pathlib import Path

# The engine's thread policy (engine/threads.py: OpenMP threads spin briefly at barriers, then sleep), in force
# before torch loads libgomp, as in app.py and `python -m engine`. With libgomp's default spin, the suite's runs
# crawled whenever anything else used the cores (issue 22: the twenty-session test took 56-87 s instead of 3-7 s).
# pytest keeps each test module's rewritten asserts as bytecode in its __pycache__ (ignored by git) unless writing
# bytecode is off: with PYTHONDONTWRITEBYTECODE=1 (set on the project's test machine) it parsed and rewrote every
# test module on every run, 4-5 s of the unit tier's collection. Written from here on: the test modules' cache and
# the bytecode of what they import; Python and pytest check each against its source's size and time.
sys.dont_write_bytecode = False
TORCH_BEFORE_POLICY = "torch" in sys.modules     # True would mean libgomp never saw the setting
runpy.run_path(str(Path(__file__).resolve().parent.parent / "engine" / "threads.py"))
# Under pytest-xdist (-n N) each worker gets its share of the cores for torch's and the native step's threads:
# N workers of all-core thread pools each would fight over the cores (on two cores: the unit tier slower).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1)
                                                     // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.sources import bundled_gguf  # noqa: E402
from tests.alone import (  # noqa: E402, F401 (hooks: imported into conftest, registered)
    alone_first,
    pytest_runtest_call,
    pytest_runtest_setup,
    pytest_runtest_teardown,
    pytest_sessionfinish,
    waited,
)
from tests.helpers import write_model_dir  # noqa: E402


def pytest_xdist_auto_num_workers(config):
    """pytest.ini's `-n auto`: three workers for a run that includes the waiting tiers (browser, model, reference:
    servers and Chromium, the cores about 1.1 busy on two workers), two for the unit tier and the quick loop (one
    core's work each; three made the unit tier slower). Measured on this 2-core machine, 2026-12-05: the whole suite
    15:08-15:18 on two workers, 14:46 and 13:49 on three; `-m unit` 54.5 s on two, 61 s on three."""
    expr = config.getoption("markexpr", "") or ""
    return 2 if expr and not any(t in expr for t in ("browser", "model", "reference")) else 3


def pytest_configure(config):
    config.torch_before_policy = TORCH_BEFORE_POLICY      # read by tests/unit/test_concurrency_soak.py


@pytest.fixture(scope="session")
def bundled_gguf_reader():
    """The bundled GGUF file opened once (gguf.GGUFReader maps and indexes the whole file: seconds). Its ~500,000
    objects (an array per field part) live as long as the session: after a collection, what is then alive goes to
    the collector's permanent generation, as at the end of collection, so that full collections skip them."""
    import gc

    import gguf
    reader = gguf.GGUFReader(str(bundled_gguf()))
    gc.collect()
    gc.freeze()
    return reader


@pytest.fixture(scope="session")
def bundled_gguf_file():
    """The bundled GGUF file as the engine reads it (engine.gguf_file: its metadata decoded, its tensors mapped),
    opened once per session. bundled_gguf_reader is gguf-py's reader of it: the reference, and what transformers
    reads."""
    from engine.gguf_file import open_gguf
    return open_gguf(bundled_gguf())


@pytest.fixture(scope="session")
def tokenizer_files(tmp_path_factory, bundled_gguf_file) -> Path:
    """tokenizer.json + tokenizer_config.json of the bundled model, built from its GGUF once."""
    from engine.gguf_tokenizer import write_tokenizer_dir
    out = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_dir(bundled_gguf_file, out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_files) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama", tokenizer_files)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from engine import load_model
    return load_model(tiny_model_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny_looping_model(tmp_path_factory, tokenizer_files):
    """The tiny random Llama with tied embeddings (weights' seed 13): its greedy runs fall into loops, as the
    bundled model's do, for a 2-layer model's cost. On "I like apples. I like apples. I like" (raw, greedy, 64
    tokens) it writes 9 tokens and then one token over and over; zeroing its top 1, 2, 4 or 8 copy heads changes
    the run (from step 8 or 9), and so does each sampler penalty tried before the loop shows (a repetition penalty
    of 1.05 and a frequency penalty of 0.5 from step 4, no repeated 3-grams from step 2)."""
    from engine import load_model
    from tests.helpers import tiny_config, tiny_tensors
    cfg = tiny_config(tie_word_embeddings=True)
    path = write_model_dir(tmp_path_factory.mktemp("tiny-looping") / "tiny-looping", tokenizer_files, cfg,
                           tiny_tensors(cfg, seed=13))
    return load_model(path, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def bundled_model():
    from engine import load_model
    return load_model(None, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def bundled_dir(bundled_model) -> Path:
    return bundled_model.path


@pytest.fixture(scope="session")
def hf_reference(bundled_dir):
    """transformers' LlamaForCausalLM on the imported directory: the test-only reference."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(str(bundled_dir), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def app_file(tmp_path_factory) -> Path:
    """The app for AppTest: a copy of app.py whose page folder is called `views/`.

    A folder named `pages/` beside the main script puts Streamlit in its v1 multipage mode, and AppTest
    re-decides that at every run (PagesManager.uses_pages_directory), so a run after switch_page would
    execute the page file alone, without app.py's sidebar. The copied pages still import inspector.ui.common from
    the repository (its root is on sys.path). The real layout is covered by tests/test_browser.py."""
    root = Path(__file__).resolve().parents[1]
    app = root / "app.py"
    out = tmp_path_factory.mktemp("app")
    (out / "app.py").write_text(app.read_text().replace('st.Page("pages/', 'st.Page("views/'))
    (out / "views").mkdir()
    for p in re.findall(r'st\.Page\("([^"]+)"', app.read_text()):
        shutil.copy(root / p, out / "views" / Path(p).name)
    return out / "app.py"


TIERS = ("unit", "reference", "model", "app", "browser", "cuda")
ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_finish(session):
    """What the app's script runs import and what collection imported (torch, Streamlit, the engine, every test
    module: some 300,000 objects) go to the collector's permanent generation, by the server's own preload
    (inspector/ui/serve.py): each full collection, Python's own and the one after every AppTest script run
    (Streamlit's runner.postScriptGC), then walks only what tests made since, instead of 0.3-0.6 s of CPU each,
    several hundred times a run. Nothing a test makes is frozen: no test has run yet.
    Then the collector runs less often: a young collection per 20,000 new objects instead of 700, a middle one per 20
    young ones (Python's defaults: 700, 10, 10). Fewer of the objects a test holds for a while outlive two young
    collections into the old generation, whose full collections were most of the collector's time (a unit run's
    garbage collections: 8.1 s of CPU before, 4.0 s after; its peak memory 1,321 -> 1,371 MiB). A test that needs
    its garbage gone still calls gc.collect()."""
    import gc

    from inspector.ui.serve import preload
    preload()
    gc.set_threshold(20_000, 20, 10)


def pytest_ignore_collect(collection_path, config):
    """A tier's folder that the run's `-m` expression cannot select from is not imported (tests/tier_folders.py):
    unless a path given on the command line lies in it."""
    expr = config.option.markexpr
    if not expr or collection_path.parent != ROOT / "tests" or collection_path.name not in TIERS:
        return None
    if any(Path(a.split("::")[0]).resolve().is_relative_to(collection_path) for a in config.args):
        return None
    from tests.tier_folders import unselectable
    return True if unselectable(collection_path, expr, TIERS) else None


@pytest.hookimpl(tryfirst=True)        # before pytest-xdist reads the groups below
def pytest_collection_modifyitems(config, items):
    """Each test's tier is its folder's (tests/<tier>/), unless the test names another with a marker."""
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in TIERS and not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(getattr(pytest.mark, folder))
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
    os.environ.setdefault("LLM_INSPECTOR_CACHE", str(Path.home() / ".cache" / "llm-inspector"))
    alone_first(items)
    for item in items:      # for pytest-xdist's --dist loadgroup: a module stays on one worker (its module fixtures
        # are made once); the modules on tests/browser/conftest.py's shared server of the bundled model stay together
        group = "bundled-server" if on_bundled_server(item) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


def on_bundled_server(item) -> bool:
    """The test uses tests/browser/conftest.py's shared `server` (its module defines no `server` of its own)."""
    return "server" in getattr(item, "fixturenames", ()) and not hasattr(item.module, "server") \
        and Path(str(item.fspath)).parent.name == "browser"


def plain_id(item) -> str:
    """The test's id without the "@group" suffix pytest-xdist's --dist loadgroup appends."""
    group = item.get_closest_marker("xdist_group")
    name = (group.args or [group.kwargs.get("name", "")])[0] if group else ""
    return item.nodeid.removesuffix(f"@{name}") if name else item.nodeid


TIMES = os.environ.get("LLM_INSPECTOR_TEST_TIMES")     # a file: each test's tier and seconds, for scripts/test_times.py


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A phase's duration without its wait for its turn (tests/alone.py), as --durations shows it. With
    $LLM_INSPECTOR_TEST_TIMES set, one line per test phase: tier, phase, seconds, outcome, when it started (the
    epoch's seconds), seconds it waited for its turn, the worker, test id."""
    rep = yield
    wait = waited(item, rep.when)
    rep.duration = max(0.0, rep.duration - wait)
    if TIMES:
        tier = next((t for t in TIERS if item.get_closest_marker(t)), "-")
        worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
        with open(TIMES, "a") as f:
            f.write(f"{tier}\t{rep.when}\t{rep.duration:.3f}\t{rep.outcome}\t{rep.start:.3f}\t{wait:.3f}\t{worker}\t"
                    f"{plain_id(item)}\n")
    return rep


@pytest.fixture
def page(monkeypatch):
    """page(name, run, model, source) -> an AppTest of pages/<name>.py with `run` as the session's run; the
    sidebar's shared-model loader returns the given, already loaded model."""
    from streamlit.runtime.pages_manager import PagesManager
    from streamlit.testing.v1 import AppTest

    import inspector.session.models as models
    from inspector.ui.state import session_of
    monkeypatch.setattr(PagesManager, "uses_pages_directory", None)
    root = Path(__file__).resolve().parents[1]

    def make(name: str, run, model, source: str | None):
        monkeypatch.setattr(models, "load_model", lambda *a, **k: model)
        if source is None:
            monkeypatch.delenv("LLM_INSPECTOR_MODEL", raising=False)
        else:
            monkeypatch.setenv("LLM_INSPECTOR_MODEL", source)
        models.shared_model.clear()
        models.shared_model(source, "cpu", "auto")       # cached outside a script run: no replayed progress bar
        at = AppTest.from_file(str(root / "pages" / f"{name}.py"), default_timeout=600)
        if run is not None:
            session_of(at.session_state).run = run
        return at
    return make


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--disable-quic", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    """Debian's headless Chromium through Playwright (skipped where either is missing)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no Chromium at {CHROMIUM}")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def good_answer(tiny_model):
    """The tiny model's answer to GOOD with the sidebar's defaults and 3 new tokens: what 'still works' means."""
    from engine import RunSettings
    from inspector.session.run import inspect_run
    from tests.bad_input import GOOD
    return inspect_run(tiny_model, RunSettings(prompt=GOOD, max_new_tokens=3)).result.token_ids
