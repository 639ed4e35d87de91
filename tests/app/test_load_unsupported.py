"""A model this engine does not implement (issue 33, item 9): its failed load no longer says "reload the page after
30 s to try again" (a reload cannot give the engine an architecture); it says to choose another model. A load that
failed for another reason still offers the retry."""
from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

import inspector.session.models as models
from inspector.session.models import LOAD_RETRY_S, LoadState
from tests.bad_input import _config, broken_copy

pytestmark = pytest.mark.app


def test_an_unsupported_architecture_fails_as_unsupported(tmp_path, tiny_model_dir):
    d = broken_copy(tmp_path, tiny_model_dir, "bloom", lambda d: _config(d, model_type="bloom"))
    for _ in range(2):                     # the second time from the remembered failure (within LOAD_RETRY_S)
        load = models._Load()
        load.run(str(d), "cpu", "auto", "dequantized")
        state = load.state()
        assert state.error and "unsupported architecture" in state.error and state.unsupported
    half = broken_copy(tmp_path, tiny_model_dir, "cfg", lambda d: (d / "config.json").write_text("{"))
    load = models._Load()
    load.run(str(half), "cpu", "auto", "dequantized")
    assert load.state().error and not load.state().unsupported


def _box():
    from inspector.ui.common import load_box
    load_box()


@pytest.mark.parametrize("unsupported", [True, False])
def test_the_load_box_offers_a_retry_only_when_one_can_help(monkeypatch, unsupported):
    import inspector.ui.common as common
    monkeypatch.setattr(common, "chosen_load", lambda: LoadState(error="some reason", unsupported=unsupported))
    at = AppTest.from_function(_box).run()
    (err,) = at.error
    assert err.value.startswith("Could not load the model: some reason.") and "choose another model" in err.value
    assert (f"reload the page after {LOAD_RETRY_S} s" in err.value) is (not unsupported)
