"""AppTest of the NaN doctor, Repetition and Trace files pages, each run as its own script with a run put in
session_of(st.session_state).run; the sidebar's shared-model loader returns the session's already loaded model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import RunSettings, make_trace
from engine.generate import generate
from engine.inspection.trace import to_bytes
from engine.tools.doctor import fault_probe
from inspector.session.run import inspect_run
from inspector.ui.state import session_of
from tests.helpers import as_shown

ROOT = Path(__file__).resolve().parents[2]
LOOP_PROMPT = "I like apples. I like apples. I like"
OTHER_PAGES = ["overview", "tokens", "attention", "activations", "kv_cache", "sampling", "timeline"]


@pytest.fixture(scope="module")
def tiny_run(tiny_model):
    return inspect_run(tiny_model, RunSettings(prompt="one two three four five six", max_new_tokens=3))


def markdowns(at) -> str:
    return "\n".join([m.value for m in at.markdown] + [e.value for e in at.error] + [s.value for s in at.success])


def frame(at, *cols: str):
    """The last dataframe holding these columns (st.dataframe keys do not reach AppTest's element ids)."""
    hits = [e.value for e in at.dataframe if set(cols) <= set(e.value.columns)]
    assert hits, f"no dataframe with columns {cols}"
    return hits[-1]


def test_pages_without_a_run(page, tiny_model, tiny_model_dir):
    for name in ("nan_doctor", "repetition"):
        at = page(name, None, tiny_model, str(tiny_model_dir)).run()
        assert not at.exception and any("press **Run**" in i.value for i in at.info)
        assert not at.get("plotly_chart")
    at = page("trace_files", None, tiny_model, str(tiny_model_dir)).run()
    assert not at.exception and len(at.file_uploader) == 1 and not at.get("download_button")


def test_nan_doctor_names_the_planted_fault(page, tiny_model, tiny_model_dir, tiny_run):
    at = page("nan_doctor", tiny_run, tiny_model, str(tiny_model_dir)).run()
    assert not at.exception, at.exception
    assert "Every stage stayed finite" in at.success[0].value
    at.selectbox(key="nd_preset").set_value("custom").run()
    at.selectbox(key="nd_kind").set_value("nan").run()
    at.selectbox(key="nd_target").set_value("attn.v").run()
    at.number_input(key="nd_layer").set_value(1).run()
    at.number_input(key="nd_pos").set_value(4).run()
    at.button(key="nd_inject").click().run()
    assert not at.exception, at.exception
    text = markdowns(at)
    assert "stage **`blocks.1.attn.v`**, layer **1**, position **4**, step **0**" in text
    assert "nan@blocks.1.attn.v:4" in text
    metrics = {m.label: m.value for m in at.metric}
    assert (metrics["Stage"], metrics["Layer"], metrics["Position"], metrics["Step"]) == ("attn.v", "1", "4", "0")
    lead = frame(at, "stage", "layer", "absmax", "nan")
    row = lead[lead["stage"] == "blocks.1.attn.v"].iloc[0]
    assert row["nan"] == 1 and (lead.loc[:row.name, "nan"].iloc[:-1] == 0).all()
    assert any(c.key == "nd_fault_profile" for c in at.get("plotly_chart"))
    at.selectbox(key="nd_preset").set_value("rmsnorm-eps0").run()
    at.button(key="nd_inject").click().run()
    assert "stage **`blocks.0.attn_norm`**, layer **0**, position **2**" in markdowns(at)
    assert tiny_model.live_hooks == 0


def test_nan_doctor_precision_comparison(page, tiny_model, tiny_model_dir, tiny_run):
    at = page("nan_doctor", tiny_run, tiny_model, str(tiny_model_dir)).run()
    at.selectbox(key="nd_prec_dtype").set_value("bfloat16").run()
    at.number_input(key="nd_prec_thr").set_value(1e-4).run()
    at.button(key="nd_prec_run").click().run()
    assert not at.exception, at.exception
    table = frame(at, "stage", "rel_err", "max_abs_err")
    assert table["stage"].iloc[0] == "embed" and table["stage"].iloc[-1] == "logits"
    assert (table["rel_err"] > 0).all() and (table["rel_err"] < 0.5).all()
    assert "bfloat16: divergence begins at **`embed`**" in markdowns(at)   # one bf16 rounding > 1e-4
    assert {c.key for c in at.get("plotly_chart")} >= {"nd_prec_line", "nd_prec_heat"}


def test_trace_page_saves_and_opens_a_run(page, tiny_model, tiny_model_dir, tiny_run):
    at = page("trace_files", tiny_run, tiny_model, str(tiny_model_dir)).run()
    assert not at.exception and len(at.get("download_button")) == 1
    assert "3 generated tokens" in at.caption[0].value
    probe = fault_probe(tiny_model, ["inf@blocks.0.mlp.gate:2"], timing=True).capture("logits")
    res = generate(tiny_model, [5, 6, 7, 8], max_new_tokens=2, ignore_eos=True, probe=probe)
    bad = make_trace(RunSettings(prompt="five six", chat=False, max_new_tokens=2), res, probe, tiny_model.name, 0.5)
    at.file_uploader[0].set_value(("nan.trace", to_bytes(bad), "application/octet-stream"))
    at.run()
    assert not at.exception, at.exception
    assert "first non-finite: `blocks.0.mlp.gate` layer 0, position 2, step 0" in markdowns(at)
    at.button(key="tf_open").click().run()
    opened = session_of(at.session_state).run
    assert opened.ids == bad.ids and opened.settings == bad.settings
    assert len(opened.recording.stats) == len(probe.recording.stats)
    doc = page("nan_doctor", opened, tiny_model, str(tiny_model_dir)).run()
    assert "stage **`blocks.0.mlp.gate`**, layer **0**, position **2**, step **0**" in markdowns(doc)
    at.file_uploader[0].set_value(("junk.trace", b"\x00" * 40, "application/octet-stream")).run()
    assert "Could not open junk.trace" in as_shown(at.error[0].value)


def test_other_pages_read_a_reopened_trace(page, tiny_model, tiny_model_dir, tiny_run):
    """Every existing page works from a trace as from a fresh run (attention and the logit lens re-run the
    model, which is loaded)."""
    from engine.inspection.trace import from_bytes
    opened = from_bytes(to_bytes(tiny_run))
    for name in OTHER_PAGES:
        if not (ROOT / "pages" / f"{name}.py").is_file():
            continue
        at = page(name, opened, tiny_model, str(tiny_model_dir)).run()
        assert not at.exception, (name, at.exception)
        assert not any("press **Run**" in i.value for i in at.info), name


@pytest.mark.model                  # the bundled weights: the model tier, outside the quick loop
def test_repetition_page_lists_the_loop(page, bundled_model):
    # 20 tokens: three copies of a 6-token piece, running to the end (a loop: engine.inspection.loops)
    run = inspect_run(bundled_model, RunSettings(prompt=LOOP_PROMPT, chat=False, max_new_tokens=20, timing=False))
    at = page("repetition", run, bundled_model, None).run()
    assert not at.exception, at.exception
    loops = frame(at, "start", "period", "count", "repeated text")
    assert loops[["start", "period", "count", "end"]].values.tolist() == [[1, 6, 3, 20]]
    assert loops["repeated text"].iloc[0] == ".·I'm·a·big·apple"
    html = "".join(h.proto.body for h in at.get("html"))
    assert html.count('class="loop"') == 19 and "period 6" in html
    curves = json.loads([c for c in at.get("plotly_chart") if c.key == "rep_curves"][0].proto.spec)
    assert curves["data"][0]["name"] == "model prob"
    attn = frame(at, "position", "copy", "weight → copy")
    assert attn["position"].tolist() == list(range(run.n_prompt + 7, run.n_prompt + 20))
    assert (attn["copy"] == attn["position"] - 6).all()
    at.multiselect(key="rep_variants").set_value(["frequency penalty 0.5"]).run()
    at.button(key="rep_compare").click().run()
    assert not at.exception, at.exception
    table = frame(at, "setting", "breaks the loop")
    assert table["setting"].tolist() == ["as run", "frequency penalty 0.5"]
    assert table["breaks the loop"].tolist() == [False, True]
