"""Issue 21, item 8: the NaN doctor's details. A row of NaN only reads NaN (not min "Infinity", max "-Infinity",
mean "None"), counts read as whole numbers, the headline has one pair of parentheses, the profile's markers
after the first NaN/Inf stand apart (one labelled column per stage), and the fp16-overflow preset says what the
run finds: the ×4 activation still fits float16, its down projection (mlp_out) overflows."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from engine import RunSettings
from engine.tools.doctor import FP16_MAX, PRESETS, fault_probe
from inspector.session.run import inspect_run
from inspector.views.doctor import WINDOW

pytestmark = pytest.mark.app
FOX = "The quick brown fox"


@pytest.fixture(scope="module")
def tiny_run(tiny_model):
    return inspect_run(tiny_model, RunSettings(prompt="one two three four five six", max_new_tokens=2))


def lead_table(at):
    hits = [e.value for e in at.dataframe if {"where", "stage", "absmax", "nan", "inf"} <= set(e.value.columns)]
    assert hits, "no lead-up table"
    return hits[-1]


def profile_spec(at, key: str) -> dict:
    """The chart as sent to the browser, with plotly's packed arrays (bdata) read back as lists."""
    (chart,) = [c for c in at.get("plotly_chart") if c.key == key]

    def unpack(v):
        if isinstance(v, dict) and "bdata" in v:
            return np.frombuffer(base64.b64decode(v["bdata"]), dtype=v["dtype"]).tolist()
        if isinstance(v, dict):
            return {k: unpack(x) for k, x in v.items()}
        return [unpack(x) for x in v] if isinstance(v, list) else v
    return unpack(json.loads(chart.proto.spec))


def test_a_nan_only_row_reads_nan_and_counts_are_whole(page, tiny_model, tiny_model_dir, tiny_run):
    """NaN at layer 0's MLP activation, position 2: its down projection (mlp_out) mixes that NaN into every one
    of the hidden_size outputs, so mlp_out's row holds nothing but NaN."""
    at = page("nan_doctor", tiny_run, tiny_model, str(tiny_model_dir)).run()
    at.selectbox(key="nd_preset").set_value("custom").run()
    at.selectbox(key="nd_kind").set_value("nan").run()
    at.selectbox(key="nd_target").set_value("mlp.act").run()
    at.number_input(key="nd_layer").set_value(0).run()
    at.number_input(key="nd_pos").set_value(2).run()
    at.button(key="nd_inject").click().run()
    assert not at.exception, at.exception
    head = [e.value for e in at.error if e.value.startswith("First non-finite value")][-1]
    assert "step **0** (the prompt's prefill)" in head and "((" not in head and "))" not in head
    lead = lead_table(at)
    first = lead[lead["stage"] == "blocks.0.mlp.act"].iloc[0]
    assert first["where"].startswith("◀") and first["nan"] == 1 and first["inf"] == 0
    out = lead[lead["stage"] == "blocks.0.mlp_out"].iloc[0]
    assert [out[c] for c in ("min", "max", "mean", "std", "absmax")] == ["NaN"] * 5
    assert out["nan"] == tiny_model.config.hidden_size and out["inf"] == 0
    assert str(lead["nan"].dtype).startswith("int") and str(lead["inf"].dtype).startswith("int")
    shown = {str(v) for c in lead.columns for v in lead[c]}
    assert not shown & {"Infinity", "-Infinity", "inf", "-inf", "None", "nan", "1.0"}, shown
    before = lead[lead["stage"] == "blocks.0.mlp.up"].iloc[0]       # finite: its numbers, 4 significant digits
    assert float(before["absmax"]) == pytest.approx(max(abs(float(before["min"])), abs(float(before["max"]))))
    assert before["layer"] == "0" and lead[lead["stage"] == "blocks.0.mlp_out"].iloc[0]["layer"] == "0"


def test_the_markers_after_the_first_nan_stand_apart(page, tiny_model, tiny_model_dir, tiny_run):
    at = page("nan_doctor", tiny_run, tiny_model, str(tiny_model_dir)).run()
    at.selectbox(key="nd_preset").set_value("custom").run()
    at.selectbox(key="nd_kind").set_value("nan").run()
    at.selectbox(key="nd_target").set_value("attn_norm").run()
    at.number_input(key="nd_layer").set_value(0).run()
    at.number_input(key="nd_pos").set_value(1).run()
    at.button(key="nd_inject").click().run()
    assert not at.exception, at.exception
    spec = profile_spec(at, "nd_fault_profile")
    bad = [t for t in spec["data"] if t["name"] in ("holds NaN", "holds Inf")]
    xs = sorted(x for t in bad for x in t["x"])
    assert len(xs) > 2 * WINDOW + 1                      # every stage after layer 0's attn_norm holds a NaN
    lo, hi = spec["layout"]["xaxis"]["range"]
    shown = [x for x in xs if lo <= x <= hi]
    # the chart opens on 2 * WINDOW + 1 stages: in a plot 600 px wide (narrower than the page's) that is 24 px
    # a column, over twice a marker's 11 px, and each column carries its stage's name
    assert hi - lo <= 2 * WINDOW + 1 and len(shown) >= WINDOW
    assert all(t["marker"]["size"] <= 11 for t in bad) and 600 / (hi - lo) >= 2 * 11
    ticks = dict(zip(spec["layout"]["xaxis"]["tickvals"], spec["layout"]["xaxis"]["ticktext"]))
    names = {x: s for t in bad for x, s in zip(t["x"], t["text"])}
    assert all(ticks[x] == names[x].removeprefix("blocks.") for x in shown)
    assert len(set(ticks[x] for x in shown)) == len(shown)


@pytest.mark.model
def test_fp16_overflow_says_the_mlp_output_overflows(page, bundled_model, tmp_path):
    """The preset on the bundled model: the reference (fp32, same fault) gives mlp.act's and mlp_out's largest
    magnitudes at position 0; only mlp_out's passes 65,504, and that is what the page and the preset say."""
    ref = fault_probe(bundled_model, PRESETS["fp16-overflow"].injections)
    bundled_model.logits(bundled_model.tokenizer.encode(FOX), ref)
    absmax = {r.name: float(r.values[0, 4]) for r in ref.recording.stat_records() if r.name.startswith("blocks.11.mlp")}
    assert absmax["blocks.11.mlp.act"] < FP16_MAX < absmax["blocks.11.mlp_out"]
    desc = PRESETS["fp16-overflow"].description
    assert "MLP's output" in desc and "activation still fits float16" in desc
    assert f"~{round(absmax['blocks.11.mlp_out'], -4):,.0f}" in desc

    run = inspect_run(bundled_model, RunSettings(prompt=FOX, chat=False, max_new_tokens=1))
    at = page("nan_doctor", run, bundled_model, None).run()
    at.selectbox(key="nd_preset").set_value("fp16-overflow").run()
    at.number_input(key="nd_max_new").set_value(1).run()
    at.button(key="nd_inject").click().run()
    assert not at.exception, at.exception
    said = [m.value for m in at.markdown if m.value.startswith("The fault was planted")]
    assert said, [m.value for m in at.markdown]
    assert "planted at `blocks.11.mlp.act`, which stayed finite there" in said[0]
    assert "below float16's largest value 65,504" in said[0]
    assert "the first NaN/Inf appeared 1 stage later, at `blocks.11.mlp_out`" in said[0]
