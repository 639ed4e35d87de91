"""The Overview page's take-home report: made on a button press, offered for download, its numbers the run's,
its command line naming the model by folder name (never the server's path)."""
from __future__ import annotations

import torch

from engine import RunSettings, SamplingParams
from engine.tools.steering import steer, steering_vector

from inspector.ui.state import session_of
from tests.unit.test_report import embedded, hostile_run  # noqa: F401  (hostile_run: a fixture)


def test_the_overview_page_offers_the_report_for_download(page, tiny_model, tiny_model_dir, hostile_run):  # noqa: F811
    at = page("overview", hostile_run, tiny_model, str(tiny_model_dir)).run()
    assert not at.exception
    assert not at.get("download_button")
    at.button(key="ov_report_make").click().run()
    assert not at.exception
    (btn,) = at.get("download_button")
    assert "Download report (HTML)" in str(btn.proto)
    (html,) = session_of(at.session_state).memos["ov_report"].values()
    data = embedded(html, "report-data")
    assert data["token_ids"] == hostile_run.result.token_ids and len(data["attention"]) == 2
    # the model's folder name, never the server's path to it
    assert f"--model {tiny_model_dir.name}" in data["command"] and str(tiny_model_dir) not in data["command"]
    assert torch.equal(torch.tensor(data["prompt_ids"]), torch.tensor(hostile_run.result.prompt_ids))


def test_the_report_shows_the_steering_this_session_computed(page, tiny_model, tiny_model_dir, hostile_run):  # noqa: F811
    """Issue 47: a tool run beside the run (here steering, as the Compare runs page keeps it) appears in the report's
    Tools section with the tool's own per-step numbers; a report made before it does not show it, one made after
    does."""
    at = page("overview", hostile_run, tiny_model, str(tiny_model_dir)).run()
    at.button(key="ov_report_make").click().run()
    (before,) = session_of(at.session_state).memos["ov_report"].values()
    assert embedded(before, "report-data")["tools"] == []
    vec = steering_vector(tiny_model, ["I love it"], ["I hate it"], 1)
    settings = RunSettings(prompt="Tell me", max_new_tokens=3, params=SamplingParams(temperature=0))
    steered = {**steer(tiny_model, settings, vec, 30.0).as_dict(), "norm": vec.norm, "stage": vec.stage}
    session_of(at.session_state).steered = steered
    at.run()
    at.button(key="ov_report_make").click().run()
    assert not at.exception
    html = list(session_of(at.session_state).memos["ov_report"].values())[-1]
    (tool,) = embedded(html, "report-data")["tools"]
    assert tool["id"] == "tool-steering" and vec.stage in tool["caption"]
    assert [r[2] for r in tool["rows"]] == [s["kl_steered_plain"] for s in steered["steps"]]
