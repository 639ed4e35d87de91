"""AppTest of the KV cache, Sampling and Timeline pages: on the tiny random model (the sidebar's
server-default choice through LLM_INSPECTOR_MODEL) and once on the bundled model."""
from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from engine.generate import GenerationRun
from engine.model import Model
from inspector.session.models import model_choices
from inspector.ui.state import session_of

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["kv_cache", "sampling", "timeline"]
MAX_NEW = 6


@pytest.fixture
def pages(app_file) -> dict[str, str]:
    """Page name -> its path relative to the app under test ('pages/x.py' or 'views/x.py')."""
    folder = "pages" if app_file == ROOT / "app.py" else "views"
    return {name: f"{folder}/{name}.py" for name in NAMES}


def fresh_app(app_file: Path, source: str | None) -> AppTest:
    """An AppTest whose model is already in the shared cache.

    Workaround for inspector/ui/common.py: shared_model() is st.cache_resource'd and draws its progress bar on
    a block made outside it, so a later session's cache hit replays those calls and fails
    (CacheReplayClosureError). Loading outside any script run records no such calls."""

    from inspector.session.models import shared_model
    model_choices.clear()          # the sidebar's model list is cached for 60 s; the env var differs per test
    shared_model.clear()
    shared_model(source, "cpu", "auto")
    return AppTest.from_file(str(app_file), default_timeout=120)


def start(app_file: Path, source: str | None, prompt: str, max_new: int = MAX_NEW) -> AppTest:
    at = fresh_app(app_file, source)
    at.run()
    assert not at.exception, at.exception
    at.sidebar.text_area(key="sb_prompt").set_value(prompt)
    at.sidebar.number_input(key="sb_max_new").set_value(max_new)
    at.sidebar.button(key="sb_run").click().run()
    assert not at.exception, at.exception
    assert session_of(at.session_state).run is not None
    return at


@pytest.fixture
def forward_calls(monkeypatch):
    """Install (when called) a counting wrapper on Model.forward and on GenerationRun (a generation started: the
    app's run path drives one through the step barrier): every instance, the app's shared model included."""
    n = {"forward": 0, "generate": 0}

    def install():
        fwd, gen = Model.forward, GenerationRun.__init__

        def forward(self, *a, **kw):
            n["forward"] += 1
            return fwd(self, *a, **kw)

        def generate(self, *a, **kw):
            n["generate"] += 1
            return gen(self, *a, **kw)

        monkeypatch.setattr(Model, "forward", forward)
        monkeypatch.setattr(GenerationRun, "__init__", generate)
        return n
    return install


@pytest.fixture
def tiny_app(monkeypatch, tiny_model_dir, app_file):
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    at = start(app_file, str(tiny_model_dir), "Tell me about caches.")
    assert "tiny-llama" in session_of(at.session_state).run.model_name
    return at


def find_df(at, *cols):
    for el in at.dataframe:
        if set(cols) <= set(el.value.columns):
            return el.value
    raise AssertionError(f"no dataframe with columns {cols}")


def chart(at, key: str) -> dict:
    (el,) = [e for e in at.get("plotly_chart") if e.key == key]
    return json.loads(el.proto.spec)


def arr(v) -> np.ndarray:
    """A plotly trace array: a plain list, or plotly's typed-array encoding {dtype, bdata, shape}."""
    if isinstance(v, dict) and "bdata" in v:
        a = np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
        return a.reshape([int(n) for n in str(v.get("shape", a.size)).split(",")])
    return np.array(v)


def captured_logits(run, step: int) -> np.ndarray:
    (cap,) = run.recording.captured("logits", step=step)
    return cap.value[-1].double().numpy()


def nucleus_size(logits: np.ndarray, top_p: float, temperature: float = 1.0, top_k: int = 0) -> int:
    """Hand computation: sort the probabilities, count tokens until their running sum reaches top_p."""
    z = logits / temperature
    if top_k:
        z = np.sort(z)[::-1][:top_k]
    p = np.exp(z - z.max())
    p = np.sort(p / p.sum())[::-1]
    return int(np.searchsorted(np.cumsum(p), top_p) + 1)


def test_pages_without_a_run_show_the_hint(monkeypatch, tiny_model_dir, app_file, pages, forward_calls):
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    at = fresh_app(app_file, str(tiny_model_dir)).run()
    calls = forward_calls()
    for page in pages.values():
        at.switch_page(page).run()
        assert not at.exception
        assert any("press **Run**" in i.value for i in at.info), page
        assert not at.get("plotly_chart") and not at.dataframe
        assert at.sidebar.button(key="sb_run")                          # the frame ran around the page
    assert calls == {"forward": 0, "generate": 0}


def test_kv_cache_page_bytes_match_the_formula(tiny_app, tiny_model, pages):
    run = session_of(tiny_app.session_state).run
    at = tiny_app.switch_page(pages["kv_cache"]).run()
    assert not at.exception
    cfg = tiny_model.config
    bpt = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4        # float32
    assert bpt == 2 * 2 * 2 * 16 * 4
    allocated, used = run.n_prompt + MAX_NEW, run.n_prompt + len(run.result.steps) - 1
    check = find_df(at, "quantity", "positions", "formula_bytes", "engine_bytes").set_index("quantity")
    assert check.loc["bytes per token", "engine_bytes"] == bpt
    assert check.loc["allocated", "engine_bytes"] == bpt * allocated
    assert check.loc["used", "engine_bytes"] == bpt * used
    assert (check["formula_bytes"] == check["engine_bytes"]).all() and check["match"].all()
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Bytes per token"] == f"{bpt:,}" and metrics["Dtype"] == "float32"
    assert not at.error
    growth = chart(at, "kv_growth")["data"]
    assert arr(growth[0]["x"]).tolist() == list(range(len(run.result.steps)))
    assert arr(growth[0]["y"]).tolist() == [bpt * (run.n_prompt + s) for s in range(len(run.result.steps))]
    layers = find_df(at, "layer", "allocated_bytes", "used_bytes")
    assert layers["allocated_bytes"].sum() == bpt * allocated and len(layers) == cfg.num_layers
    gqa = find_df(at, "cache", "gqa_bytes", "mha_bytes").set_index("cache")
    assert gqa.loc["used", "mha_bytes"] == 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * used * 4
    assert any("CUDA" in i.value for i in at.info)                     # on the CPU: said, not shown
    # calculator: batch 4 in float32 doubles bf16's bytes per element; Llama-3-8B at 8k is 1 GiB at batch 1 bf16
    at.number_input(key="kv_calc_batch").set_value(4).run()
    at.selectbox(key="kv_calc_dtype").set_value("float32").run()
    assert not at.exception
    pivot = [el.value for el in at.dataframe if 8192 in list(el.value.columns)][0]
    assert float(pivot.loc["Llama-3-8B", 8192]) == pytest.approx(8.0)
    assert float(pivot.loc["SmolLM2-135M", 2048]) == pytest.approx(2 * 30 * 3 * 64 * 2048 * 4 * 4 / 2 ** 30)


def test_sampling_page_kept_counts_and_no_model_calls(tiny_app, pages, forward_calls):
    run = session_of(tiny_app.session_state).run
    calls = forward_calls()                                             # counted from here on
    at = tiny_app.switch_page(pages["sampling"]).run()
    assert not at.exception
    step = min(2, len(run.result.steps) - 1)
    at.number_input(key="smp_step").set_value(step).run()
    # B: T = 1, top-p 0.5 only; C: T = 0.8, top-k 50, top-p 0.9
    at.slider(key="smp_1_temperature").set_value(1.0)
    at.slider(key="smp_1_top_p").set_value(0.5)
    at.slider(key="smp_2_temperature").set_value(0.8)
    at.number_input(key="smp_2_top_k").set_value(50)
    at.slider(key="smp_2_top_p").set_value(0.9)
    at.slider(key="smp_2_min_p").set_value(0.0).run()
    assert not at.exception
    logits = captured_logits(run, step)
    summary = find_df(at, "setting", "kept", "entropy", "mass_kept").set_index("setting")
    assert summary.loc["B", "kept"] == nucleus_size(logits, 0.5)
    assert summary.loc["C", "kept"] == nucleus_size(logits, 0.9, temperature=0.8, top_k=50)
    assert summary.loc["A", "kept"] == 1                                 # the run's own settings: greedy
    assert summary.loc["A", "chosen_prob"] == pytest.approx(1.0)
    # the run's token is highlighted: greedy chose the argmax, rank 1 in A's panel
    assert int(np.argmax(logits)) == run.result.token_ids[step]
    bars = [t for t in chart(at, "smp_compare_fig")["data"] if t["type"] == "bar"]
    chosen_a = [t for t in bars if t.get("xaxis", "x") == "x" and t["name"] == "the run's token"]
    assert len(bars) == 9 and chosen_a[0]["marker"]["color"] == "#e4572e"    # kept, cut, chosen per panel
    assert [x.split(".")[0] for x in chosen_a[0]["x"]] == ["1"]
    # the chain for B, stage by stage, and its empirical check
    at.radio(key="smp_chain").set_value("B").run()
    chain = find_df(at, "stage", "kept", "entropy")
    assert chain["stage"].tolist() == ["penalties", "temperature", "top_k", "top_p", "min_p", "probs"]
    assert chain["kept"].tolist() == [49152, 49152, 49152] + [nucleus_size(logits, 0.5)] * 3
    at.number_input(key="smp_draws").set_value(2000).run()
    emp = find_df(at, "token_id", "count", "observed", "probability")
    assert emp["count"].sum() == 2000
    # more display-only changes: temperature of every panel, penalties, a fourth setting
    for i in range(3):
        at.slider(key=f"smp_{i}_temperature").set_value(1.5).run()
    at.slider(key="smp_0_repetition_penalty").set_value(1.3).run()
    at.number_input(key="smp_n").set_value(4).run()
    assert not at.exception
    assert len(find_df(at, "setting", "kept", "entropy", "mass_kept")) == 4
    assert calls == {"forward": 0, "generate": 0}
    # a new, shorter run: the chosen step no longer exists and setting A follows the new run's settings
    at.number_input(key="smp_step").set_value(len(run.result.steps) - 1).run()
    at.sidebar.number_input(key="sb_max_new").set_value(2)
    at.sidebar.slider(key="sb_temperature").set_value(0.7)
    at.sidebar.button(key="sb_run").click().run()
    assert not at.exception and calls["generate"] == 1
    assert at.number_input(key="smp_step").value == 0 and at.number_input(key="smp_step").max == 1
    assert at.slider(key="smp_0_temperature").value == pytest.approx(0.7)
    assert at.slider(key="smp_0_repetition_penalty").value == 1.0
    assert at.slider(key="smp_1_temperature").value == 1.5                         # B keeps what the user chose


def test_timeline_page_one_row_per_step(tiny_app, tiny_model, pages):
    run = session_of(tiny_app.session_state).run
    at = tiny_app.switch_page(pages["timeline"]).run()
    assert not at.exception
    steps = find_df(at, "step", "kind", "forward_ms", "sample_ms", "detokenize_ms")
    n = len(run.result.steps)
    assert steps["step"].tolist() == list(range(n))
    assert steps["kind"].tolist() == ["prefill"] + ["decode"] * (n - 1)
    assert steps["forward_ms"].tolist() == pytest.approx([1e3 * s.seconds["forward"] for s in run.result.steps])
    gantt = chart(at, "tl_gantt")["data"]
    assert [t["name"] for t in gantt] == ["tokenize", "forward", "sample", "detokenize"]
    heat = chart(at, "tl_heatmap")["data"][0]
    assert arr(heat["y"]).tolist() == list(range(1, n))
    assert arr(heat["x"]).tolist() == list(range(tiny_model.config.num_layers))
    assert arr(heat["z"]).shape == (n - 1, tiny_model.config.num_layers)
    at.toggle(key="tl_heat_prefill").set_value(True).run()
    assert arr(chart(at, "tl_heatmap")["data"][0]["y"]).tolist() == list(range(n))
    durations = find_df(at, "step", "stage", "layer", "ms")
    assert len(durations) == n * (tiny_model.config.num_layers + 2)
    assert any("perf_counter" in c.value for c in at.caption)


@pytest.mark.model                  # the bundled weights: the model tier, outside the quick loop
def test_pages_on_the_bundled_model(monkeypatch, app_file, pages, forward_calls):
    monkeypatch.delenv("LLM_INSPECTOR_MODEL", raising=False)
    at = start(app_file, None, "Name a color.", max_new=3)
    run = session_of(at.session_state).run
    assert "SmolLM2" in run.model_name and len(run.result.steps) <= 3
    calls = forward_calls()
    for page in pages.values():
        at.switch_page(page).run()
        assert not at.exception, (page, at.exception)
    kv = at.switch_page(pages["kv_cache"]).run()
    check = find_df(kv, "quantity", "formula_bytes", "engine_bytes").set_index("quantity")
    bpe = {"float32": 4, "bfloat16": 2, "float16": 2}[{m.label: m.value for m in kv.metric}["Dtype"]]
    assert check.loc["bytes per token", "engine_bytes"] == 2 * 30 * 3 * 64 * bpe        # SmolLM2-135M
    assert check["match"].all()
    smp = at.switch_page(pages["sampling"]).run()
    summary = find_df(smp, "setting", "kept", "entropy")
    assert len(summary) == 3 and summary["kept"].iloc[0] == run.result.steps[0].kept
    ms = [float(m.group(1)) for c in smp.caption if (m := re.search(r"Page computed in (\d+) ms", c.value))]
    print(f"sampling page on the bundled model: {ms[0]:.0f} ms server-side")
    tl = at.switch_page(pages["timeline"]).run()
    assert len(find_df(tl, "step", "kind", "forward_ms")) == len(run.result.steps)
    assert calls == {"forward": 0, "generate": 0}
