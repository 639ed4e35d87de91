"""Hostile input through the app, the way a browser sends it: crafted trace uploads, forged widget values on
the Compare, Repetition, Sampling and Tokens pages, Markdown in a file's strings. Each gives a visible
message, no exception box, and the session's own run (and the model) are unchanged."""
from __future__ import annotations

import time

import pytest

from engine import RunSettings
from engine.generate import generate
from engine.inspection.trace import to_bytes
from inspector.session.run import inspect_run
from inspector.ui.state import session_of
from tests.helpers import as_shown, forge
from tests.unit.test_hostile_traces import CASES, setitem, with_meta

pytestmark = pytest.mark.app
UPLOADS = ["stage of layer 200000000", "200,000 generated ids", "JSON nested 100,000 deep", "a huge declared capture",
           "offsets past the end", "id past the vocabulary", "random bytes", "25,000 captures"]


@pytest.fixture(scope="module")
def run(tiny_model):
    return inspect_run(tiny_model, RunSettings(prompt="one two three four", chat=False, max_new_tokens=3))


@pytest.mark.parametrize("name", UPLOADS)
def test_a_crafted_upload_is_one_message_and_the_run_stays(page, tiny_model, tiny_model_dir, run, name):
    at = page("trace_files", run, tiny_model, str(tiny_model_dir)).run()
    data = CASES[name][0](to_bytes(run))
    t0 = time.perf_counter()
    at.file_uploader[0].set_value(("crafted.trace", data, "application/octet-stream")).run()
    assert time.perf_counter() - t0 < 5
    assert not at.exception, at.exception
    assert len(at.error) == 1 and as_shown(at.error[0].value).startswith("Could not open crafted.trace: ")
    assert session_of(at.session_state).run is run and len(at.button) == 0        # nothing to open, nothing replaced
    assert generate(tiny_model, run.result.prompt_ids, max_new_tokens=3).token_ids == run.result.token_ids


def test_strings_from_a_file_are_text_never_markdown(page, tiny_model, tiny_model_dir, run):
    evil = "![x](http://198.51.100.7/pixel.png) [click](javascript:alert(1)) <img src=x onerror=alert(1)>"
    data = with_meta(to_bytes(run), setitem("model_name", evil))
    at = page("trace_files", run, tiny_model, str(tiny_model_dir)).run()
    at.file_uploader[0].set_value(("x.trace", data, "application/octet-stream")).run()
    assert not at.exception
    assert any(evil in t.value for t in at.text)                          # shown as the characters it is
    assert not any("198.51.100.7" in m.value for m in at.markdown)


def test_a_reupload_is_parsed_once(page, tiny_model, tiny_model_dir, run, monkeypatch):
    import engine.inspection.trace
    calls = []
    real = engine.inspection.trace.from_bytes
    monkeypatch.setattr(engine.inspection.trace, "from_bytes", lambda *a, **k: calls.append(1) or real(*a, **k))
    at = page("trace_files", run, tiny_model, str(tiny_model_dir)).run()
    at.file_uploader[0].set_value(("ok.trace", to_bytes(run), "application/octet-stream")).run()
    at.run()
    at.run()
    assert not at.exception and len(calls) <= 1 and session_of(at.session_state).opened[2].result.token_ids


@pytest.mark.parametrize("value, words", [
    (10**6, "1,000,000 new tokens asked for; this server generates at most 8 per run"),
    (9, "9 new tokens asked for; this server generates at most 8 per run"),
])
def test_forged_compare_length_is_refused_server_side(page, tiny_model, tiny_model_dir, run, value, words,
                                                      monkeypatch):
    monkeypatch.setenv("LLM_INSPECTOR_MAX_NEW_TOKENS", "8")
    forge(monkeypatch, "cmp_max_new", value)
    at = page("compare", run, tiny_model, str(tiny_model_dir))
    at.session_state["sb_prompt"] = "one two three"
    at.run()
    at.button(key="cmp_run").click().run()
    assert not at.exception, at.exception
    assert any(words in e.value for e in at.error), [e.value for e in at.error]
    assert session_of(at.session_state).compared is None


def test_compare_without_cache_is_bounded(page, tiny_model, tiny_model_dir, run, monkeypatch):
    at = page("compare", run, tiny_model, str(tiny_model_dir))
    at.session_state["sb_prompt"] = "word " * 3000
    at.session_state["sb_chat"] = False
    at.run()
    at.number_input(key="cmp_max_new").set_value(200)
    at.toggle(key="cmp_cache_b").set_value(False)
    at.button(key="cmp_run").click().run()
    assert not at.exception
    assert any("KV cache off recomputes every position" in e.value for e in at.error), [e.value for e in at.error]


@pytest.mark.parametrize("key, value, words", [
    ("rep_min_count", 10**9, "Minimum full repeats must be between 2 and 20, got 1,000,000,000"),
    ("rep_min_count", 0, "Minimum full repeats must be between 2 and 20, got 0"),
    ("rep_min_tokens", -5, "Minimum tokens in a loop must be between 1 and 200, got -5"),
    ("rep_min_tokens", 2.5, "Minimum tokens in a loop must be a whole number, got 2.5"),
])
def test_forged_repetition_bounds_are_refused_server_side(page, tiny_model, tiny_model_dir, run, key, value, words,
                                                          monkeypatch):
    forge(monkeypatch, key, value)
    at = page("repetition", run, tiny_model, str(tiny_model_dir))
    at.run()
    assert not at.exception, at.exception
    assert [e.value for e in at.error] == [words]


@pytest.mark.parametrize("key, value, words", [
    ("smp_draws", 10**9, "Draws must be between 100 and 100,000, got 1,000,000,000"),
    ("smp_draws", 7, "Draws must be between 100 and 100,000, got 7"),
    ("smp_draw_seed", -1, "Draw seed must be between 0 and 2,147,483,647, got -1"),
    ("smp_n", 500, "Settings side by side must be between 3 and 5, got 500"),
    ("smp_top_n", 10**7, "Tokens shown must be between 5 and 60, got 10,000,000"),
    ("smp_step", 99, "Step must be between 0 and 2, got 99"),
    ("smp_step", 1.5, "Step must be a whole number, got 1.5"),
])
def test_forged_sampling_numbers_are_refused_server_side(page, tiny_model, tiny_model_dir, run, key, value, words,
                                                         monkeypatch):
    import inspector.views.sampling as smp
    drawn = []
    real = smp.empirical
    monkeypatch.setattr(smp, "empirical", lambda probs, n, *a, **k: drawn.append(n) or real(probs, n, *a, **k))
    forge(monkeypatch, key, value)
    at = page("sampling", run, tiny_model, str(tiny_model_dir))
    at.run()
    assert not at.exception, at.exception
    assert [e.value for e in at.error] == [words]
    assert all(100 <= n <= 100_000 for n in drawn), drawn           # no draw of a forged size


def test_forged_long_text_on_the_tokens_page_is_refused(page, tiny_model, tiny_model_dir, run, monkeypatch):
    import inspector.views.tokens as views
    encoded = []
    forge(monkeypatch, "tok_stream_text", "a" * 2_001)
    at = page("tokens", run, tiny_model, str(tiny_model_dir))
    monkeypatch.setattr(views, "stream_table", lambda tok, ids, _real=views.stream_table: encoded.append(len(ids))
                        or _real(tok, ids))
    at.run()
    assert not at.exception, at.exception
    assert [e.value for e in at.error] == ["the text is 2,001 characters long; this box takes at most 2,000"]
    assert "tok_stream_sample" not in [d.key for d in at.dataframe if hasattr(d, "key")]


def test_text_with_a_lone_surrogate_on_the_tokens_page_is_repaired_with_a_note(page, tiny_model, tiny_model_dir,
                                                                               run, monkeypatch):
    forge(monkeypatch, "tok_stream_text", "ok \ud800 ok")
    at = page("tokens", run, tiny_model, str(tiny_model_dir))
    at.run()
    assert not at.exception, at.exception
    assert any("lone surrogate" in i.value for i in at.info), [i.value for i in at.info]
