"""AppTest of inspector.ui.common.on_demand: a page computing a map shows the map with no progress bar or Stop
button left behind; a stop leaves "Stopped" with a button to compute again and nothing memoised."""
from __future__ import annotations

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from inspector.ui.state import session_of
from tests.app.test_app_pages_a import arr, chart, page, start

pytestmark = pytest.mark.app


def stopping_page():
    """A page computing on demand on its own button (as the costly views do); its first computation is stopped
    at layer 2, as a Stop click landing while it runs does (the click's callback marks the computation
    stopped; the next layer hears STOP)."""
    import streamlit as st

    from engine.progress import STOP, Progress, Stopped
    from inspector.ui.common import _tag, on_demand, was_stopped
    from inspector.ui.state import session_of

    store = st.session_state.setdefault("store", {})
    tries = st.session_state.setdefault("tries", [])

    def compute(tell):                  # four layers, as engine.progress.LayerProgress tells them
        tries.append([])
        for i in range(1, 5):
            if len(tries) == 1 and i == 2:
                session_of(st.session_state).stopped[_tag("the thing", "k")] = "stopped"   # what Stop does
            tries[-1].append(i)
            if tell(Progress(0, 10, 10, i, 4)) is STOP:
                raise Stopped
        return "computed"

    if "k" in store or was_stopped("the thing", "k") or st.button("Compute it"):
        st.write(f"value: {on_demand(store, 'k', 'the thing', compute)}")


def test_a_stop_shows_stopped_and_compute_again_computes_it():
    at = AppTest.from_function(stopping_page, default_timeout=60).run()
    assert not at.session_state["tries"]
    at.button[0].click().run()
    assert not at.exception, at.exception
    assert at.session_state["tries"] == [[1, 2]]              # layer 2 was answered STOP: nothing after it ran
    assert at.session_state["store"] == {}                    # nothing half-computed memoised
    assert [w.value for w in at.warning] == ["Stopped: the thing was not computed."]
    assert "Compute again" in [b.label for b in at.button]
    at.run()                                                  # a rerun does not restart it on its own ...
    assert len(at.session_state["tries"]) == 1 and at.warning
    assert [b.label for b in at.button] == ["Compute again"]  # ... nor offers the page's own button
    at.button[0].click().run()
    assert not at.exception, at.exception
    assert at.session_state["tries"][-1] == [1, 2, 3, 4]
    assert at.session_state["store"] == {"k": "computed"}
    assert not at.warning and not at.button and any("value: computed" in m.value for m in at.markdown)
    assert not session_of(at.session_state).stopped


def test_the_attention_page_computes_its_map_with_progress_and_leaves_no_bar(monkeypatch, tiny_model_dir, app_file):
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    at = start(monkeypatch, app_file)
    at.switch_page(page(app_file, "attention")).run()
    assert not at.exception, at.exception
    assert chart(at, "att_map")["data"][0]["z"] and chart(at, "att_entropy")["data"]
    assert not at.get("progress") and not [b for b in at.button if b.label == "Stop"]
    memos = session_of(at.session_state).memos
    assert len(memos["att_maps"]) == 1 and len(memos["att_overviews"]) == 1
    at.selectbox(key="att_layer").set_value(1).run()          # a second map: the rate measured by the first
    assert not at.exception and len(session_of(at.session_state).memos["att_maps"]) == 2


def test_the_attention_page_splits_a_heads_score_into_the_streams_parts(monkeypatch, tiny_model_dir, app_file):
    """Why does it look there: head 1 of layer 1, the last query to key 2 — the map's cells sum to the score the
    page states, which is the forward's own score (attn.scores, captured here independently)."""
    from engine import Probe
    from inspector.session.models import shared_model
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    at = start(monkeypatch, app_file)
    at.switch_page(page(app_file, "attention")).run()
    assert not at.exception
    assert any("Choose one head" in i.value for i in at.info)
    at.selectbox(key="att_layer").set_value(1)
    at.selectbox(key="att_head").set_value(1).run()
    at.number_input(key="qk_key").set_value(2)
    at.button(key="qk_run").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    spec = chart(at, "qk_map")
    total = float(np.sum(arr(spec["data"][0]["z"])))
    ids = session_of(at.session_state).run.ids
    probe = Probe().capture("blocks.1.attn.scores")
    shared_model(str(tiny_model_dir), "cpu", "auto").logits(ids, probe)
    score = float(probe.recording.captured("blocks.1.attn.scores")[0].value[1, len(ids) - 1, 2])
    assert abs(total - score) <= 1e-5 * max(1.0, abs(score))
    assert any(f"Score {score:.5g}" in c.value for c in at.caption)
