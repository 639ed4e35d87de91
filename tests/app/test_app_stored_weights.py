"""Issue 44 item 3 in the app (AppTest): for a GGUF file the sidebar offers its weights dequantised or as stored, the
registry holds both loads of the one file, and the sidebar says which is loaded with its weight bytes, counted here
from the file's own tensor table (gguf-py's reader: each tensor's elements and bytes); a mode the browser invents is
refused on the server. The Quantization page sets the file as stored against its dequantised self with the engine's
numbers (engine.tools.quant_stored.stored_report on the same two models and the run's prompt and settings)."""
from __future__ import annotations

import dataclasses
import json

import pytest
from streamlit.testing.v1 import AppTest

from engine.errors import EngineError
from engine.sources import bundled_gguf
from engine.tools.quant_stored import TOLERANCE, stored_report
from inspector.session import models
from inspector.session.model_choices import QUANT_LABELS, quant_of
from inspector.ui.state import session_of
from inspector.views.kv_cache import human_bytes
from inspector.views.stored import FLOOR
from tests.app.test_app_pages_a import arr
from tests.helpers import as_shown
from tests.unit.test_report import embedded

pytestmark = pytest.mark.app

TINY_LABEL = "tiny-llama (server default)"
STORED = next(k for k, v in QUANT_LABELS.items() if v == "stored")


@pytest.fixture
def fresh_registry():
    models.shared_model.clear()
    yield
    models.shared_model.clear()


def open_app(monkeypatch, app_file, tiny_model_dir) -> AppTest:
    from streamlit.runtime.pages_manager import PagesManager
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))      # a model that is no GGUF file comes first
    monkeypatch.setattr(PagesManager, "uses_pages_directory", None)
    models.model_choices.clear()
    at = AppTest.from_file(str(app_file), default_timeout=300)
    at.run()
    assert not at.exception, at.exception
    return at


def model_line(at: AppTest) -> str:
    (line,) = [as_shown(c.value) for c in at.sidebar.caption if c.value.startswith("Model: ")]
    return line


def quant_box(at: AppTest) -> list:
    return [s for s in at.sidebar.selectbox if s.key == "sb_quant"]


def file_bytes() -> tuple[int, dict[str, int]]:
    """The bundled file's weights from its tensor table: dequantised, every element in float32; as stored, each
    tensor's own bytes under its type's name (F32 norms as float32)."""
    from gguf import GGUFReader
    floats, stored = 0, {}
    for t in GGUFReader(str(bundled_gguf())).tensors:
        kind = t.tensor_type.name
        floats += 4 * int(t.n_elements)
        key = "float32" if kind == "F32" else kind
        stored[key] = stored.get(key, 0) + int(t.n_bytes)
    return floats, stored


def test_the_sidebar_loads_a_gguf_as_stored_beside_its_dequantised_self(monkeypatch, app_file, tiny_model_dir,
                                                                        fresh_registry):
    floats, stored = file_bytes()
    assert 530e6 < floats < 545e6 and 95e6 < sum(stored.values()) < 99e6      # ~538 MB and ~97 MB
    at = open_app(monkeypatch, app_file, tiny_model_dir)
    assert not quant_box(at)                       # a Hugging Face folder has no blocks to keep
    at.sidebar.selectbox(key="sb_model").set_value(models.BUNDLED).run()
    assert not at.exception, at.exception
    (box,) = quant_box(at)
    assert box.options == list(QUANT_LABELS) and box.value == "dequantised (floats)"
    line = model_line(at)
    assert f"· weights {human_bytes(floats)} float32 ·" in line and "as stored" not in line, line
    box.set_value(STORED).run()
    assert not at.exception, at.exception
    line = model_line(at)
    parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(stored.items(), key=lambda kv: -kv[1]))
    assert f"· cpu · float32 · weights as stored (GGUF blocks) {human_bytes(sum(stored.values()))}: {parts} ·" \
        in line, line
    assert "weights kept quantized" in line
    held = {(h.name, h.dtype): sum(h.weight_bytes.values()) for h in models.held()}
    assert held[(models.BUNDLED, "float32")] == floats                      # both modes of the one file are held
    assert held[(f"{models.BUNDLED} (as stored)", "float32")] == sum(stored.values())


def test_the_sidebar_loads_a_gguf_as_stored_in_llama_cpps_arithmetic(monkeypatch, app_file, tiny_model_dir,
                                                                    fresh_registry):
    """The third mode: the same blocks, multiplied as llama.cpp does (x rounded to 8 bits: load_model's
    quant="stored-int8"); the model line and the held list say so, and its bytes are the file's as stored."""
    _, stored = file_bytes()
    int8 = next(k for k, v in QUANT_LABELS.items() if v == "stored-int8")
    at = open_app(monkeypatch, app_file, tiny_model_dir)
    at.sidebar.selectbox(key="sb_model").set_value(models.BUNDLED).run()
    (box,) = quant_box(at)
    box.set_value(int8).run()
    assert not at.exception, at.exception
    line = model_line(at)
    assert f"weights as stored (GGUF blocks, llama.cpp's int8 products) {human_bytes(sum(stored.values()))}:" in line
    model = models.shared_model(None, "cpu", "float32", quant="stored-int8")
    assert model.weights.kept_arithmetics() == {"int8"}        # the bundled file's Q4_1 and Q8_0: both have one
    held = {h.name: sum(h.weight_bytes.values()) for h in models.held()}
    assert held[f"{models.BUNDLED} (as stored, int8 products)"] == sum(stored.values())


def test_a_weights_mode_the_browser_invents_is_refused_on_the_server(monkeypatch, app_file, tiny_model_dir,
                                                                     fresh_registry):
    for bad in ("q4; rm -rf /", "STORED", ["stored"], 3):
        mode = quant_of(bad, None)               # the bundled file: a label no choice names is passed on as it came
        assert mode == bad
        state = models.model_load(None, "cpu", "float32", quant=mode)
        assert state.model is None and "unsupported weights mode" in state.error, (bad, state)
        with pytest.raises(EngineError, match="unsupported weights mode"):
            models.shared_model(None, "cpu", "float32", quant=mode)
    assert not models.held()                     # nothing was loaded for any of them
    assert quant_of(STORED, str(tiny_model_dir)) == "dequantized"      # no GGUF file: never "stored"
    at = open_app(monkeypatch, app_file, tiny_model_dir)
    # A forged value in the widget's state, in the same script run as the choice of the GGUF file: Streamlit puts
    # the box back to its first option, and the model loaded is the dequantised one (the registry refuses the rest).
    at.session_state["sb_model"] = models.BUNDLED
    at.session_state["sb_quant"] = "../../etc/passwd"
    at.run(timeout=300)
    assert not at.exception and at.session_state["sb_quant"] == "dequantised (floats)"
    assert "as stored" not in model_line(at) and all("passwd" not in h.name for h in models.held())


def test_the_quantization_page_sets_the_file_as_stored_against_its_dequantised_self(monkeypatch, app_file,
                                                                                     tiny_model_dir, fresh_registry):
    at = open_app(monkeypatch, app_file, tiny_model_dir)
    at.sidebar.selectbox(key="sb_model").set_value(models.BUNDLED).run()
    at.sidebar.text_area(key="sb_prompt").set_value("The capital of France is")
    at.sidebar.number_input(key="sb_max_new").set_value(5)
    at.sidebar.button(key="sb_run").click().run()
    assert not at.exception, at.exception
    run = session_of(at.session_state).run
    at.switch_page("views/quantization.py").run()
    assert not at.exception, at.exception
    at.button(key="qz_stored_run").click().run()
    assert not at.exception, at.exception
    # the engine's numbers on the same two models (the registry's: the sidebar's dequantised one and the stored
    # load the page made), the run's prompt and settings, as many tokens as it generated
    stored = models.shared_model(None, "cpu", "float32", quant="stored")
    dequant = models.shared_model(None, "cpu", "float32")
    assert stored.weights.quantized() and not dequant.weights.quantized()
    want = stored_report(stored, dequant, dataclasses.replace(run.settings, max_new_tokens=len(run.result.token_ids)))
    (table,) = [d.value for d in at.dataframe if "rel_l2" in d.value.columns]
    assert table["stage"].tolist() == [r["stage"] for r in want.per_stage]
    assert table["rel_l2"].tolist() == [r["rel_l2"] for r in want.per_stage]
    assert table["max_abs_diff"].tolist() == [r["max_abs"] for r in want.per_stage]
    assert not table["over_tolerance"].any()
    (steps,) = [d.value for d in at.dataframe if "KL (nats)" in d.value.columns and "format" not in d.value.columns]
    assert steps["KL (nats)"].tolist() == [s["kl"] for s in want.per_step] and steps["same top"].all()
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Logits max |Δ|"] == f"{want.logits_max_abs:.3g}" and metrics["KL mean (nats)"] == \
        f"{want.kl_mean:.3g}" and metrics["First stage over the tolerance"] == "none"
    (fig,) = [json.loads(e.proto.spec) for e in at.get("plotly_chart") if e.key == "qz_stored_fig"]
    rel = next(t for t in fig["data"] if t["name"] == "relative L2")
    assert arr(rel["y"]).tolist() == pytest.approx([max(r["rel_l2"], FLOOR) for r in want.per_stage], rel=1e-12)
    assert fig["layout"]["shapes"][0]["y0"] == TOLERANCE
    (heat,) = [json.loads(e.proto.spec) for e in at.get("plotly_chart") if e.key == "qz_stored_heat"]
    assert arr(heat["data"][0]["z"]).shape == (len(want.per_stage), want.steps)
    # the Overview's take-home report carries it in its Tools section, the engine's numbers again
    at.switch_page("views/overview.py").run()
    at.button(key="ov_report_make").click().run()
    assert not at.exception, at.exception
    html = list(session_of(at.session_state).memos["ov_report"].values())[-1]
    (tool,) = embedded(html, "report-data")["tools"]
    worst = sorted(want.per_stage, key=lambda r: -r["rel_l2"])[:len(tool["rows"])]
    assert tool["id"] == "tool-stored" and [r[:3] for r in tool["rows"]] == [
        [r["stage"], r["max_abs"], r["rel_l2"]] for r in worst]


def test_compare_runs_sets_the_file_as_stored_against_the_sidebars_dequantised_model(monkeypatch, app_file,
                                                                                      tiny_model_dir, fresh_registry):
    at = open_app(monkeypatch, app_file, tiny_model_dir)
    at.switch_page("views/compare.py").run()
    assert "GGUF as stored" not in at.selectbox(key="cmp_dtype_b").options        # the tiny folder: no blocks
    at.sidebar.selectbox(key="sb_model").set_value(models.BUNDLED).run()
    at.number_input(key="cmp_max_new").set_value(6)
    at.selectbox(key="cmp_dtype_b").set_value("GGUF as stored").run()
    at.button(key="cmp_run").click().run()
    assert not at.exception, at.exception
    res = session_of(at.session_state).compared
    na, da, nb, db = res["names"]
    assert "kept quantized" not in na and nb.endswith("[weights kept quantized]") and da == db == "torch.float32"
    # which load each side ran: each configuration again on the registry's two loads of the file, by name
    from inspector.views.compare import run_config
    ids, seed = res["a"].prompt_ids, at.session_state["cmp_seed"]
    stored = models.shared_model(None, "cpu", "float32", quant="stored")
    dequant = models.shared_model(None, "cpu", "float32")
    assert run_config(dequant, ids, res["cfg_a"], max_new_tokens=6, seed=seed).token_ids == res["a"].token_ids
    assert run_config(stored, ids, res["cfg_b"], max_new_tokens=6, seed=seed).token_ids == res["b"].token_ids
    assert any("[weights kept quantized]" in as_shown(c.value) for c in at.caption)


def test_the_nan_doctor_says_a_weight_fault_on_the_stored_file_worked_on_its_dequantised_value(
        monkeypatch, app_file, tiny_model_dir, fresh_registry):
    at = open_app(monkeypatch, app_file, tiny_model_dir)
    at.sidebar.selectbox(key="sb_model").set_value(models.BUNDLED).run()
    at.sidebar.selectbox(key="sb_quant").set_value(STORED).run()
    at.sidebar.text_area(key="sb_prompt").set_value("Hi")
    at.sidebar.number_input(key="sb_max_new").set_value(2)
    at.sidebar.button(key="sb_run").click().run()
    assert not at.exception, at.exception
    at.switch_page("views/nan_doctor.py").run()
    at.selectbox(key="nd_preset").set_value("custom").run()
    at.selectbox(key="nd_kind").set_value("scale").run()
    at.selectbox(key="nd_target").set_value("weight: mlp.w_down").run()
    at.number_input(key="nd_layer").set_value(3)
    at.number_input(key="nd_factor").set_value(2.0)
    at.number_input(key="nd_max_new").set_value(2).run()
    at.button(key="nd_inject").click().run()
    assert not at.exception, at.exception
    fmt = models.shared_model(None, "cpu", "float32", quant="stored").weights.layers[3].w_down.format
    said = [as_shown(w.value) for w in at.warning if "weight override" in as_shown(w.value)]
    assert said == [f"weight override blocks.3.mlp.w_down ({fmt}, kept quantized): weights kept quantized: this uses "
                    "their dequantised float32 values (QuantMatrix.dequantize); the run multiplies by the overridden "
                    "float32 matrix"], [w.value for w in at.warning]
