"""AppTest of the Activations page's tuned lens (inspector.ui.lens_panel) on the tiny model, which ships no lens:
the page says "not fitted yet" and fits nothing before its button; the button fits one (no bar left behind) and
keeps it in the cache; then both lenses' top tokens side by side and one KL chart with both curves, at the numbers
engine.tools.tuned_lens.lenses_at computes here with the kept lens; a fresh session finds the kept lens and fits
nothing."""
from __future__ import annotations

import numpy as np
import pytest

from engine.tools.lens_file import find_lens
from engine.tools.tuned_lens import lenses_at
from inspector.ui.state import session_of
from tests.app.test_app_pages_a import arr, chart, find_df, page, start

pytestmark = pytest.mark.app


def test_the_activations_page_fits_the_tuned_lens_on_its_button_and_draws_both_curves(
        monkeypatch, tiny_model_dir, app_file, tmp_path):
    from inspector.session.models import shared_model
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(tmp_path))
    at = start(monkeypatch, app_file)
    at.switch_page(page(app_file, "activations")).run()
    assert not at.exception, at.exception
    assert any("Not fitted yet" in i.value for i in at.info)
    assert not [e for e in at.get("plotly_chart") if e.key == "act_tuned_kl"]
    model = shared_model(str(tiny_model_dir), "cpu", "auto")
    assert find_lens(model) is None
    at.button(key="act_tuned_fit").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert not at.get("progress") and not [b for b in at.button if b.label == "Stop"]
    lens = find_lens(model)                       # kept in the cache by the page's fit
    assert lens is not None and lens.recipe["corpus"] == "python-stdlib-docstrings:train"
    run = session_of(at.session_state).run
    pos, L = run.n_prompt - 1, model.config.num_layers
    tops, kl = lenses_at(model, run.ids, pos, lens, 10)
    spec = chart(at, "act_tuned_kl")
    assert [t["name"] for t in spec["data"]] == ["logit lens", "tuned lens"]
    for trace, col in zip(spec["data"], ("logit_lens", "tuned_lens")):
        assert arr(trace["x"]).tolist() == list(range(L))
        assert arr(trace["y"]).tolist() == pytest.approx([r[col] for r in kl], rel=1e-5, abs=1e-7)
    assert arr(spec["data"][0]["y"])[0] != pytest.approx(arr(spec["data"][1]["y"])[0])
    table = find_df(at, "layer", "logit lens", "tuned lens")
    assert table["tuned lens"].tolist() == pytest.approx([r["tuned_lens"] for r in kl], rel=1e-5, abs=1e-7)
    tuned = chart(at, "act_tuned_top_tuned")
    want = [[r["prob"] for r in tops if r["lens"] == "tuned lens" and r["layer"] == i][:5] for i in range(L)]
    np.testing.assert_allclose(arr(tuned["data"][0]["z"]), np.array(want), rtol=1e-5)
    assert chart(at, "act_tuned_top_logit")["data"][0]["z"] != tuned["data"][0]["z"]

    again = start(monkeypatch, app_file)          # a new session: the kept lens is found, no fit button
    again.switch_page(page(app_file, "activations")).run()
    assert not again.exception and not [b for b in again.button if b.key == "act_tuned_fit"]
    assert [t["name"] for t in chart(again, "act_tuned_kl")["data"]] == ["logit lens", "tuned lens"]
