"""Bounds that hold before any work is done: a prompt longer than the model's context could ever hold is refused
without tokenizing it (the tokenizer holds the GIL: megabytes would stall every thread of a server), and stop
strings are bounded in count and length wherever settings are made (each is scanned after every token)."""
from __future__ import annotations

import pytest

from engine import InputError, RunSettings
from engine.generate import GenerationRun, prompt_ids
from engine.settings import MAX_STOP_CHARS, MAX_STOP_STRINGS

pytestmark = pytest.mark.unit


def test_the_longest_token_bounds_the_characters_a_context_can_hold(tiny_model):
    tok = tiny_model.tokenizer
    longest = max(len(tok.decode([i])) for i in range(tok.vocab_size))       # by hand: every token's text
    assert tok.max_token_chars >= longest and tok.max_token_chars < 4 * longest


def test_a_prompt_longer_than_any_context_is_refused_without_tokenizing(tiny_model, monkeypatch):
    most = tiny_model.context_length * tiny_model.tokenizer.max_token_chars
    calls = []
    tok = tiny_model.tokenizer
    for name in ("encode", "encode_chat"):     # on the instance: another test may have left one there
        real = getattr(tok, name)
        monkeypatch.setattr(tok, name, lambda *a, _r=real, **k: calls.append(1) or _r(*a, **k))
    for chat in (False, True):
        with pytest.raises(InputError, match=rf"the prompt is {most + 1:,} characters long; the model's context "
                                             rf"\({tiny_model.context_length:,} tokens of at most \d+ characters "
                                             rf"each\) can never hold more than {most:,}"):
            prompt_ids(tiny_model, "a" * (most + 1), chat=chat)
    with pytest.raises(InputError, match="can never hold more than"):
        prompt_ids(tiny_model, "hi", chat=True, system="s" * most)       # the system message counts too
    assert calls == []
    assert prompt_ids(tiny_model, "hello there", chat=False) and calls == [1]


def test_stop_strings_are_bounded_wherever_settings_are_made(tiny_model):
    ok = ["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS
    assert RunSettings(prompt="p", stop=ok).stop == tuple(ok)
    assert RunSettings.from_dict({"prompt": "p", "stop": ok}).stop == tuple(ok)
    for stop, msg in [(["s"] * 500_000, "500,000 stop strings given; at most 16 are accepted"),
                      (["y" * (MAX_STOP_CHARS + 1)], "a stop string is 201 characters long; at most 200"),
                      ([1, 2], "stop must be a list of strings")]:
        with pytest.raises(InputError, match=msg):
            RunSettings(prompt="p", stop=stop)
        with pytest.raises(InputError, match=msg):
            RunSettings.from_dict({"prompt": "p", "stop": stop})
        with pytest.raises(InputError, match=msg):
            GenerationRun(tiny_model, "p", stop=stop, max_new_tokens=1)
