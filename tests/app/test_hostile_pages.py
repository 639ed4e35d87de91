"""Issue 19 on the pages: a run's strings (a file's model name, notes, prompt) reach no Markdown element as
Markdown; a file's prompt is cut to the server's prompt limit before the Tokens page tokenizes it; the
sections that generate again from a run's settings (Repetition's *Find the cause*, the NaN doctor's *Find
the rescue set*) check them against the server's limits first; and every number a page hands the engine is
checked on the server, so a forged widget value gets one message and no model work."""
from __future__ import annotations

import dataclasses
import html
import re

import pytest
from markdown_it import MarkdownIt

from engine import RunSettings
from engine.model import Model
from engine.tools.why_loop import MAX_RERUNS
from inspector.session.run import inspect_run
from tests.helpers import as_shown, forge

pytestmark = pytest.mark.app
EVIL = "![x](http://evil.example/img.png) [log in again](http://evil.example)"
MARKDOWN_ELEMENTS = ("markdown", "caption", "warning", "error", "info", "success", "subheader", "header")


@pytest.fixture(scope="module")
def run(tiny_model):
    return inspect_run(tiny_model, RunSettings(prompt="one two three four", chat=False, max_new_tokens=3))


def with_strings(run, value: str):
    """The run as a crafted trace file could hold it: its model name and notes are `value`."""
    return dataclasses.replace(run, model_name=value, notes=[value])


def bodies(at) -> list[str]:
    return [e.value for name in MARKDOWN_ELEMENTS for e in getattr(at.main, name)]


def links_in(body: str) -> list[str]:
    """What a Markdown renderer would make a link or an image of: CommonMark's own links and images
    (markdown-it, the reference CommonMark implementation in Python) and GitHub-flavoured Markdown's bare
    autolinks (http://, https://, www., name@host), which Streamlit's renderer also turns into links."""
    rendered = MarkdownIt("commonmark").render(body)
    found = re.findall(r"<(?:a|img)\b[^>]*>", rendered)
    text = html.unescape(re.sub(r"<[^>]+>", "", rendered))      # what is left as text after the renderer ran
    # remark-gfm's own patterns, run (as there) on the text that is left once escapes are resolved
    found += re.findall(r"(?:https?://|www(?=\.))[-.\w]+|[-.\w+]+@[-\w]+(?:\.[-\w]+)+", text, re.IGNORECASE)
    return found


def test_links_in_is_a_real_check():
    """The reference finds what the pages must not send (and nothing in escaped text)."""
    from inspector.ui.common import plain as md
    assert links_in(f"Model **{EVIL}**") == ['<img src="http://evil.example/img.png" alt="x" />',
                                            '<a href="http://evil.example">']
    assert links_in("see www.evil.example or a@evil.example") == ["www.evil.example", "a@evil.example"]
    assert links_in(f"Model **{md(EVIL)}**") == []
    assert as_shown(md(EVIL)) == EVIL              # shown as its characters


@pytest.mark.parametrize("name", ["overview", "tokens", "activations", "repetition", "nan_doctor"])
def test_a_runs_strings_reach_no_markdown_element_as_markdown(page, tiny_model, tiny_model_dir, run, name):
    at = page(name, with_strings(run, EVIL), tiny_model, str(tiny_model_dir)).run()
    assert not at.exception, at.exception
    shown = bodies(at)
    assert any(EVIL in as_shown(b) for b in shown), shown   # shown, as text
    assert [links_in(b) for b in shown if links_in(b)] == []


# ---- a file's prompt on the Tokens page --------------------------------------------------------------
def encode_calls(monkeypatch, tok) -> list[int]:
    """The length of every text the tokenizer is given (encode, chat rendering) while the page runs."""
    seen: list[int] = []
    for name in ("encode", "render_chat", "encode_chat"):
        real = getattr(tok, name)

        def spy(arg, *a, _real=real, **k):
            texts = [arg] if isinstance(arg, str) else [m["content"] for m in arg]
            seen.extend(len(t) for t in texts)
            return _real(arg, *a, **k)
        monkeypatch.setitem(vars(tok), name, spy)   # undone by deleting it: setattr's undo would leave the bound
    return seen                                     # method on the instance, hiding later patches of the class


def test_the_tokens_page_tokenizes_at_most_the_servers_prompt_limit_of_a_files_prompt(page, tiny_model,
                                                                                      tiny_model_dir, run,
                                                                                      monkeypatch):
    monkeypatch.setenv("LLM_INSPECTOR_MAX_PROMPT_CHARS", "100")
    long = "The cat sat, " * 400                                          # 5,200 characters
    crafted = dataclasses.replace(run, settings=dataclasses.replace(run.settings, prompt=long, chat=True))
    at = page("tokens", crafted, tiny_model, str(tiny_model_dir))
    seen = encode_calls(monkeypatch, tiny_model.tokenizer)
    at.run()
    assert not at.exception, at.exception
    assert seen and max(seen) <= 100, seen
    assert [w.value for w in at.warning] == [
        "The run's prompt: only its first 100 of 5,200 characters are shown (LLM_INSPECTOR_MAX_PROMPT_CHARS). "
        "The template below is drawn from what is shown."]
    assert long[:100] in at.code[0].value and long[:101] not in at.code[0].value


def test_a_files_prompt_that_is_not_text_is_shown_not_a_crash(page, tiny_model, tiny_model_dir, run):
    crafted = dataclasses.replace(run, settings=dataclasses.replace(run.settings, prompt=12345, chat=True))
    at = page("tokens", crafted, tiny_model, str(tiny_model_dir)).run()
    assert not at.exception, at.exception
    assert [w.value for w in at.warning] == ["The run's prompt: it is not text (int); shown as written. The template "
                                             "below is drawn from what is shown."]
    assert "12345" in at.code[0].value
    # Overview, the run's model not loaded: the file's own prompt is what it shows
    at = page("overview", dataclasses.replace(crafted, model_name="another model"), tiny_model,
              str(tiny_model_dir)).run()
    assert not at.exception, at.exception
    assert at.code[0].value == "12345"
    assert any("it is not text (int); shown as written" in c.value for c in at.caption)


# ---- generations from a run's settings ----------------------------------------------------------------
@pytest.fixture(scope="module")
def long_run(tiny_model):
    """A run of a 360-token prompt (made under the default limits, as a trace file could bring it)."""
    r = inspect_run(tiny_model, RunSettings(prompt=" word" * 360, chat=False, max_new_tokens=2))
    assert r.n_prompt == 360
    return r


def count_model_work(monkeypatch) -> list[str]:
    calls: list[str] = []
    for name in ("forward", "logits"):      # (a generation runs the forward)
        real = getattr(Model, name)
        monkeypatch.setattr(Model, name, lambda self, *a, _real=real, _n=name, **k: calls.append(_n)
                            or _real(self, *a, **k))
    return calls


@pytest.mark.parametrize("name, button, section", [("repetition", "wl_run", "why_loop"),
                                                   ("nan_doctor", "rs_run", "find_rescue")])
def test_a_reruns_settings_are_checked_against_the_servers_limits(page, tiny_model, tiny_model_dir, long_run,
                                                                  monkeypatch, name, button, section):
    import inspector.ui.prescriptions as presc
    monkeypatch.setenv("LLM_INSPECTOR_MAX_PROMPT_TOKENS", "64")
    started = []
    monkeypatch.setattr(presc, section, lambda *a, **k: started.append(a))
    at = page(name, long_run, tiny_model, str(tiny_model_dir)).run()
    assert not at.exception, at.exception
    work = count_model_work(monkeypatch)
    at.button(key=button).click().run()
    assert not at.exception, at.exception
    (said,) = [as_shown(e.value) for e in at.error]
    assert said.startswith("This run's settings cannot be generated again on this server: the prompt is 360 tokens")
    assert "at most 64 (LLM_INSPECTOR_MAX_PROMPT_TOKENS)" in said
    assert started == [] and work == []


# ---- forged widget values -------------------------------------------------------------------------------
def spy(monkeypatch, target: str) -> list:
    """Record every call of module.function (the model work a forged value would reach)."""
    module, _, name = target.rpartition(".")
    mod = __import__(module, fromlist=[name])
    calls: list = []
    real = getattr(mod, name)
    monkeypatch.setattr(mod, name, lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


T = 7            # the run's positions: 4 prompt tokens and 3 generated
FORGED = [       # page, state set first, widget key, forged value, the message, the work it must not reach
    ("nan_doctor", {}, "nd_max_new", 10**6, "Max new tokens must be between 1 and 1,024, got 1,000,000",
     "engine.tools.doctor.run_doctor"),
    ("nan_doctor", {"nd_preset": "custom"}, "nd_layer", 99, "Layer must be between 0 and 1, got 99",
     "engine.tools.doctor.run_doctor"),
    ("nan_doctor", {"nd_preset": "custom"}, "nd_pos", -7, "Position must be between -1 and 1,000,000,000, got -7",
     "engine.tools.doctor.run_doctor"),
    ("nan_doctor", {"nd_preset": "custom"}, "nd_factor", float("nan"), "Scale factor must be a number, got NaN",
     "engine.tools.doctor.run_doctor"),
    ("nan_doctor", {}, "rs_tokens", 10**6, "Generated tokens compared must be between 1 and 16, got 1,000,000",
     "inspector.ui.prescriptions.find_rescue"),
    ("nan_doctor", {"rs_preset": "custom"}, "rs_inject", "x" * 1_001,
     "Injections is 1,001 characters long; this field takes at most 1,000", "inspector.ui.prescriptions.find_rescue"),
    ("repetition", {}, "wl_budget", 10**6, f"Most reruns must be between 5 and {MAX_RERUNS}, got 1,000,000",
     "inspector.ui.prescriptions.why_loop"),
    ("repetition", {}, "wl_budget", 2.5, "Most reruns must be a whole number, got 2.5",
     "inspector.ui.prescriptions.why_loop"),
    ("explain", {}, "ex_random_orders", 10**6, "Random orders for the baseline must be between 1 and 8, got 1,000,000",
     "engine.tools.attribution.attribute_inputs"),
    ("explain", {}, "ex_span", (0, 10**6), "Tokens to corrupt (last) must be between 0 and 3, got 1,000,000",
     "engine.tools.patching.replace_span"),
    ("explain", {}, "ex_span", (-3, 1), "Tokens to corrupt (first) must be between 0 and 3, got -3",
     "engine.tools.patching.replace_span"),
    ("explain", {}, "ex_replacement", "x" * 2_001,
     "The replacement is 2,001 characters long; this field takes at most 2,000", "engine.tools.patching.replace_span"),
    ("debugger", {"dbg_bp_kind": "Repeated n-gram"}, "dbg_bp_n", 10**6, "n must be between 1 and 20, got 1,000,000",
     "engine.tools.breakpoints.RepeatedNgram"),
    ("debugger", {"dbg_bp_kind": "Token"}, "dbg_bp_token", " Paris" * 1_000,
     "Token text is 6,000 characters long; this field takes at most 200", "inspector.views.debugger.token_ids_for"),
    ("attention", {}, "att_query", 10**6, f"Query position must be between 0 and {T - 1}, got 1,000,000",
     "inspector.views.attention.top_attended"),
    ("attention", {}, "att_topk", 0, "Top-k must be between 1 and 32, got 0", "inspector.views.attention.top_attended"),
    ("activations", {}, "act_lens_pos", 10**6, f"Position must be between 0 and {T - 1}, got 1,000,000",
     "inspector.views.activations.logit_lens"),
    ("activations", {}, "act_lens_pos", -1, f"Position must be between 0 and {T - 1}, got -1",
     "inspector.views.activations.logit_lens"),
    ("compare", {}, "cmp_seed", -1, "Seed (both runs) must be between 0 and 2,147,483,647, got -1",
     "inspector.views.compare.run_config"),
    ("compare", {"cmp_iv_a": "zero heads"}, "cmp_iv_layer_a", 5, "Layer must be between 0 and 1, got 5",
     "inspector.views.compare.run_config"),
    ("kv_cache", {}, "kv_calc_batch", 10**12, "Batch size must be between 1 and 1,024, got 1,000,000,000,000",
     "inspector.views.kv_cache.projection_table"),
]


@pytest.mark.parametrize("name, state, key, value, words, work", FORGED,
                         ids=[f"{c[0]}-{c[2]}-{c[3]!r:.12}" for c in FORGED])
def test_a_forged_number_is_one_message_and_no_model_work(page, tiny_model, tiny_model_dir, run, monkeypatch,
                                                          name, state, key, value, words, work):
    assert tiny_model.config.num_layers == 2 and len(run.ids) == T
    at = page(name, run, tiny_model, str(tiny_model_dir))
    for k, v in state.items():
        at.session_state[k] = v
    reached = spy(monkeypatch, work)
    forge(monkeypatch, key, value)
    at.run()
    assert not at.exception, at.exception
    assert [e.value for e in at.error] == [words]
    assert reached == []
