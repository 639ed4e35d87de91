"""AppTest of the Overview, Tokens, Attention and Activations pages: on the tiny random model (through the
sidebar's server-default model choice) and once on the bundled model."""
from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from engine.generate import GenerationRun
from engine.model import Model
from inspector.session.models import model_choices
from inspector.ui.state import session_of
from inspector.views.attention import attention_pattern
from inspector.views.tokens import chat_messages

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["overview", "tokens", "attention", "activations"]
PROMPT = "Say <b>hi</b> & <script>alert(1)</script> 👋"


def page(app_file: Path, name: str) -> str:
    """A page's path relative to the app under test ('tokens' -> 'pages/tokens.py' or 'views/tokens.py')."""
    (hit,) = [p for p in ("pages", "views") if (app_file.parent / p / f"{name}.py").is_file()]
    return f"{hit}/{name}.py"


@pytest.fixture
def calls(monkeypatch):
    """Counts generations started (GenerationRun: the app's run path drives one through the step barrier) and
    Model.forward calls (every model instance, the app's shared one too)."""
    n = {"generate": 0, "forward": 0}
    gen, fwd = GenerationRun.__init__, Model.forward

    def generate(self, *a, **kw):
        n["generate"] += 1
        return gen(self, *a, **kw)

    def forward(self, *a, **kw):
        n["forward"] += 1
        return fwd(self, *a, **kw)

    monkeypatch.setattr(GenerationRun, "__init__", generate)
    monkeypatch.setattr(Model, "forward", forward)
    return n


def fresh_app(monkeypatch, app_file) -> AppTest:
    """An AppTest of the app under test, seeing this test's $LLM_INSPECTOR_MODEL."""
    from streamlit.runtime.pages_manager import PagesManager
    monkeypatch.setattr(PagesManager, "uses_pages_directory", None)   # decided once per process; see app_file
    model_choices.clear()          # the sidebar's model list is cached for 60 s; the env var changes per test
    return AppTest.from_file(str(app_file), default_timeout=120)


def start(monkeypatch, app_file, prompt=PROMPT, max_new=6) -> AppTest:
    at = fresh_app(monkeypatch, app_file)
    at.run()
    assert not at.exception
    at.sidebar.text_area(key="sb_prompt").set_value(prompt)
    at.sidebar.number_input(key="sb_max_new").set_value(max_new)
    at.sidebar.button(key="sb_run").click().run()
    assert not at.exception, at.exception
    assert session_of(at.session_state).run is not None
    return at


@pytest.fixture
def tiny_app(monkeypatch, tiny_model_dir, app_file, calls):
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    at = start(monkeypatch, app_file)
    assert calls["generate"] == 1
    return at


def find_df(at, *cols):
    for el in at.dataframe:
        if set(cols) <= set(el.value.columns):
            return el.value
    raise AssertionError(f"no dataframe with columns {cols}")


def chart(at, key: str) -> dict:
    (el,) = [e for e in at.get("plotly_chart") if e.key == key]
    return json.loads(el.proto.spec)


def arr(v) -> np.ndarray:
    """A plotly trace array: a plain list, or plotly's typed-array encoding {dtype, bdata, shape}."""
    if isinstance(v, dict) and "bdata" in v:
        a = np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
        shape = [int(s) for s in str(v.get("shape", a.size)).split(",")]
        return a.reshape(shape)
    return np.array(v, dtype=float)


def test_pages_without_a_run_show_the_hint(monkeypatch, tiny_model_dir, app_file, calls):
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    at = fresh_app(monkeypatch, app_file).run()
    for name in PAGES:
        at.switch_page(page(app_file, name)).run()
        assert not at.exception
        if name == "overview":       # the first screen: what the app is, and three demo runs
            assert any("LLM Inspector** runs a small language model" in m.value for m in at.markdown)
            assert [b.key for b in at.main.button] == ["ov_demo_sampling", "ov_demo_loop", "ov_demo_nan"]
        else:
            assert any("press **Run**" in i.value for i in at.info), name
        assert not at.get("plotly_chart") and not at.dataframe
    assert calls["generate"] == 0 and calls["forward"] == 0


def test_overview_lists_every_step(tiny_app, tiny_model, app_file):
    run = session_of(tiny_app.session_state).run
    at = tiny_app.switch_page(page(app_file, "overview")).run()
    assert not at.exception
    steps = find_df(at, "step", "token", "prob", "model_prob", "entropy", "kept", "top5")
    assert steps["id"].tolist() == run.result.token_ids
    assert steps["step"].tolist() == list(range(len(run.result.token_ids)))
    assert all(0 <= p <= 1 for p in steps["model_prob"])
    assert steps["top5"].str.count(r" \d\.\d{3}").eq(5).all()
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Stop reason"] == run.result.stop_reason
    codes = [c.value for c in at.code]
    assert codes[0].rstrip("\n") == tiny_model.tokenizer.decode(run.result.prompt_ids).replace("\n", "⏎\n").rstrip("\n")
    assert codes[1] == run.result.text.strip("\n")
    assert "<|im_start|>user" in codes[0] and "👋" in codes[0]


def test_tokens_page_table_spans_and_stream(tiny_app, tiny_model, app_file):
    run = session_of(tiny_app.session_state).run
    at = tiny_app.switch_page(page(app_file, "tokens")).run()
    assert not at.exception
    table = find_df(at, "position", "id", "bytes", "start", "end", "special", "part")
    tok = tiny_model.tokenizer
    expected = tok.encode_chat(chat_messages(PROMPT)) + run.result.token_ids
    assert table["id"].tolist() == expected
    assert table["position"].tolist() == list(range(len(expected)))
    assert (table["part"] == "prompt").sum() == run.n_prompt
    assert table["special"].tolist() == [tok.is_special(i) for i in expected]
    # bytes column spells the prompt; the emoji's pieces share its one-character span
    prompt = table[table["part"] == "prompt"]
    spelled = bytes.fromhex("".join(prompt["bytes"].str.replace(" ", "")))
    assert spelled.decode() == tok.decode(run.result.prompt_ids)
    emoji = prompt[prompt["bytes"].str.contains("f0 9f|91|8b")]
    assert len(emoji) >= 2 and emoji["end"].nunique() == 1
    # user text is escaped in the spans: no tag of the prompt survives as markup
    spans = "".join(h.proto.body for h in at.get("html"))
    assert set(re.findall(r"<(/?\w+)", spans)) == {"div", "/div", "span", "/span"}
    assert "&lt;" in spans and "&amp;" in spans
    text = html.unescape(re.sub(r"<[^>]*>", "", spans))
    assert "Say·&lt;b&gt;hi" not in text and "Say·<b>hi</b>·&·<script>alert(1)</script>" in text
    # one span per token, except the emoji's byte pieces: one span spelling 👋 (its hover lists the pieces)
    assert spans.count("<span ") == len(expected) - (len(emoji) - 1) and "👋" in text
    # counts and the chat template
    metrics = [m.value for m in at.metric if m.label == "Tokens"]
    assert [int(v) for v in metrics] == [run.n_prompt, len(run.result.token_ids)]
    rendered = tok.render_chat(chat_messages(PROMPT))
    assert rendered.endswith("assistant\n")
    assert any(c.value.rstrip("\n") == rendered.replace("\n", "⏎\n").rstrip("\n") for c in at.code)
    # the streaming decoder replayed over the generated tokens spells the run's text
    run_stream = [el.value for el in at.dataframe if "emitted" in el.value.columns][0]
    assert "".join(run_stream["emitted"]) == run.result.text
    # streaming decoder on the sample text: '' while a character is incomplete, text joins back up
    at.text_input(key="tok_stream_text").set_value("a👋世").run()
    stream = [el.value for el in at.dataframe if "emitted" in el.value.columns][-1]
    assert "".join(stream["emitted"]) == "a👋世"
    assert stream["emitted"].tolist()[0] == "a"
    assert "" in stream["emitted"].tolist()


def test_attention_maps_are_computed_on_demand_and_cached(tiny_app, tiny_model, calls, app_file):
    run = session_of(tiny_app.session_state).run
    T, cfg = len(run.ids), tiny_model.config
    ref = [attention_pattern(tiny_model, run.ids, layer) for layer in range(cfg.num_layers)]
    before = calls["forward"]
    at = tiny_app.switch_page(page(app_file, "attention")).run()
    assert not at.exception
    assert calls["forward"] - before == 2            # layer 0's map + the entropy overview
    fig = chart(at, "att_map")
    z = arr(fig["data"][0]["z"])
    assert z.shape == (T, T)
    np.testing.assert_allclose(z.sum(1), 1, atol=1e-5)              # head average: rows still sum to 1
    assert np.allclose(np.triu(z, 1), 0)                             # causal
    assert len(fig["data"][0]["x"]) == T and fig["data"][0]["x"][0].startswith("0 ")
    np.testing.assert_allclose(z, ref[0].mean(0).numpy(), atol=1e-5)
    ent = arr(chart(at, "att_entropy")["data"][0]["z"])
    assert ent.shape == (cfg.num_layers, cfg.num_heads)

    n = calls["forward"]
    at.selectbox(key="att_layer").set_value(1).run()
    assert calls["forward"] == n + 1
    z1 = arr(chart(at, "att_map")["data"][0]["z"])
    np.testing.assert_allclose(z1, ref[1].mean(0).numpy(), atol=1e-5)
    n = calls["forward"]
    at.selectbox(key="att_head").set_value(2).run()
    zh = arr(chart(at, "att_map")["data"][0]["z"])
    np.testing.assert_allclose(zh.sum(1), 1, atol=1e-5)
    np.testing.assert_allclose(zh, ref[1][2].numpy(), atol=1e-5)
    at.selectbox(key="att_layer").set_value(0).run()                 # seen before: no new forward
    at.slider(key="att_query").set_value(3).run()
    at.slider(key="att_topk").set_value(2).run()
    assert calls["forward"] == n
    assert calls["generate"] == 1
    top = find_df(at, "position", "token", "weight")
    row = ref[0][2, 3].numpy()
    assert top["position"].tolist() == np.argsort(-row, kind="stable")[:2].tolist()
    assert not at.exception


def test_activations_page(tiny_app, tiny_model, calls, app_file):
    run = session_of(tiny_app.session_state).run
    L = tiny_model.config.num_layers
    at = tiny_app.switch_page(page(app_file, "activations")).run()
    assert not at.exception
    table = find_df(at, "stage", "layer", "rms", "absmax")
    assert sorted(table["stage"].unique()) == ["attn_out", "mlp_out", "resid_post"]
    assert table.groupby("stage").size().eq(L).all()
    np.testing.assert_allclose(table["rms"], np.sqrt(table["mean"] ** 2 + table["std"] ** 2), rtol=1e-6)
    lines = chart(at, "act_lines")
    assert [t["name"] for t in lines["data"]] == ["resid_post", "attn_out", "mlp_out"]
    heat = arr(chart(at, "act_heat")["data"][0]["z"])
    assert heat.shape == (L, len(run.ids) - 1)      # every fed position: the prompt, then one per step
    assert any("stayed finite" in s.value for s in at.success)

    n = calls["forward"]
    at.multiselect(key="act_stages").set_value(["mlp.act"]).run()
    at.selectbox(key="act_stat").set_value("absmax").run()
    table = find_df(at, "stage", "layer", "rms", "absmax")
    assert table["stage"].tolist() == ["mlp.act"] * L and table["layer"].tolist() == list(range(L))
    assert calls["forward"] == n                     # statistics come from the run: no forward
    # the logit lens: L layers × k ranks; the last layer's top-1 is the model's own next-token choice
    lens = find_df(at, "layer", "rank", "id", "prob")
    assert len(lens) == L * 5
    pos = run.n_prompt - 1
    assert int(lens[(lens["layer"] == L - 1) & (lens["rank"] == 0)]["id"].iloc[0]) == run.result.token_ids[0]
    at.slider(key="act_lens_pos").set_value(pos - 1).run()
    assert calls["forward"] == n + 1
    at.slider(key="act_lens_pos").set_value(pos).run()
    assert calls["forward"] == n + 1                 # memoised
    assert calls["generate"] == 1 and not at.exception


@pytest.mark.model                  # the bundled weights: the model tier, outside the quick loop
def test_pages_on_the_bundled_model(monkeypatch, app_file, calls):
    monkeypatch.delenv("LLM_INSPECTOR_MODEL", raising=False)
    at = start(monkeypatch, app_file, prompt="Name a color. 😀", max_new=3)
    run = session_of(at.session_state).run
    assert "SmolLM2" in run.model_name and len(run.result.token_ids) <= 3
    for name in PAGES:
        at.switch_page(page(app_file, name)).run()
        assert not at.exception, (name, at.exception)
    z = arr(chart(at.switch_page(page(app_file, "attention")).run(), "att_map")["data"][0]["z"])
    assert z.shape == (len(run.ids),) * 2
    np.testing.assert_allclose(z.sum(1), 1, atol=1e-4)
    act = at.switch_page(page(app_file, "activations")).run()
    assert find_df(act, "stage", "layer", "rms").groupby("stage").size().eq(30).all()
    assert calls["generate"] == 1


def test_long_runs_are_windowed_pooled_and_costly_views_wait_for_a_click(monkeypatch, tiny_model_dir, app_file,
                                                                         calls):
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    at = start(monkeypatch, app_file, prompt="one two three four five six " * 100, max_new=2)
    run = session_of(at.session_state).run
    T = len(run.ids)
    assert T > 600
    at.switch_page(page(app_file, "attention")).run()
    assert not at.exception
    fig = chart(at, "att_map")
    z = arr(fig["data"][0]["z"])
    assert z.shape == (256, 256) and fig["data"][0]["y"][-1].startswith(f"{T - 1} ")   # the last window
    assert not [e for e in at.get("plotly_chart") if e.key == "att_entropy"]          # waits for the button
    n = calls["forward"]
    at.slider(key="att_window").set_value(100).run()
    assert chart(at, "att_map")["data"][0]["y"][0].startswith("100 ")
    at.radio(key="att_view").set_value("Whole sequence, pooled").run()
    at.selectbox(key="att_pool").set_value("mass").run()
    pooled = arr(chart(at, "att_map")["data"][0]["z"])
    block = -(-T // 256)
    assert pooled.shape == (-(-T // block),) * 2
    np.testing.assert_allclose(pooled.sum(1), 1, atol=1e-5)
    assert calls["forward"] == n                                                       # display only
    at.button(key="att_overview_btn").click().run()
    assert calls["forward"] == n + 1
    ent = arr(chart(at, "att_entropy")["data"][0]["z"])
    assert ent.shape == (2, 4) and (ent > 0).all()
    at.slider(key="att_query").set_value(5).run()                                      # overview stays, cached
    assert calls["forward"] == n + 1 and arr(chart(at, "att_entropy")["data"][0]["z"]).shape == (2, 4)

    at.switch_page(page(app_file, "activations")).run()
    assert not at.exception and calls["forward"] == n + 1                             # the lens waits too
    assert not [e for e in at.get("plotly_chart") if e.key == "act_lens"]
    at.button(key="act_lens_btn").click().run()
    assert calls["forward"] == n + 2
    assert find_df(at, "layer", "rank", "id", "prob")["layer"].nunique() == 2
    assert calls["generate"] == 1 and not at.exception
