"""AppTest of the Attention page's head atlas (inspector.ui.atlas_panel): nothing is computed before its button;
the button computes it with no bar left behind, a scatter with one point per head at the atlas's own scores
(computed here independently of the page), and a table of every head; a rerun reuses the memoised atlas."""
from __future__ import annotations

import pytest

from engine.tools.head_atlas import head_atlas
from inspector.ui.state import session_of
from tests.app.test_app_pages_a import arr, chart, page, start

pytestmark = pytest.mark.app


def test_the_attention_page_computes_the_head_atlas_on_its_button(monkeypatch, tiny_model_dir, app_file):
    from inspector.session.models import shared_model
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    at = start(monkeypatch, app_file)
    at.switch_page(page(app_file, "attention")).run()
    assert not at.exception, at.exception
    assert "att_atlas" not in session_of(at.session_state).memos or not session_of(at.session_state).memos["att_atlas"]
    assert any("score every head" in i.value for i in at.info)
    at.button(key="att_atlas_btn").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert not at.get("progress") and not [b for b in at.button if b.label == "Stop"]
    spec = chart(at, "att_atlas_map")
    model = shared_model(str(tiny_model_dir), "cpu", "auto")
    want = head_atlas(model)
    L, H = want.layers, want.heads
    x, y = arr(spec["data"][0]["x"]), arr(spec["data"][0]["y"])
    assert len(x) == L * H
    assert x.tolist() == pytest.approx(want.scores["previous-token"].reshape(-1).tolist(), abs=1e-12)
    assert y.tolist() == pytest.approx(want.scores["induction"].reshape(-1).tolist(), abs=1e-12)
    assert len(session_of(at.session_state).memos["att_atlas"]) == 1
    at.selectbox(key="att_atlas_x").set_value("self").run()     # a rerun: the memoised atlas, redrawn
    assert not at.exception
    assert arr(chart(at, "att_atlas_map")["data"][0]["x"]).tolist() == pytest.approx(
        want.scores["self"].reshape(-1).tolist(), abs=1e-12)
    assert len(at.dataframe) >= 1
