"""AppTest of the Debugger and Compare pages on the tiny random model (the sidebar's server-default choice
through LLM_INSPECTOR_MODEL), inside a frame like app.py's: the sidebar, then the page."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from engine import GenerationRun, Probe, SamplingParams
from inspector.session.models import model_choices
from inspector.ui.state import session_of
from inspector.views import compare as cmp

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Tell me about caches."
MAX_NEW = 8
FRAME = '''import streamlit as st
from inspector.ui.sidebar import sidebar
nav = st.navigation([st.Page("views/overview.py", title="Overview", default=True),
                     st.Page("views/debugger.py", title="Debugger"), st.Page("views/compare.py", title="Compare")])
sidebar()
nav.run()
'''


@pytest.fixture(scope="module")
def app_file(tmp_path_factory) -> Path:
    """The frame with the pages copied to views/: a folder called pages/ next to the main script would put
    Streamlit in its v1 multipage mode (see tests/test_app_pages_b.py)."""
    out = tmp_path_factory.mktemp("debug_app")
    (out / "views").mkdir()
    for name in ("overview", "debugger", "compare"):
        shutil.copy(ROOT / "pages" / f"{name}.py", out / "views" / f"{name}.py")
    (out / "app.py").write_text(FRAME)
    return out / "app.py"


@pytest.fixture
def at(monkeypatch, tiny_model_dir, app_file) -> AppTest:
    """The app with the tiny model already in the shared cache (loaded outside any script run, so a cache
    hit replays no progress-bar calls), the sidebar's prompt set."""

    from inspector.session.models import shared_model
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    model_choices.clear()
    shared_model.clear()
    shared_model(str(tiny_model_dir), "cpu", "auto")
    at = AppTest.from_file(str(app_file), default_timeout=120).run()
    assert not at.exception, at.exception
    at.sidebar.text_area(key="sb_prompt").set_value(PROMPT)
    at.sidebar.number_input(key="sb_max_new").set_value(MAX_NEW).run()
    return at


def greedy(model, **kw) -> list[int]:
    return GenerationRun(model, PROMPT, chat=True, max_new_tokens=MAX_NEW, **kw).run().token_ids


def find_df(at: AppTest, *cols):
    """The first dataframe holding these columns (AppTest does not expose a dataframe's key)."""
    for el in at.dataframe:
        if set(cols) <= set(el.value.columns):
            return el.value
    raise AssertionError(f"no dataframe with columns {cols}")


def click(at: AppTest, key: str) -> AppTest:
    at.button(key=key).click().run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    assert all(w.value.startswith("Breakpoint: ") for w in at.warning), [w.value for w in at.warning]
    return at


def test_debugger_steps_breaks_changes_settings_and_publishes(at, tiny_model):
    ref = greedy(tiny_model)
    at.switch_page("views/debugger.py").run()
    assert not at.exception and any("Press **Step**" in i.value for i in at.info)
    assert session_of(at.session_state).run is None
    for n in (1, 2):                                            # Step: exactly one more token each time
        click(at, "dbg_step")
        run = session_of(at.session_state).run
        assert run.result.token_ids == ref[:n] and session_of(at.session_state).selected_step == n - 1
        assert at.number_input(key="dbg_view_step").value == n - 1
    assert "tiny-llama" in run.model_name and run.result.stop_reason == "running"
    steps = find_df(at, "step", "top5")
    assert steps["step"].tolist() == [0, 1]
    # a token breakpoint on greedy token 4 (by id): Continue pauses right after it
    at.selectbox(key="dbg_bp_kind").set_value("Token").run()
    at.text_input(key="dbg_bp_token").set_value(str(ref[4])).run()
    click(at, "dbg_bp_add")
    named = rf"\(id {ref[4]}\)"     # the breakpoint names the token by its text and id (Markdown-escaped)
    assert any(m.value.startswith("`0` token ") and named in m.value for m in at.markdown)   # breakpoint 0
    click(at, "dbg_continue")
    run = session_of(at.session_state).run
    assert run.result.token_ids == ref[:5] and session_of(at.session_state).selected_step == 4
    assert any("Breakpoint: step 4: chose token" in w.value for w in at.warning)
    # new sampler settings after the break: the rest follows them (top-3 at T = 1, seeded as the run)
    at.slider(key="dbg_temperature").set_value(1.0)
    at.number_input(key="dbg_top_k").set_value(3)
    click(at, "dbg_bp_rm_0")
    assert not any(m.value.startswith("`0` ") for m in at.markdown)
    click(at, "dbg_run_end")
    run = session_of(at.session_state).run
    assert run.result.stop_reason == "max_new_tokens" and len(run.result.token_ids) == MAX_NEW
    assert run.result.params.temperature == 1.0 and run.result.params.top_k == 3
    assert run.settings.params.temperature == 1.0
    cont = GenerationRun(tiny_model, run.result.prompt_ids + ref[:5], max_new_tokens=MAX_NEW - 5,
                         params=SamplingParams(temperature=1.0, top_k=3)).run().token_ids
    assert run.result.token_ids == ref[:5] + cont
    log = find_df(at, "from_step", "temperature")
    assert log["from_step"].tolist() == [0, 5] and log["temperature"].tolist() == [0.0, 1.0]
    # choosing a step to show is display-only and publishes it for the other pages
    at.number_input(key="dbg_view_step").set_value(2).run()
    held = session_of(at.session_state)
    assert held.selected_step == 2 and held.run.result.token_ids == run.result.token_ids
    assert [m.value for m in at.metric if m.label == "Entropy (nats)"] == [f"{run.result.steps[2].entropy:.3f}"]
    # the other pages show the debugger's run
    at.switch_page("views/overview.py").run()
    assert not at.exception
    table = find_df(at, "step", "id", "top5")
    assert table["id"].tolist() == run.result.token_ids
    # back on the debugger: the same run and step; Reset starts over and keeps breakpoints
    at.switch_page("views/debugger.py").run()
    assert at.number_input(key="dbg_view_step").value == 2 and at.slider(key="dbg_temperature").value == 1.0
    click(at, "dbg_reset")
    assert session_of(at.session_state).run is None and session_of(at.session_state).selected_step is None
    assert at.slider(key="dbg_temperature").value == 0.0
    click(at, "dbg_step")
    assert session_of(at.session_state).run.result.token_ids == ref[:1]


def test_debugger_entropy_breakpoint_pauses_at_the_first_low_step(at, tiny_model):
    ref = GenerationRun(tiny_model, PROMPT, chat=True, max_new_tokens=MAX_NEW).run()
    e = [s.entropy for s in ref.steps]
    # the first new low after step 0, and a threshold just above it: no earlier step is below
    first = next(k for k in range(1, len(e)) if e[k] < min(e[:k]))
    threshold = (e[first] + min(e[:first])) / 2
    at.switch_page("views/debugger.py").run()
    at.selectbox(key="dbg_bp_kind").set_value("NaN / Inf").run()
    at.text_input(key="dbg_bp_stage").set_value("blocks.9.*").run()            # the tiny model has 2 layers
    assert any("no stage matches 'blocks.9.*'" in e.value for e in at.error) and at.button(key="dbg_bp_add").disabled
    at.selectbox(key="dbg_bp_kind").set_value("Entropy below").run()
    at.number_input(key="dbg_bp_entropy").set_value(threshold).run()
    click(at, "dbg_bp_add")
    click(at, "dbg_continue")
    assert len(session_of(at.session_state).run.result.steps) == first + 1
    assert any(f"step {first}: entropy" in w.value for w in at.warning)


def test_compare_page_shows_the_divergence_step(at, tiny_model):
    a = greedy(tiny_model, seed=4)
    b = greedy(tiny_model, seed=4, params=SamplingParams(temperature=1.0))
    d = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    at.switch_page("views/compare.py").run()
    assert not at.exception and any("press **Compare**" in i.value for i in at.info)
    at.number_input(key="cmp_max_new").set_value(MAX_NEW)
    at.number_input(key="cmp_seed").set_value(4)
    assert at.slider(key="cmp_a_temperature").value == 0.0 and at.slider(key="cmp_b_temperature").value == 1.0
    click(at, "cmp_run")
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["First divergence"] == f"step {d}"
    table = find_df(at, "id_a", "id_b")
    assert table["id_a"].tolist() == a and table["id_b"].tolist() == b
    diff = find_df(at, "stage", "rel_error")
    assert diff.set_index("stage").loc["sampler.probs", "rel_error"] > 0
    assert any("first stage above 1e-6: **sampler.probs**" in c.value for c in at.caption)
    # Stop (drawn while it ran): the page says so and the last comparison stays
    at.button(key="cmp_stop").click().run()
    assert not at.exception and any("Comparison stopped" in w.value for w in at.warning)
    assert {m.label: m.value for m in at.metric}["First divergence"] == f"step {d}"
    # cache off and greedy on both sides: no divergence; zeroing heads: the first different stage is named
    at.slider(key="cmp_b_temperature").set_value(0.0)
    at.toggle(key="cmp_cache_b").set_value(False).run()
    click(at, "cmp_run")
    assert {m.label: m.value for m in at.metric}["First divergence"] == "none"
    at.toggle(key="cmp_cache_b").set_value(True)
    at.selectbox(key="cmp_iv_b").set_value("zero heads").run()
    at.number_input(key="cmp_iv_layer_b").set_value(1)
    at.text_input(key="cmp_iv_heads_b").set_value("0, 1, 2, 3").run()
    click(at, "cmp_run")
    assert any("**blocks.1.attn.z**" in c.value for c in at.caption)


def test_compares_table_opens_at_a_late_divergence_and_a_toggle_shows_every_step(at, tiny_model):
    """Issue 33, item 9: the table opened at step 0, the divergence far below. Run B scales layer 1's MLP output by
    0.95; the reference runs are the engine's own with the same intervention."""
    n, stage, factor = 16, "blocks.1.mlp_out", 0.95
    probe = cmp.Intervention("scale", stage, factor=factor).apply(tiny_model, Probe())
    a = GenerationRun(tiny_model, PROMPT, chat=True, max_new_tokens=n, seed=4).run().token_ids
    b = GenerationRun(tiny_model, PROMPT, chat=True, max_new_tokens=n, seed=4, probe=probe).run().token_ids
    d = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert 3 <= d < n - 1, d                              # a late divergence: there are steps to skip
    at.switch_page("views/compare.py").run()
    at.number_input(key="cmp_max_new").set_value(n)
    at.number_input(key="cmp_seed").set_value(4)
    at.slider(key="cmp_b_temperature").set_value(0.0)
    at.selectbox(key="cmp_iv_b").set_value("scale a stage").run()
    at.text_input(key="cmp_iv_pattern_b").set_value(stage)
    at.number_input(key="cmp_iv_factor_b").set_value(factor)
    click(at, "cmp_run")
    assert {m.label: m.value for m in at.metric}["First divergence"] == f"step {d}"
    shown = find_df(at, "id_a", "id_b")                   # from two steps before the divergence to the end
    assert shown["step"].tolist() == list(range(d - 2, n))
    assert shown["id_a"].tolist() == a[d - 2:] and shown["id_b"].tolist() == b[d - 2:]
    assert any(f"opens at the first divergence, step {d}" in c.value for c in at.caption)
    at.toggle(key="cmp_all_steps").set_value(True).run()
    every = find_df(at, "id_a", "id_b")
    assert every["id_a"].tolist() == a and every["id_b"].tolist() == b


def test_compare_page_checks_determinism_in_a_class_batch(at, tiny_model):
    """The determinism check on the page: the prompt greedy alone and in a batch of three; the table names every
    trial, the second run alone is bit-identical to the first (the same kernels in the same order), the batch trial
    shared forwards, and the headline counts the runs and the distinct outputs as the table shows them."""
    at.switch_page("views/compare.py").run()
    assert not at.exception
    at.number_input(key="det_class").set_value(3)
    at.number_input(key="det_repeats").set_value(2)
    at.number_input(key="det_tokens").set_value(4)
    at.button(key="det_run").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    table = find_df(at, "run", "bit-identical")
    runs = table["run"].tolist()
    assert runs[:2] == ["alone #2", "in a batch of 3"]
    assert bool(table.set_index("run").loc["alone #2", "bit-identical"])
    assert "shared a forward" in table.set_index("run").loc["in a batch of 3", "notes"]
    said = [m.value for m in (*at.success, *at.warning) if m.value.startswith("**")]
    assert said and said[0].startswith(f"**{len(runs) + 1} runs, ")


def test_compare_page_steers_and_shows_what_moved(at, tiny_model):
    """Steering on the page: coefficient 0 gives the plain continuation and no shift (one run, bit for bit); a large
    coefficient moves the distribution at every step (KL > 0) and the table lists each steered token."""
    at.switch_page("views/compare.py").run()
    at.number_input(key="steer_layer").set_value(1)
    at.number_input(key="steer_tokens").set_value(4)
    at.number_input(key="steer_coef").set_value(0.0)
    at.button(key="steer_run").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    table = find_df(at, "steered token", "KL(steered || plain)")
    assert len(table) == 4 and (table["KL(steered || plain)"] == 0).all()
    assert (table["p steered"] == table["p plain"]).all()
    at.number_input(key="steer_coef").set_value(60.0)
    at.button(key="steer_run").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    table = find_df(at, "steered token", "KL(steered || plain)")
    assert (table["KL(steered || plain)"] > 0).all()
