"""Tokens as a user can inspect them: ids, vocabulary spelling, raw bytes, character offsets, special marks,
coloured HTML spans, and how the streaming detokenizer turns byte pieces back into characters.

Works from token ids and the engine's tokenizer (token_text, token_bytes, is_special, stream) only, so what
is shown is exactly what the model saw, whatever text the ids came from (a plain prompt, a rendered chat,
generated tokens).
"""
from __future__ import annotations

import html
from typing import Sequence

import pandas as pd

# Whitespace made visible: a space, newline, tab or carriage return would otherwise vanish in a table or span.
VISIBLE = {" ": "·", "\n": "⏎", "\t": "→", "\r": "␍"}
PALETTE = ("#fde2e4", "#e2ece9", "#dfe7fd", "#fff1c1", "#e8dff5", "#d7f0d2")
SPECIAL_STYLE = "background:#444;color:#fff;font-weight:600"
TABLE_COLUMNS = ["position", "id", "token", "text", "bytes", "n_bytes", "start", "end", "special", "part"]


def visible(text: str) -> str:
    """Text with whitespace drawn (· space, ⏎ newline, → tab, ␍ carriage return) and other controls as \\xNN."""
    out = []
    for c in text:
        if c in VISIBLE:
            out.append(VISIBLE[c])
        elif ord(c) < 32 or ord(c) == 127:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return "".join(out)


def bytes_label(b: bytes) -> str:
    """A token's bytes as text; bytes that are only part of a UTF-8 character are written ‹f0›."""
    s = b.decode("utf-8", errors="surrogateescape")
    return "".join(f"‹{ord(c) - 0xDC00:02x}›" if 0xDC80 <= ord(c) <= 0xDCFF else c for c in s)


def hex_bytes(b: bytes) -> str:
    return " ".join(f"{x:02x}" for x in b)


def char_offsets(pieces: Sequence[bytes]) -> tuple[str, list[tuple[int, int]]]:
    """The text the byte pieces spell, and each piece's (start, end) character span in it.

    A piece that holds part of a multi-byte character spans that whole character (as `tokenizers` offsets
    do), so the pieces of one emoji share its span. Invalid bytes count as one character (U+FFFD) each."""
    data = b"".join(pieces)
    chars = data.decode("utf-8", errors="surrogateescape")
    char_of_byte: list[int] = []
    for ci, c in enumerate(chars):
        n = 1 if 0xDC80 <= ord(c) <= 0xDCFF else len(c.encode("utf-8"))
        char_of_byte.extend([ci] * n)
    text = "".join("\ufffd" if 0xDC80 <= ord(c) <= 0xDCFF else c for c in chars)
    spans, b0 = [], 0
    for p in pieces:
        if not p:
            spans.append((char_of_byte[b0] if b0 < len(char_of_byte) else len(text),) * 2)
            continue
        spans.append((char_of_byte[b0], char_of_byte[b0 + len(p) - 1] + 1))
        b0 += len(p)
    return text, spans


def token_table(tok, ids: Sequence[int], *, part: str = "prompt", start: int = 0) -> pd.DataFrame:
    """One row per token: absolute position (from `start`), id, vocabulary spelling, visible text, bytes,
    character offsets into the text these ids spell, whether it is a special token, and the part."""
    ids = [int(i) for i in ids]
    pieces = [tok.token_bytes(i) for i in ids]
    _, spans = char_offsets(pieces)
    return pd.DataFrame({
        "position": range(start, start + len(ids)), "id": ids,
        "token": [tok.token_text(i) for i in ids],
        "text": [visible(bytes_label(p)) for p in pieces],
        "bytes": [hex_bytes(p) for p in pieces], "n_bytes": [len(p) for p in pieces],
        "start": [s for s, _ in spans], "end": [e for _, e in spans],
        "special": [bool(tok.is_special(i)) for i in ids], "part": part,
    }, columns=TABLE_COLUMNS)


def run_token_table(tok, prompt_ids: Sequence[int], generated_ids: Sequence[int]) -> pd.DataFrame:
    """Prompt and generated tokens in one table; offsets count within each part's own text."""
    parts = [token_table(tok, prompt_ids, part="prompt"),
             token_table(tok, generated_ids, part="generated", start=len(prompt_ids))]
    kept = [p for p in parts if len(p)]
    return pd.concat(kept, ignore_index=True) if kept else parts[0]


def token_counts(tok, ids: Sequence[int]) -> dict[str, float]:
    """Characters, tokens, bytes, bytes per token and special tokens of the text these ids spell."""
    pieces = [tok.token_bytes(int(i)) for i in ids]
    text, _ = char_offsets(pieces)
    n, nb = len(pieces), sum(len(p) for p in pieces)
    return {"characters": len(text), "tokens": n, "bytes": nb, "bytes_per_token": nb / n if n else 0.0,
            "special": sum(bool(tok.is_special(int(i))) for i in ids)}


def _groups(table: pd.DataFrame) -> list[list]:
    """Rows in runs of tokens that share characters: the pieces of one emoji or CJK character (their character
    spans overlap) form one run; every other token is a run of its own."""
    groups: list[list] = []
    for r in table.itertuples(index=False):
        prev = groups[-1][-1] if groups else None
        if prev is not None and r.part == prev.part and not (r.special or prev.special) and r.start < prev.end:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def spans_html(table: pd.DataFrame) -> str:
    """Coloured token spans; hover shows id, visible text, bytes and offsets. Tokens that each hold part of
    one character (an emoji split into byte pieces) are drawn as that character, in one span whose hover
    lists every piece. Every piece of token text is HTML-escaped (text and attribute), so nothing a user
    typed or a model generated can inject markup."""
    out = ['<div style="font-family:monospace;line-height:1.9;white-space:pre-wrap;word-break:break-all">']
    for g in _groups(table):
        r = g[0]
        tips = [f"position {x.position} · id {x.id} · {x.text!r} · bytes {x.bytes or '—'} · chars {x.start}–{x.end}"
                + (" · special" if x.special else "") for x in g]
        style = SPECIAL_STYLE if r.special else f"background:{PALETTE[r.position % len(PALETTE)]}"
        if r.part == "generated" and not r.special:
            style += ";border-bottom:2px solid #c0392b"
        if len(g) > 1:
            data = b"".join(bytes.fromhex(x.bytes.replace(" ", "")) for x in g)
            label = visible(data.decode("utf-8", errors="replace"))
            tips.insert(0, f"{len(g)} tokens spell {label!r}")
            style += ";outline:1px dashed #888"
        else:
            label = r.text.replace("⏎", "⏎\n") if not r.special else r.text
        out.append(f'<span title="{html.escape(chr(10).join(tips), quote=True)}" style="{style};padding:0 1px;'
                   f'margin:0 1px;border-radius:3px">{html.escape(label, quote=True)}</span>')
    out.append("</div>")
    return "".join(out)


TYPED = "[typed text: {}]"


def seen_prompt_text(tok, ids: Sequence[int]) -> tuple[str, int]:
    """The prompt as the model saw it, and how many typed spellings of a special token it holds. Real special
    tokens (ids the tokenizer marks special) read as themselves; text that merely spells one, read by the
    model as ordinary characters ("<|im_end|>" typed in a prompt with special-token text off), is written
    [typed text: <|im_end|>], so the two never look alike. Without such text it is exactly tok.decode(ids)."""
    out: list[str] = []
    pending: list[int] = []
    typed = 0

    def flush() -> None:
        nonlocal typed
        if not pending:
            return
        text = tok.decode(pending)
        pending.clear()
        ids2, offsets = tok.encode_with_offsets(text, allow_special=True)
        last = 0
        for s, e in (o for i, o in zip(ids2, offsets) if tok.is_special(i)):
            out.extend([text[last:s], TYPED.format(text[s:e])])
            last, typed = e, typed + 1
        out.append(text[last:])
    for i in (int(x) for x in ids):
        if tok.is_special(i):
            flush()
            out.append(tok.decode([i]))
        else:
            pending.append(i)
    flush()
    return "".join(out), typed


def stream_table(tok, ids: Sequence[int]) -> pd.DataFrame:
    """What the streaming decoder emits token by token: '' while a character is still incomplete, then the
    whole character at the token that completes it. A last row 'flush' shows bytes left open at the end."""
    dec = tok.stream()
    rows = []
    for k, i in enumerate(ids):
        b = tok.token_bytes(int(i))
        emitted = dec.step(int(i))
        rows.append({"index": k, "id": int(i), "token": tok.token_text(int(i)), "bytes": hex_bytes(b),
                     "emitted": emitted, "emitted_visible": visible(emitted), "complete": emitted != ""})
    rest = dec.flush()
    if rest:
        rows.append({"index": len(rows), "id": None, "token": "(flush)", "bytes": "", "emitted": rest,
                     "emitted_visible": visible(rest), "complete": True})
    return pd.DataFrame(rows, columns=["index", "id", "token", "bytes", "emitted", "emitted_visible", "complete"])


def token_labels(tok, ids: Sequence[int], max_len: int = 12) -> list[str]:
    """Short, unique-by-position axis labels: '12 ·the'."""
    out = []
    for p, i in enumerate(ids):
        t = visible(bytes_label(tok.token_bytes(int(i))))
        out.append(f"{p} {t[:max_len] + '…' if len(t) > max_len else t}")
    return out


def chat_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """The messages the engine renders for a chat prompt (engine.generate.prompt_ids)."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def steps_table(steps, tok=None) -> pd.DataFrame:
    """One row per generation step: token, probabilities, entropy, kept tokens, top-5 candidates. With `tok`
    the token column shows the token's own text (else the text emitted at that step, '' mid-character)."""
    def label(s) -> str:
        return visible(bytes_label(tok.token_bytes(s.token_id)) if tok is not None else s.text)
    return pd.DataFrame([{
        "step": s.index, "position": s.position, "id": s.token_id, "token": label(s),
        "prob": s.prob, "model_prob": s.model_prob, "entropy": s.entropy, "kept": s.kept,
        "top5": "  ".join(f"{visible(c.text)!r} {c.prob:.3f}" for c in s.top[:5]),
    } for s in steps], columns=["step", "position", "id", "token", "prob", "model_prob", "entropy", "kept",
                                "top5"])
