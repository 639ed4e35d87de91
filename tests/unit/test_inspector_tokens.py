"""inspector.views.tokens against hand-computed values: visible whitespace, bytes, character offsets, escaping,
the streaming decoder table. Uses the real SmolLM2 tokenizer (no model weights)."""
from __future__ import annotations

import html
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engine import Candidate, Step
from engine.tokenizer import Tokenizer
from inspector.views.tokens import (
    bytes_label,
    char_offsets,
    chat_messages,
    run_token_table,
    spans_html,
    steps_table,
    stream_table,
    token_counts,
    token_labels,
    token_table,
    visible,
)


@pytest.fixture(scope="module")
def tok(tokenizer_files) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_files)


def test_visible_whitespace_and_controls():
    assert visible(" a\n\tb\r\x01\x7f") == "·a⏎→b␍\\x01\\x7f"
    assert visible("héllo 👋") == "héllo·👋"


def test_bytes_label_marks_partial_characters():
    assert bytes_label(b"\xc3\xa9") == "é"
    assert bytes_label(b" \xf0\x9f") == " ‹f0›‹9f›"
    assert bytes_label(b"\x8b") == "‹8b›"


def test_char_offsets_by_hand():
    pieces = [b"h", b"\xc3\xa9", b"llo", b" \xf0\x9f", b"\x91", b"\x8b"]
    text, spans = char_offsets(pieces)
    assert text == "héllo 👋"
    assert spans == [(0, 1), (1, 2), (2, 5), (5, 7), (6, 7), (6, 7)]     # the emoji's 3 pieces share (6, 7)
    assert char_offsets([b"a", b"\xff", b"b"]) == ("a\ufffdb", [(0, 1), (1, 2), (2, 3)])
    assert char_offsets([b"a", b"\xf0\x9f"]) == ("a\ufffd\ufffd", [(0, 1), (1, 3)])   # cut-off character
    assert char_offsets([b"a", b"", b"b"]) == ("ab", [(0, 1), (1, 1), (1, 2)])
    assert char_offsets([]) == ("", [])


def test_token_table_on_known_text(tok):
    ids = tok.encode("héllo 👋")
    t = token_table(tok, ids)
    assert t["id"].tolist() == ids == [88, 2756, 31394, 15107, 235, 229]
    assert t["bytes"].tolist() == ["68", "c3 a9", "6c 6c 6f", "20 f0 9f", "91", "8b"]
    assert t["n_bytes"].tolist() == [1, 2, 3, 3, 1, 1]
    assert list(zip(t["start"], t["end"])) == [(0, 1), (1, 2), (2, 5), (5, 7), (6, 7), (6, 7)]
    assert t["text"].tolist() == ["h", "é", "llo", "·‹f0›‹9f›", "‹91›", "‹8b›"]
    assert t["token"].tolist()[:2] == ["h", "Ã©"]                          # vocabulary spelling
    assert not t["special"].any() and (t["part"] == "prompt").all()
    assert t["position"].tolist() == list(range(6))
    assert token_counts(tok, ids) == {"characters": 7, "tokens": 6, "bytes": 11, "bytes_per_token": 11 / 6,
                                      "special": 0}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30))
def test_offsets_and_bytes_agree_with_the_tokenizer(tok, text):
    ids, offsets = tok.encode_with_offsets(text)
    # SmolLM2's vocabulary has no token for 21 byte values (0x04, 0x1d, 0xf1, ...): such text cannot round-trip
    assume(tok.decode(ids) == text)
    t = token_table(tok, ids)
    assert b"".join(bytes.fromhex(h.replace(" ", "")) for h in t["bytes"]).decode() == text
    assert list(zip(t["start"], t["end"])) == offsets


def test_special_tokens_and_run_table(tok):
    prompt = tok.encode_chat(chat_messages("hi"))
    gen = tok.encode("Hello") + [tok.special_token_id("<|im_end|>")]
    t = run_token_table(tok, prompt, gen)
    assert t["id"].tolist() == prompt + gen
    assert t["position"].tolist() == list(range(len(prompt) + len(gen)))
    assert t["part"].tolist() == ["prompt"] * len(prompt) + ["generated"] * len(gen)
    assert t["special"].tolist() == [i in (1, 2) for i in prompt + gen]
    first = t.iloc[0]
    assert (first["text"], first["start"], first["end"]) == ("<|im_start|>", 0, 12)
    assert first["bytes"] == "<|im_start|>".encode().hex(" ")
    g0 = t[t["part"] == "generated"].iloc[0]
    assert (g0["start"], g0["position"]) == (0, len(prompt))                # offsets count within each part
    assert token_counts(tok, prompt)["special"] == prompt.count(1) + prompt.count(2)


def test_spans_escape_user_text(tok):
    text = 'a <script>alert("x")</script> & <b title="q">b</b>'
    t = token_table(tok, tok.encode(text))
    out = spans_html(t)
    assert set(re.findall(r"<(/?\w+)", out)) == {"div", "/div", "span", "/span"}
    assert out.count("<span ") == len(t)
    inner = html.unescape(re.sub(r"<[^>]*>", "", out))
    assert inner == visible(text)
    titles = re.findall(r'title="([^"]*)"', out)                            # attribute quotes are escaped
    assert len(titles) == len(t) and all("<" not in x for x in titles)
    assert any("&quot;" in x for x in titles)


def test_special_tokens_are_drawn_distinctly(tok):
    out = spans_html(run_token_table(tok, tok.encode_chat(chat_messages("hi")), tok.encode("ok")))
    assert out.count("background:#444") == 5        # <|im_start|> system, user, assistant; <|im_end|> twice
    assert out.count("border-bottom:2px") == 1                            # the one generated token


def test_stream_table_holds_back_incomplete_characters(tok):
    ids = tok.encode("héllo 👋 世界")
    s = stream_table(tok, ids)
    assert s["emitted"].tolist() == ["h", "é", "llo", "", "", " 👋", " ", "", "世", "", "", "界"]
    assert "".join(s["emitted"]) == "héllo 👋 世界"
    assert s["complete"].tolist() == [e != "" for e in s["emitted"]]
    assert s["bytes"].tolist()[3:6] == ["20 f0 9f", "91", "8b"]
    cut = stream_table(tok, tok.encode("a👋")[:-1])                        # stops inside the emoji
    assert cut["emitted"].tolist() == ["a", "", "", "\ufffd"] and cut["token"].iloc[-1] == "(flush)"


def test_token_labels_are_unique_and_short(tok):
    ids = tok.encode("the the the " + "x" * 40)
    labels = token_labels(tok, ids, max_len=5)
    assert len(set(labels)) == len(ids)
    assert labels[0] == "0 the" and labels[1] == "1 ·the"
    assert all(len(lab.split(" ", 1)[1]) <= 6 for lab in labels)


def test_steps_table():
    steps = [Step(index=i, position=10 + i, token_id=100 + i, text=["é", "\n"][i], prob=0.5, model_prob=0.25,
                  entropy=1.5, kept=3, top=[Candidate(7 + j, f" t{j}", 0.1 * (5 - j)) for j in range(6)],
                  seconds={}) for i in range(2)]
    t = steps_table(steps)
    assert t["step"].tolist() == [0, 1] and t["position"].tolist() == [10, 11]
    assert t["token"].tolist() == ["é", "⏎"]
    assert t["top5"].iloc[0] == "'·t0' 0.500  '·t1' 0.400  '·t2' 0.300  '·t3' 0.200  '·t4' 0.100"
    assert (t["prob"] == 0.5).all() and (t["model_prob"] == 0.25).all() and (t["kept"] == 3).all()


def test_split_characters_appear_whole_in_the_token_strip(tok):
    """As the stream test shows, ' 👋' is three tokens here (bytes 20 f0 9f | 91 | 8b), 世 two and 界 three: the
    strip shows each character once, in one span whose hover lists its byte pieces."""
    ids = tok.encode("héllo 👋 世界")
    out = spans_html(run_token_table(tok, ids[:2], ids[2:]))
    assert "3 tokens spell &#x27;·👋&#x27;" in out and "2 tokens spell &#x27;世&#x27;" in out
    assert "3 tokens spell &#x27;界&#x27;" in out
    assert "‹f0›" not in out.split("title=")[0]                 # no byte label drawn as text outside hovers
    texts = re.findall(r">([^<]*)</span>", out)
    assert "".join(texts) == "h" + "é" + "llo" + "·👋" + "·" + "世" + "界"
