"""AppTest of the Explain page (run as its own script with a run in session_of(st.session_state).run) on the tiny
model: the sum of contributions shown equals the logit difference shown, the patching grid's last-layer,
last-position cell equals the p_clean shown, and display-only controls run no model."""
from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from engine import RunSettings
from engine.model import Model
from engine.tools.explain import explain_step
from inspector.session.run import inspect_run
from inspector.ui.state import session_of
from inspector.views.tokens import token_labels

pytestmark = pytest.mark.app
ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The quick brown fox jumps over the lazy dog and"


@pytest.fixture
def forward_calls(monkeypatch):
    n = {"forward": 0}
    fwd = Model.forward

    def forward(self, *a, **kw):
        n["forward"] += 1
        return fwd(self, *a, **kw)
    monkeypatch.setattr(Model, "forward", forward)
    return n


@pytest.fixture
def run(tiny_model):
    return inspect_run(tiny_model, RunSettings(prompt=PROMPT, chat=False, max_new_tokens=3))


@pytest.fixture
def page(monkeypatch, tiny_model, tiny_model_dir, run):
    """An AppTest of pages/explain.py whose sidebar model is the tiny model the run was made with."""
    from streamlit.runtime.pages_manager import PagesManager

    import inspector.session.models as models
    monkeypatch.setattr(PagesManager, "uses_pages_directory", None)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: tiny_model)
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    models.model_choices.clear()
    models.shared_model.clear()
    models.shared_model(str(tiny_model_dir), "cpu", "auto")      # loaded outside a script run
    at = AppTest.from_file(str(ROOT / "pages" / "explain.py"), default_timeout=600)
    session_of(at.session_state).run = run
    return at


def metric(at, label: str) -> float:
    hits = [m.value for m in at.metric if m.label == label]
    assert hits, f"no metric {label!r}; metrics: {[m.label for m in at.metric]}"
    return float(hits[-1].replace(",", ""))


def test_the_contributions_shown_sum_to_the_logit_difference_shown(page, run, tiny_model):
    at = page.run()
    assert not at.exception, at.exception
    diff, total = metric(at, "logit(A) − logit(B)"), metric(at, "Sum of contributions")
    assert total == pytest.approx(diff, abs=2e-6)          # both shown with six decimals
    e = explain_step(tiny_model, run.result.prompt_ids, run.result.token_ids, 0)
    assert diff == pytest.approx(e.logit_diff, abs=1e-6)
    keys = {c.key for c in at.get("plotly_chart")}
    assert {"ex_layers", "ex_heads"} <= keys
    at.selectbox(key="ex_step").set_value(2).run()
    assert not at.exception, at.exception
    assert metric(at, "Sum of contributions") == pytest.approx(metric(at, "logit(A) − logit(B)"), abs=2e-6)


def test_patching_grid_last_layer_last_position_equals_p_clean_and_display_runs_nothing(page, run, tiny_model,
                                                                                        forward_calls):
    at = page.run()
    assert not at.exception, at.exception
    assert not at.get("plotly_chart") or "ex_grid" not in {c.key for c in at.get("plotly_chart")}
    at.button(key="ex_patch_run").click().run()
    assert not at.exception, at.exception
    p_clean = metric(at, "p_clean")
    ids = run.result.prompt_ids + run.result.token_ids[:0]
    labels = token_labels(tiny_model.tokenizer, ids)
    (grid,) = [d.value for d in at.dataframe if list(d.value.columns) == labels]
    assert len(grid) == tiny_model.config.num_layers
    assert grid.iloc[-1, -1] == pytest.approx(p_clean, rel=1e-5)
    assert {"ex_grid", "ex_head_scan"} <= {c.key for c in at.get("plotly_chart")}
    calls = forward_calls["forward"]
    at.radio(key="ex_site").set_value("mlp_out").run()                     # display only
    assert not at.exception and forward_calls["forward"] == calls
    at.run()                                                               # kept in the session
    assert forward_calls["forward"] == calls and metric(at, "p_clean") == p_clean


def test_input_attribution_shows_both_methods_and_their_deletion_areas(page):
    at = page.run()
    at.button(key="ex_attr_run").click().run()
    assert not at.exception, at.exception
    labels = {m.label for m in at.metric}
    assert {"Deletion area: occlusion", "Deletion area: gradient × input",
            "Deletion area: random order (mean)"} <= labels
    assert {"ex_attr_bars", "ex_deletion"} <= {c.key for c in at.get("plotly_chart")}
    assert any({"token", "occlusion", "gradient × input"} <= set(d.value.columns) for d in at.dataframe)
