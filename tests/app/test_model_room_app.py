"""Room for one more model (AppTest, tiny models of three families under $LLM_INSPECTOR_MODEL_ROOTS): past
$LLM_INSPECTOR_MAX_MODELS the least recently used model that no session has chosen is unloaded (and freed), whoever
used it is told when they choose it again, and a load is refused only while every model held is in use, naming how
many sessions hold them. The sidebar and the KV cache page say the model's weight bytes by dtype and what the server
holds, against bytes counted by hand from the checkpoint's shapes."""
from __future__ import annotations

import gc
import shutil
import weakref

import pytest
from streamlit.runtime.pages_manager import PagesManager
from streamlit.testing.v1 import AppTest

from inspector.session import models
from inspector.session.run import live_runs
from inspector.ui.state import session_of
from inspector.views.kv_cache import human_bytes
from tests.helpers import TINY, as_shown, tiny_config
from tests.unit.test_family_kv_cache import family_model

pytestmark = pytest.mark.app

NAMES = ("a-llama", "b-gemma2", "c-mixtral", "d-llama", "e-llama")


@pytest.fixture(scope="module")
def model_root(tmp_path_factory, tiny_model_dir, tokenizer_files):
    """Five models to choose from, of three families: what a lesson comparing families opens one after another."""
    root = tmp_path_factory.mktemp("models")
    for name in NAMES:
        family = name.split("-")[1]
        if family == "llama":
            shutil.copytree(tiny_model_dir, root / name)
        else:
            family_model(family, root / name, tokenizer_files)
    return root


def open_session(monkeypatch, app_file, root, max_models: int) -> AppTest:
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(root / NAMES[0]))       # the server default: the first one
    monkeypatch.setenv("LLM_INSPECTOR_MODEL_ROOTS", str(root))
    monkeypatch.setenv("LLM_INSPECTOR_MAX_MODELS", str(max_models))
    monkeypatch.setattr(PagesManager, "uses_pages_directory", None)
    models.model_choices.clear()
    at = AppTest.from_file(str(app_file), default_timeout=120)
    at.run()
    assert not at.exception, at.exception
    return at


def choose(at: AppTest, name: str) -> AppTest:
    label = f"{name} (server default)" if name == NAMES[0] else f"{name} (server models)"
    at.sidebar.selectbox(key="sb_model").set_value(label).run()
    assert not at.exception, at.exception
    return at


def model_line(at: AppTest) -> str:
    (line,) = [c.value for c in at.sidebar.caption if c.value.startswith("Model: ")]
    return line


def errors(at: AppTest) -> list[str]:
    return [e.value for e in at.sidebar.error]


@pytest.fixture
def fresh_registry():
    models.shared_model.clear()
    yield
    models.shared_model.clear()


def test_five_models_one_after_another_then_the_first_again(monkeypatch, app_file, model_root, fresh_registry):
    at = open_session(monkeypatch, app_file, model_root, max_models=2)
    assert "**a\\-llama**" in model_line(at)
    at.sidebar.button(key="sb_run").click().run()        # a kept run and a finished live run: neither holds a model
    assert not at.exception and session_of(at.session_state).run is not None
    first = weakref.ref(models.model_load(str(model_root / NAMES[0]), "cpu", "auto").model)
    for name in NAMES[1:]:
        choose(at, name)                 # today's code refused the third: "at most 2 model(s) ... that many are"
        assert not errors(at), errors(at)
        assert f"**{name.replace('-', chr(92) + '-')}**" in model_line(at)
    assert [m.name for m in models.held()] == ["d-llama", "e-llama"]    # the bound holds: the two latest
    gc.collect()
    assert first() is None          # unloaded and freed: nothing else (a memo, a run, a load record) kept it
    choose(at, NAMES[0])
    assert not errors(at), errors(at)
    assert "**a\\-llama**" in model_line(at) and not at.sidebar.button(key="sb_run").disabled
    notices = [as_shown(i.value) for i in at.sidebar.info if "was unloaded" in as_shown(i.value)]
    assert len(notices) == 1, [i.value for i in at.sidebar.info]
    assert notices[0].startswith("a-llama (server default) was unloaded at ")
    assert "to make room for c-mixtral: this server keeps at most 2 model(s) loaded (LLM_INSPECTOR_MAX_MODELS)" \
        in notices[0] and notices[0].endswith("It has been loaded again.")
    assert sorted(m.name for m in models.held()) == ["a-llama", "e-llama"]     # d went: the least recently used
    at.run()                                                    # said once
    assert not [i.value for i in at.sidebar.info if "was unloaded" in as_shown(i.value)]


def test_a_model_is_refused_only_while_every_one_is_in_use_and_says_by_how_many(monkeypatch, app_file, model_root,
                                                                                 fresh_registry):
    teacher = open_session(monkeypatch, app_file, model_root, max_models=2)      # a-llama
    student = open_session(monkeypatch, app_file, model_root, max_models=2)
    choose(student, NAMES[1])                                                     # b-gemma2
    late = open_session(monkeypatch, app_file, model_root, max_models=2)          # a-llama too
    choose(late, NAMES[2])
    (err,) = errors(late)
    assert "this server keeps at most 2 model(s) loaded (LLM_INSPECTOR_MAX_MODELS), and every one is in use " \
           "(2 sessions hold them): a-llama (cpu, float32): in use by 1 session; b-gemma2 (cpu, float32): in use " \
           "by 1 session." in err, err
    assert late.sidebar.button(key="sb_run").disabled
    assert sorted(m.name for m in models.held()) == ["a-llama", "b-gemma2"]
    choose(student, NAMES[0])                  # the student moves to the teacher's model: b-gemma2 is free
    late.run()                                 # the next click tries again at once (no wait for a refused load)
    assert not errors(late), errors(late)
    assert "**c\\-mixtral**" in model_line(late)
    assert sorted(m.name for m in models.held()) == ["a-llama", "c-mixtral"]
    assert "**a\\-llama**" in model_line(teacher.run())


def test_the_sidebar_and_kv_cache_page_say_weight_bytes_by_dtype_and_what_the_server_holds(
        monkeypatch, app_file, model_root, fresh_registry):
    d, f, V, L = TINY["hidden_size"], TINY["intermediate_size"], tiny_config()["vocab_size"], \
        TINY["num_hidden_layers"]
    hd = d // TINY["num_attention_heads"]
    q, kv = TINY["num_attention_heads"] * hd, TINY["num_key_value_heads"] * hd
    params = 2 * V * d + d + L * (2 * d + d * (q + 2 * kv) + q * d + 3 * d * f)   # embed, lm_head, norms, blocks
    assert params == 6_365_504
    at = open_session(monkeypatch, app_file, model_root, max_models=4)
    assert f"· weights {human_bytes(4 * params)} float32 ·" in model_line(at)
    at.sidebar.selectbox(key="sb_dtype").set_value("bfloat16").run()
    assert not at.exception and f"· weights {human_bytes(2 * params)} bfloat16 ·" in model_line(at)
    at.sidebar.button(key="sb_run").click().run()
    assert not at.exception, at.exception
    (footer,) = [as_shown(c.value) for c in at.sidebar.caption if c.value.startswith("Server: ")]
    both = human_bytes(6 * params)
    assert (f"2 of at most 4 models (LLM_INSPECTOR_MAX_MODELS), {both} of weights (a-llama {human_bytes(4 * params)} "
            f"float32; a-llama {human_bytes(2 * params)} bfloat16)") in footer, footer
    assert f"{live_runs()} run record" in footer
    at.switch_page("views/kv_cache.py").run()
    assert not at.exception, at.exception
    (table,) = [df.value for df in at.dataframe if "weight_bytes" in df.value.columns]
    assert table.to_dict("list") == {"dtype": ["bfloat16"], "weight_bytes": [2 * params], "share": [1.0]}
    run = session_of(at.session_state).run
    assert any(f"This model's weights: **{human_bytes(2 * params)} bfloat16**; this run's KV cache: "
               f"**{human_bytes(run.result.cache['bytes_allocated'])}** allocated." in m.value for m in at.markdown)
    assert any(f"{both} of weights" in as_shown(c.value) for c in at.caption)
