"""AppTest of the prescribing doctors: the Quantization page (run as its own script with a run as the session's
current run, SessionState.run), and the why-loop and rescue sections (inspector.ui.prescriptions) through a small
script that calls them with a run and a model put in st.session_state, as the Repetition and NaN doctor pages will."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from streamlit.testing.v1 import AppTest

from engine import RunSettings
from engine.model import Model
from engine.weights import Weights
from inspector.session.run import inspect_run
from inspector.ui.state import session_of
from inspector.views import prescribe as pv

pytestmark = pytest.mark.app
ROOT = Path(__file__).resolve().parents[2]
LOOP_PROMPT = "I like apples. I like apples. I like"
OVERFLOW = "scale=1e6@blocks.1.mlp_out"
SECTION = """
import streamlit as st
from inspector.ui.prescriptions import {name}
{name}(st.session_state["pr_run"], st.session_state["pr_model"])
"""


@pytest.fixture
def page(monkeypatch):
    """page(name, run, model, source) -> an AppTest of pages/<name>.py with `run` as the session's run."""
    from streamlit.runtime.pages_manager import PagesManager

    import inspector.session.models as models
    monkeypatch.setattr(PagesManager, "uses_pages_directory", None)

    def make(name: str, run, model: Model, source: str) -> AppTest:
        monkeypatch.setattr(models, "load_model", lambda *a, **k: model)
        monkeypatch.setenv("LLM_INSPECTOR_MODEL", source)
        models.model_choices.clear()
        models.shared_model.clear()
        models.shared_model(source, "cpu", "auto")      # cached outside a script run: no replayed progress bar
        at = AppTest.from_file(str(ROOT / "pages" / f"{name}.py"), default_timeout=600)
        session_of(at.session_state).run = run
        return at
    return make


def section(name: str, run, model: Model) -> AppTest:
    at = AppTest.from_string(SECTION.format(name=name), default_timeout=600)
    at.session_state["pr_run"], at.session_state["pr_model"] = run, model
    return at


@pytest.fixture
def forward_calls(monkeypatch):
    n = {"forward": 0}
    fwd = Model.forward

    def forward(self, *a, **kw):
        n["forward"] += 1
        return fwd(self, *a, **kw)
    monkeypatch.setattr(Model, "forward", forward)
    return n


@pytest.fixture(scope="module")
def looper(tiny_model) -> Model:
    """The tiny model looping by its weights alone (see tests/unit/test_prescribe.py): the stream is the current
    token's embedding and the unembedding maps the prompt's last token A -> 1000 -> 2000 -> A."""
    w, cfg = tiny_model.weights, tiny_model.config
    a = tiny_model.tokenizer.encode(LOOP_PROMPT)[-1]
    layers = [dataclasses.replace(lw, wo=torch.zeros_like(lw.wo), w_down=torch.zeros_like(lw.w_down))
              for lw in w.layers]
    head, e = w.lm_head.clone(), F.rms_norm(w.embed, (cfg.hidden_size,), w.norm, cfg.rms_norm_eps)
    for src, dst in zip([a, 1000, 2000], [1000, 2000, a]):
        head[:, dst] = 20 * e[src] / e[src].norm()
    return Model(cfg, Weights(w.embed, layers, w.norm, head), tiny_model.tokenizer, device=tiny_model.device,
                 dtype=tiny_model.dtype, name="tiny looper")


@pytest.fixture(scope="module")
def tiny_run(tiny_model):
    return inspect_run(tiny_model, RunSettings(prompt=LOOP_PROMPT, chat=False, max_new_tokens=6))


def frame(at, *cols: str):
    hits = [e.value for e in at.dataframe if set(cols) <= set(e.value.columns)]
    assert hits, f"no dataframe with columns {cols}"
    return hits[-1]


def charts(at) -> dict:
    return {c.key: c for c in at.get("plotly_chart")}


def test_quantization_page_compares_formats_and_display_changes_run_nothing(page, tiny_model, tiny_model_dir,
                                                                             tiny_run, forward_calls):
    at = page("quantization", tiny_run, tiny_model, str(tiny_model_dir)).run()
    assert not at.exception, at.exception
    assert not at.get("plotly_chart") and forward_calls["forward"] == 0          # nothing before the button
    at.multiselect(key="qz_formats").set_value(["F32", "Q8_0", "Q4_0"]).run()
    at.button(key="qz_run").click().run()
    assert not at.exception, at.exception
    summary = frame(at, *pv.SUMMARY_COLUMNS).set_index("format")
    assert list(summary.index) == ["F32", "Q8_0", "Q4_0"] and summary.loc["F32", "KL mean (nats)"] == 0.0
    assert summary.loc["Q8_0", "KL mean (nats)"] < summary.loc["Q4_0", "KL mean (nats)"]
    figs = charts(at)
    assert {"qz_layers", "qz_steps", "qz_heat"} <= set(figs)
    runs = forward_calls["forward"]
    at.number_input(key="qz_threshold").set_value(0.001).run()
    at.toggle(key="qz_log").set_value(True).run()
    at.selectbox(key="qz_heat_fmt").set_value("Q4_0").run()
    assert not at.exception and forward_calls["forward"] == runs                 # display only
    assert frame(at, *pv.SUMMARY_COLUMNS).set_index("format").loc["Q4_0", "first layer over"] == 0


def test_why_loop_section_diagnoses_the_runs_own_loop_and_lists_each_rerun(looper, forward_calls):
    run = inspect_run(looper, RunSettings(prompt=LOOP_PROMPT, chat=False, max_new_tokens=16))
    at = section("why_loop_section", run, looper).run()
    assert not at.exception, at.exception
    at.button(key="wl_run").click().run()
    assert not at.exception, at.exception
    assert at.warning[0].value.startswith("Your run's 16 generated tokens end in a loop from step 0 with period 3")
    causes = frame(at, *pv.CAUSE_COLUMNS)
    # the looper's cycle survives every change (tests/unit/test_prescribe.py): each rerun kept it
    assert (causes["outcome"] == "loop kept").all() and causes["verdict"].str.startswith("loop kept").all()
    assert set(causes["kind"]) == {"heads", "sampler", "numerics", "prompt"}
    assert "wl_causes_fig" in charts(at)
    runs = forward_calls["forward"]
    at.run()                                                                     # kept in the session
    assert forward_calls["forward"] == runs and len(frame(at, *pv.CAUSE_COLUMNS)) == len(causes)


def test_why_loop_section_says_no_loop_for_a_loop_free_run(tiny_model, tiny_run):
    at = section("why_loop_section", tiny_run, tiny_model).run()
    assert "This run's 6 generated tokens hold no loop: there is nothing to diagnose" in at.info[0].value
    assert at.button(key="wl_run").label == "Look further (64 tokens)"
    at.button(key="wl_run").click().run()
    assert not at.exception, at.exception
    assert at.success[0].value.startswith("Your run's 6 generated tokens hold no loop, and neither does a longer "
                                          "rerun of the same prompt and seed (64 tokens asked)")
    assert not at.dataframe


def test_rescue_section_finds_the_set_and_names_a_bad_fault(tiny_model, tiny_run):
    at = section("rescue_section", tiny_run, tiny_model).run()
    assert not at.exception, at.exception
    at.button(key="rs_run").click().run()                     # the fp16-overflow preset aims at layer 11
    assert not at.exception and "unknown stage 'blocks.11.mlp.act'" in at.error[0].value
    at.selectbox(key="rs_preset").set_value("custom").run()
    at.text_input(key="rs_inject").set_value(OVERFLOW).run()
    at.button(key="rs_run").click().run()
    assert not at.exception, at.exception
    assert "keep **blocks.1.resid** in fp32" in at.warning[0].value
    trials = frame(at, *pv.TRIAL_COLUMNS)
    assert trials["first non-finite"].iloc[0] == "blocks.1.mlp_out" and not trials["finite"].iloc[-1]
    assert {m.label: m.value for m in at.metric}["Complement fixes it"] == "no"
    assert "rs_units_fig" in charts(at)
    assert "--fp32 blocks.1.resid" in at.code[0].value and OVERFLOW in at.code[0].value


SCORED = ["The river rose slowly through the night and the fields went under water.",
          "To make bread, mix flour, water, salt and yeast, then knead it for ten minutes."]


def test_quantization_page_scoreboard_shows_llama_cpps_figures_per_format(page, tiny_model, tiny_model_dir, tiny_run,
                                                                         forward_calls):
    from engine.tools.quant_scoreboard import scoreboard
    from inspector.views import scoreboard as sv
    at = page("quantization", tiny_run, tiny_model, str(tiny_model_dir)).run()
    assert not at.exception, at.exception
    assert forward_calls["forward"] == 0 and at.text_area(key="qsb_texts").value.count("\n\n") >= 7  # the built-in set
    at.text_area(key="qsb_texts").set_value("\n\n".join(SCORED)).run()
    at.button(key="qsb_run").click().run()
    assert not at.exception, at.exception
    summary = frame(at, *sv.SUMMARY_COLUMNS).set_index("format")
    want = scoreboard(tiny_model, SCORED, ["Q8_0", "Q4_0"])
    assert list(summary.index) == ["Q8_0", "Q4_0"]
    for fmt in ("Q8_0", "Q4_0"):
        assert summary.loc[fmt, "Mean KLD"] == pytest.approx(want.result(fmt).mean_kld.value, rel=1e-12)
        assert summary.loc[fmt, "Same top p (%)"] == pytest.approx(100 * want.result(fmt).same_top.value)
    tables = [e.value for e in at.dataframe if list(e.value.columns) == sv.FORMAT_COLUMNS]
    assert len(tables) == 2 and "Mean    KLD" in set(tables[0]["statistic"])


def test_quantization_page_scoreboard_refuses_too_many_tokens_before_any_work(page, tiny_model, tiny_model_dir,
                                                                              tiny_run, forward_calls):
    at = page("quantization", tiny_run, tiny_model, str(tiny_model_dir)).run()
    at.text_area(key="qsb_texts").set_value("one two three four five six seven eight nine ten " * 120).run()
    assert not at.exception, at.exception
    errors = [e.value.replace("\\", "") for e in at.error]                 # the page escapes Markdown
    assert any("tokens (1 text); at most 1,024 are scored here" in e for e in errors), errors
    assert not [b for b in at.button if b.key == "qsb_run"] and forward_calls["forward"] == 0
