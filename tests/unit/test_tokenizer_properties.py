"""Property-based tests (hypothesis) of the tokenizer wrapper and the streaming detokenizer, broader than
tests/test_tokenizer.py: text built from special-token text, its fragments, emoji, combining marks, digits
and whitespace; arbitrary id sequences; chat messages; and the streamed text of real generations."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engine import SamplingParams
from engine.generate import generate
from engine.gguf_tokenizer import BYTE_TO_CHAR
from engine.tokenizer import Tokenizer

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>", "<jupyter_code>"]
PIECES = SPECIAL + ["<|", "|>", "<", ">", "|", "im_start", "\n", "\n\n", "  ", "\t", "\r\n", "12345", " 7", "👋🏽",
                    "👨‍👩‍👧", "é", "e\u0301", "\u202e", "\u200b", "你好", "ß", "\U0001F916", "'s", " the"]


@pytest.fixture(scope="module")
def tok(tokenizer_files) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_files)


@pytest.fixture(scope="module")
def missing_bytes(tokenizer_files) -> frozenset[int]:
    """Bytes with no token in this vocabulary (SmolLM2 lacks 21): every implementation drops them."""
    vocab = json.loads((tokenizer_files / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    return frozenset(b for b in range(256) if BYTE_TO_CHAR[b] not in vocab)


chars = st.characters(codec="utf-8")                      # every code point but surrogates
texts = st.lists(st.one_of(st.sampled_from(PIECES), st.text(chars, max_size=6)), max_size=10).map("".join)
ids_any = st.lists(st.integers(0, 49151), max_size=40)


def representable(text: str, missing: frozenset[int]) -> bool:
    return not missing & set(text.encode("utf-8"))


def stream(tok: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    d = tok.stream()
    return [d.step(i) for i in ids], d.flush()


# ---- encode / decode ------------------------------------------------------------------------------------------

@FAST
@given(text=texts)
def test_round_trip_with_and_without_special_tokens(tok, missing_bytes, text):
    assume(representable(text, missing_bytes))
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, allow_special=True)) == text


@FAST
@given(text=texts)
def test_typed_special_text_never_becomes_a_control_token(tok, text):
    assert not any(tok.is_special(i) for i in tok.encode(text))
    opted = [tok.token_text(i) for i in tok.encode(text, allow_special=True) if tok.is_special(i)]
    present = [s for s in SPECIAL if s in text]
    assert set(opted) <= set(present) and (not present or opted)   # opting in turns exactly those into tokens


@FAST
@given(text=texts)
def test_offsets_cover_the_text_in_order(tok, missing_bytes, text):
    ids, offsets = tok.encode_with_offsets(text)
    assert ids == tok.encode(text)
    assert all(0 <= s <= e <= len(text) for s, e in offsets)
    assert [s for s, _ in offsets] == sorted(s for s, _ in offsets)
    if representable(text, missing_bytes):
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


@FAST
@given(parts=st.lists(texts, min_size=2, max_size=4))
def test_encoding_is_a_pure_function(tok, parts):
    """Same text, same ids, whichever thread asks and whatever was encoded before (shared by all sessions)."""
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(tok.encode, parts * 3))
    assert together == [tok.encode(p) for p in parts * 3]


# ---- streaming detokenizer vs one-shot decoding ---------------------------------------------------------------

@FAST
@given(ids=ids_any)
def test_stream_of_any_ids_equals_one_shot_decode(tok, ids):
    steps, rest = stream(tok, ids)
    assert "".join(steps) + rest == tok.decode(ids)
    emitted = ""
    for k, piece in enumerate(steps):       # never takes text back: each step extends a prefix of the decode
        emitted += piece
        assert tok.decode(ids[: k + 1]).startswith(emitted)


@FAST
@given(text=texts, cuts=st.lists(st.integers(0, 40), max_size=4))
def test_stream_of_encoded_text_holds_back_only_partial_characters(tok, missing_bytes, text, cuts):
    assume(representable(text, missing_bytes))
    assume("\ufffd" not in text)       # a U+FFFD the text itself holds is its own character, not a held-back one
    ids = tok.encode(text, allow_special=True)
    for c in cuts:                          # a stream cut anywhere ends in U+FFFD only if it ends mid-character
        steps, rest = stream(tok, ids[:c])
        assert "".join(steps) + rest == tok.decode(ids[:c])
        assert not any("\ufffd" in s for s in steps)
    steps, rest = stream(tok, ids)
    assert "".join(steps) == text and rest == ""


@FAST
@given(a=texts, b=ids_any)
def test_stream_of_text_then_arbitrary_ids(tok, a, b):
    ids = tok.encode(a) + b
    steps, rest = stream(tok, ids)
    assert "".join(steps) + rest == tok.decode(ids)


# ---- chat -----------------------------------------------------------------------------------------------------

@FAST
@given(contents=st.lists(texts, min_size=1, max_size=3), system=st.none() | texts)
def test_chat_content_cannot_inject_control_tokens(tok, missing_bytes, contents, system):
    roles = ["user", "assistant"]
    msgs = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": roles[k % 2], "content": c} for k, c in enumerate(contents)]
    blank = [{**m, "content": "x"} for m in msgs]
    ids = tok.encode_chat(msgs)
    assert [i for i in ids if tok.is_special(i)] == [i for i in tok.encode_chat(blank) if tok.is_special(i)]
    if all(representable(m["content"], missing_bytes) for m in msgs):
        assert tok.decode(ids) == tok.render_chat(msgs)


# ---- the engine's streamed text of real generations -----------------------------------------------------------

@SLOW
@given(prompt=texts.filter(lambda t: t.strip()), seed=st.integers(0, 2**31 - 1), chat=st.booleans())
def test_generation_streams_exactly_its_decoded_tokens(tiny_model, prompt, seed, chat):
    """The tiny random model samples arbitrary tokens, byte pieces of characters among them: the text
    streamed step by step (plus the final flush) is the one-shot decoding of the generated ids."""
    tok = tiny_model.tokenizer
    streamed: list[str] = []
    r = generate(tiny_model, prompt, max_new_tokens=12, seed=seed, chat=chat,
                 on_token=lambda s: streamed.append(s.text), params=SamplingParams(temperature=1.5))
    ids = r.token_ids[:-1] if r.stop_reason == "eos" else r.token_ids
    assert r.text == tok.decode(ids)
    assert r.text.startswith("".join(streamed)) and [s.text for s in r.steps] == streamed
