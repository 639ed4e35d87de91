"""AppTest of the Attention page's head atlas (inspector.ui.atlas_panel): nothing is computed before its button;
the button computes it with no bar left behind, a scatter with one point per head at the atlas's own scores
(computed here independently of the page), and a table of every head; a rerun reuses the memoised atlas. A click on
the point labelled LlHh (the selection event a browser sends) opens layer l, head h in the page's own Layer and
Head controls, so the page's map is that head's pattern, with the head's best windows below; a forged point is
ignored with a message. A second session's page load reads the atlas from disk: it is computed once."""
from __future__ import annotations

import json

import pytest

import engine.tools.atlas_store as atlas_store
from engine.tools.head_atlas import head_atlas
from inspector.ui.state import session_of
from tests.app.test_app_pages_a import arr, chart, page, start

pytestmark = pytest.mark.app


@pytest.fixture
def computed(monkeypatch, tmp_path):
    """The atlas cache in tmp_path, and a count of the atlases computed (the store's head_atlas calls)."""
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(tmp_path))
    calls, real = [], atlas_store.head_atlas
    monkeypatch.setattr(atlas_store, "head_atlas", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def select_point(at, key: str, selection) -> None:
    """The event a browser sends when a user clicks a point of the chart `key` (st.plotly_chart on_select): the
    chart's widget state, a JSON selection. AppTest has no plotly element to click, so the run gets the widget
    states AppTest itself would send plus this one (its own _run with them)."""
    (el,) = [e for e in at.get("plotly_chart") if e.key == key]
    states = at._tree.get_widget_states()
    ws = states.widgets.add()
    ws.id, ws.string_value = el.proto.id, json.dumps({"selection": selection})
    at._run(states)


def points(*index) -> dict:
    return {"points": [{"point_index": i, "point_number": i, "curve_number": 0} for i in index],
            "point_indices": list(index), "box": [], "lasso": []}


def open_atlas(monkeypatch, tiny_model_dir, app_file):
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    at = start(monkeypatch, app_file)
    at.switch_page(page(app_file, "attention")).run()
    assert not at.exception, at.exception
    return at


def test_the_attention_page_computes_the_head_atlas_on_its_button(monkeypatch, tiny_model_dir, app_file, computed):
    from inspector.session.models import shared_model
    at = open_atlas(monkeypatch, tiny_model_dir, app_file)
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


def test_a_click_on_a_point_opens_its_head_and_a_forged_one_is_ignored(monkeypatch, tiny_model_dir, app_file,
                                                                      computed):
    from inspector.session.models import shared_model
    at = open_atlas(monkeypatch, tiny_model_dir, app_file)
    at.button(key="att_atlas_btn").click().run()
    model = shared_model(str(tiny_model_dir), "cpu", "auto")
    want = head_atlas(model)
    L, H = want.layers, want.heads
    assert (at.selectbox(key="att_layer").value, at.selectbox(key="att_head").value) == (0, None)
    spec = chart(at, "att_atlas_map")
    i = L * H - 2                                       # not the page's current choice
    layer, head = (int(s) for s in spec["data"][0]["text"][i].removeprefix("L").split("H"))    # the hover label
    assert (layer, head) != (0, 0)
    assert arr(spec["data"][0]["y"])[i] == pytest.approx(want.scores["induction"][layer, head], abs=1e-12)
    select_point(at, "att_atlas_map", points(i))
    assert not at.exception and not at.warning, [w.value for w in at.warning]
    assert (at.selectbox(key="att_layer").value, at.selectbox(key="att_head").value) == (layer, head)
    assert chart(at, "att_map")["layout"]["title"]["text"] == f"Layer {layer}, head {head}"
    kind = at.selectbox(key=f"att_atlas_kind_{layer}_{head}_previous-token_induction").value
    assert kind in ("previous-token", "induction")            # the scatter's axes: what the user looked at
    windows = want.top_windows(kind, layer, head)
    shown = [m.value for m in at.markdown if m.value[:3] in {f"{w['rank']}. " for w in windows}]
    assert len(shown) == len(windows) == 5
    assert [s.split("`")[1] for s in shown] == [f"{w['score']:.3f}" for w in windows]
    for forged in (points(L * H), points(-1), {"points": "L1H1"}, {"points": [{"point_index": "3"}]},
                   {"points": [{"point_index": 1, "curve_number": 4}]}):
        select_point(at, "att_atlas_map", forged)
        assert not at.exception, (forged, at.exception)
        assert any("click was ignored" in w.value for w in at.warning), forged
        assert (at.selectbox(key="att_layer").value, at.selectbox(key="att_head").value) == (layer, head)


def test_a_second_page_load_reads_the_atlas_from_disk(monkeypatch, tiny_model_dir, app_file, computed):
    at = open_atlas(monkeypatch, tiny_model_dir, app_file)
    at.button(key="att_atlas_btn").click().run()
    first = arr(chart(at, "att_atlas_map")["data"][0]["x"])
    assert len(computed) == 1
    again = open_atlas(monkeypatch, tiny_model_dir, app_file)         # another session: its memo is empty
    assert not again.exception and not [b for b in again.button if b.key == "att_atlas_btn"]
    assert arr(chart(again, "att_atlas_map")["data"][0]["x"]).tobytes() == first.tobytes()
    assert len(computed) == 1
    assert any("read from" in c.value for c in again.caption)
