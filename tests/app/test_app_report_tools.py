"""Issue 47: the head atlas and the tuned lens appear in the offline report where they apply. Computed on their pages
(the Attention page's atlas button, the Activations page's lens fit), each is in the next report the Overview page
makes: the atlas's five top heads by every score at the atlas's own numbers (recomputed here), the tuned lens's
KL at the run's position, layer by layer, at engine.tools.tuned_lens.lenses_at's numbers."""
from __future__ import annotations

import pytest

from engine.tools.head_atlas import SCORE_NAMES, head_atlas
from engine.tools.lens_file import find_lens
from engine.tools.tuned_lens import lenses_at
from inspector.ui.state import session_of
from tests.app.test_app_pages_a import page, start
from tests.unit.test_report import embedded

pytestmark = pytest.mark.app


def report_tools(at, app_file) -> list[dict]:
    at.switch_page(page(app_file, "overview")).run()
    at.button(key="ov_report_make").click().run()
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    html = list(session_of(at.session_state).memos["ov_report"].values())[-1]
    return embedded(html, "report-data")["tools"]


def test_the_head_atlas_computed_on_its_page_is_in_the_report(monkeypatch, tiny_model_dir, app_file, tmp_path):
    from inspector.session.models import shared_model
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(tmp_path))
    at = start(monkeypatch, app_file)
    assert report_tools(at, app_file) == []
    at.switch_page(page(app_file, "attention")).run()
    at.button(key="att_atlas_btn").click().run()
    assert not at.exception and not at.error
    (sec,) = report_tools(at, app_file)
    want = head_atlas(shared_model(str(tiny_model_dir), "cpu", "auto"))
    assert sec["id"] == "tool-atlas" and f"{want.layers} layers x {want.heads} heads" in sec["caption"]
    rows = [[name, rank + 1, r["layer"], r["head"], r[name]] for name in SCORE_NAMES
            for rank, r in enumerate(want.ranked(name, 5))]
    assert [r[:4] for r in sec["rows"]] == [r[:4] for r in rows]
    assert [r[4] for r in sec["rows"]] == pytest.approx([r[4] for r in rows], abs=1e-12, nan_ok=True)


def test_the_tuned_lens_shown_on_its_page_is_in_the_report(monkeypatch, tiny_model_dir, app_file, tmp_path):
    from inspector.session.models import shared_model
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(tmp_path))
    at = start(monkeypatch, app_file)
    at.switch_page(page(app_file, "activations")).run()
    at.button(key="act_tuned_fit").click().run()
    assert not at.exception and not at.error
    model = shared_model(str(tiny_model_dir), "cpu", "auto")
    run, lens = session_of(at.session_state).run, find_lens(model)
    pos = run.n_prompt - 1
    _, kl = lenses_at(model, run.ids, pos, lens, 10)
    (sec,) = report_tools(at, app_file)
    assert sec["id"] == "tool-tuned-lens" and f"at position {pos} of the run" in sec["caption"]
    assert [r[0] for r in sec["rows"]] == list(range(model.config.num_layers))
    assert [r[1] for r in sec["rows"]] == pytest.approx([k["logit_lens"] for k in kl], rel=1e-5, abs=1e-7)
    assert [r[2] for r in sec["rows"]] == pytest.approx([k["tuned_lens"] for k in kl], rel=1e-5, abs=1e-7)
