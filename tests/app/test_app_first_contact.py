"""AppTest of what a class meets first: the demo runs each produce what they promise (on the bundled model),
every chart the pages hand to Streamlit keeps its own colours under the chart theme, a run whose logits
went non-finite says so on every page, an out-of-range number is said, and the queue wait excludes the run."""
from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from engine import GenerationRun, inspection_probe, make_trace
from engine.model import Model
from inspector.session.admission import shared_admission
from inspector.session.limits import Limits
from inspector.session.models import model_choices
from inspector.ui.state import session_of
from inspector.views.theme import PLACEHOLDERS, placeholder_colours

PAGES = ["overview", "tokens", "attention", "activations", "kv_cache", "sampling", "timeline", "debugger",
         "nan_doctor", "repetition", "trace_files"]


def page(app_file: Path, name: str) -> str:
    (hit,) = [p for p in ("pages", "views") if (app_file.parent / p / f"{name}.py").is_file()]
    return f"{hit}/{name}.py"


def fresh_app(monkeypatch, app_file, model_dir=None) -> AppTest:
    from streamlit.runtime.pages_manager import PagesManager
    monkeypatch.setattr(PagesManager, "uses_pages_directory", None)
    if model_dir is None:
        monkeypatch.delenv("LLM_INSPECTOR_MODEL", raising=False)
    else:
        monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(model_dir))
    model_choices.clear()
    at = AppTest.from_file(str(app_file), default_timeout=300)
    at.run()
    assert not at.exception, at.exception
    return at


def shown_page(at: AppTest) -> str:
    return at.header[0].value if at.header else ""


def charts(at: AppTest) -> list[dict]:
    return [json.loads(e.proto.spec) for e in at.get("plotly_chart")]


def assert_colours_survive_the_theme(at: AppTest, where: str) -> int:
    """Every figure the page passed to Streamlit: no colour the chart theme would replace, and every heatmap
    with an explicit colour scale (a list, not a name the theme resolves) whose lowest colour is its own."""
    heatmaps = 0
    for fig in charts(at):
        assert not placeholder_colours(fig), where      # outside layout.template, which is the theme's own
        assert "#000001" in json.dumps(fig["layout"].get("template", {})) or not fig["layout"].get("template")
        for tr in fig["data"]:
            if tr.get("type") == "heatmap":
                heatmaps += 1
                scale = tr.get("colorscale")
                assert isinstance(scale, list) and len(scale) >= 2, (where, scale)
                assert scale[0][0] == 0 and scale[0][1].lower() not in PLACEHOLDERS, (where, scale[0])
    return heatmaps


@pytest.mark.model
def test_demo_runs_show_their_lesson_and_every_chart_keeps_its_colours(monkeypatch, app_file):
    at = fresh_app(monkeypatch, app_file)
    assert [b.key for b in at.main.button] == ["ov_demo_sampling", "ov_demo_loop", "ov_demo_nan"]

    # a repetition loop: the run loops, the Repetition page opens and finds it
    at.button(key="ov_demo_loop").click().run()
    assert not at.exception, at.exception
    run = session_of(at.session_state).run
    assert run.settings.prompt.startswith("I like apples") and run.settings.params.temperature == 0
    assert shown_page(at) == "Repetition" and run.loops
    assert any("loop(s) in" in w.value for w in at.warning)
    assert at.dataframe[0].value["period"].iloc[0] == run.loops[0].period

    # sampling: T=1, top-p 0.9 run; Sampling opens with (T 1.5, top-p 0.5) and (T 0.7, top-p 0.9) beside it
    at.button(key="sb_demo_sampling").click().run()
    assert not at.exception, at.exception
    run = session_of(at.session_state).run
    assert (run.settings.params.temperature, run.settings.params.top_p) == (1.0, 0.9)
    assert shown_page(at) == "Sampling"
    summary = [d.value for d in at.dataframe if "mass_kept" in d.value.columns][0].set_index("setting")
    assert summary["params"].tolist() == ["T=1 top-p=0.9", "T=1.5 top-p=0.5", "T=0.7 top-p=0.9"]
    assert summary["entropy"].nunique() == 3 and summary["kept"].nunique() >= 2     # three different answers
    assert any("temperature → top-k → top-p" in i.value for i in at.info)           # the chain order said

    # a NaN fault: the NaN doctor opens, runs the preset and locates the NaN; the logits are never sampled
    at.button(key="sb_demo_nan").click().run()
    assert not at.exception, at.exception
    assert shown_page(at) == "NaN / Inf doctor"
    (report,) = session_of(at.session_state).memos["nd_reports"].values()
    nf = report.first_nonfinite
    assert (nf.step, nf.stage, nf.layer, nf.position) == (0, "blocks.17.mlp.act", 17, 3)
    assert report.result.stop_reason == "non-finite logits" and report.result.token_ids == []
    assert any("non-finite logits" in e.value for e in at.error)
    lead = [d.value for d in at.dataframe if "where" in d.value.columns][0]
    assert lead.loc[lead["where"] != "", "stage"].tolist() == ["blocks.17.mlp.act"]

    # every page of the last run: no exception, and every chart's colours are its own
    heatmaps = 0
    for name in PAGES:
        at.switch_page(page(app_file, name)).run()
        assert not at.exception, (name, at.exception)
        heatmaps += assert_colours_survive_the_theme(at, name)
    at.switch_page(page(app_file, "repetition")).run()
    at.button(key="rep_compare").click().run()                  # (no loop in this run: no copy-attention map)
    assert heatmaps >= 4                                        # attention map + entropy, activations, lens, ...


def nan_logits_trace(model):
    """A real run of the tiny model whose logits are NaN from step 2: what the app keeps of such a run."""
    def nan_at_2(x, ctx):
        return torch.full_like(x, float("nan")) if ctx.step == 2 else None
    probe = inspection_probe().replace("logits", nan_at_2)
    run = GenerationRun(model, "What is the capital of France?", chat=True, max_new_tokens=6, probe=probe,
                        ignore_eos=True)
    from engine import RunSettings
    return make_trace(RunSettings(prompt="What is the capital of France?", max_new_tokens=6), run.run(), probe,
                      model.name, 0.1)


def test_a_run_stopped_by_nonfinite_logits_reads_so_on_every_page(monkeypatch, app_file, tiny_model_dir,
                                                                    tiny_model):
    at = fresh_app(monkeypatch, app_file, tiny_model_dir)
    trace = nan_logits_trace(at_model := tiny_model)
    assert trace.result.stop_reason == "non-finite logits" and len(trace.result.token_ids) == 2
    session_of(at.session_state).run, session_of(at.session_state).runs = trace, [trace]
    assert at_model.name == trace.model_name
    for name in PAGES:
        at.switch_page(page(app_file, name)).run()
        assert not at.exception, (name, at.exception)
        if name == "overview":
            (err,) = at.error
            assert "step 2's logits held" in err.value and "no token was drawn" in err.value
            assert {"NaN doctor: where it began, and why", "Activations: every NaN/Inf cell"} <= {
                link.proto.label for link in at.get("page_link")}
            assert {m.label: m.value for m in at.metric}["Stop reason"] == "non-finite logits"
        if name == "nan_doctor":
            assert any("Stop reason **non-finite logits**: at step 2" in e.value for e in at.error)


def test_out_of_range_max_new_tokens_is_said_not_ignored(monkeypatch, app_file, tiny_model_dir):
    monkeypatch.setenv("LLM_INSPECTOR_MAX_NEW_TOKENS", "8")
    at = fresh_app(monkeypatch, app_file, tiny_model_dir)
    at.sidebar.number_input(key="sb_max_new").set_value(5000).run()
    (w,) = [w for w in at.sidebar.warning if "Max new tokens" in w.value]
    assert "5,000 is more than this server generates per run (8" in w.value and "at most 8" in w.value
    at.sidebar.button(key="sb_run").click().run()
    assert not at.exception and session_of(at.session_state).run.settings.max_new_tokens == 8
    at.sidebar.number_input(key="sb_max_new").set_value(5).run()
    assert not [w for w in at.sidebar.warning if "Max new tokens" in w.value]


def test_the_queue_wait_excludes_the_run_itself(monkeypatch, app_file, tiny_model_dir):
    """One slot, held by another client for HOLD seconds; the run then takes RUN_S more (each forward slowed).
    The caption must say about HOLD seconds, not HOLD + RUN_S."""
    hold_s, slow_s = 2.0, 0.25
    monkeypatch.setenv("LLM_INSPECTOR_MAX_CONCURRENT_RUNS", "1")
    at = fresh_app(monkeypatch, app_file, tiny_model_dir)
    forward = Model.forward

    def slow_forward(self, *a, **kw):
        time.sleep(slow_s)
        return forward(self, *a, **kw)
    monkeypatch.setattr(Model, "forward", slow_forward)
    held, leave = threading.Event(), threading.Event()

    def hold():
        with shared_admission(Limits.from_env()).slot(client="another browser"):
            held.set()
            leave.wait(hold_s)
    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    t0 = time.monotonic()
    at.sidebar.number_input(key="sb_max_new").set_value(6)
    at.sidebar.button(key="sb_run").click().run()
    total = time.monotonic() - t0
    holder.join(10)
    assert not at.exception, at.exception
    run = session_of(at.session_state).run
    (cap,) = [c.value for c in at.sidebar.caption if "in the queue" in c.value]
    waited = float(re.search(r"waited ([\d.]+) s in the queue", cap).group(1))
    assert run.seconds >= 6 * slow_s and total >= hold_s + run.seconds - 0.5
    assert hold_s - 0.5 <= waited <= hold_s + 1.0 < hold_s + run.seconds         # the run is not counted
    assert f"generated for {run.seconds:.1f} s" in cap
