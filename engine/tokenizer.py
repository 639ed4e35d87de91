"""Text <-> token ids, on top of the `tokenizers` library (the engine itself works in ids only).

Two things here are easy to get wrong and are the reason this wrapper exists:

* Special-token *text* typed by a user ("<|im_start|>") must stay text. `encode` uses a second backend instance
  with `encode_special_tokens=True` for that, built once, so no shared state is flipped per call (thread-safe).
  `encode_chat` lets only the chat template's own special tokens through as control tokens.
* Streaming: one token can end in the middle of a UTF-8 character. `StreamDecoder` wraps
  `tokenizers.decoders.DecodeStream`, which holds such bytes back until the character is complete.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cached_property
from itertools import islice
from pathlib import Path
from typing import Any, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend
from tokenizers.decoders import DecodeStream

from engine.errors import InputError
from engine.gguf_tokenizer import CHAR_TO_BYTE, tokenizer_files_from_gguf

# Turn-ending tokens a chat model stops on besides `eos_token` (an abridged form of llama.cpp's end-of-generation
# list). Each counts only if the vocabulary has it as a special token.
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>", "<end_of_turn>")

# Private-use code points to wrap special-token text found in messages with, so the rendered chat tells user
# text from template tokens (transformers' `sanitize_control_tokens` idea). Two that occur nowhere in the
# input are picked per call, so user text is never altered and cannot forge a marker.
_MARK_RANGE = range(0xF0000, 0xFFFFE)
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SURROGATE = re.compile("[\ud800-\udfff]")


class TokenizerError(InputError, ValueError):
    """A request this tokenizer cannot serve (an engine InputError, and a ValueError for plain callers)."""


class UnknownTokenError(TokenizerError, KeyError):
    """A special token asked for by text that this vocabulary does not have (never answered with None)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _check_text(text: str) -> str:
    """text, or TokenizerError if it holds a lone surrogate (not valid Unicode: the tokenizers binding would
    raise TypeError). Typical source: bytes decoded with errors='surrogateescape', e.g. a command-line argument."""
    if m := _SURROGATE.search(text):
        raise TokenizerError(f"the text has a lone surrogate U+{ord(m.group()):04X} at character {m.start() + 1}: "
                             "it is not valid Unicode (invalid UTF-8 input?)")
    return text


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_str(value: Any) -> str | None:
    # tokenizer_config.json writes a token either as a string or as a serialized AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _strings(obj: Any) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in _strings(k) + _strings(v)]
    if isinstance(obj, (list, tuple)):
        return [s for v in obj for s in _strings(v)]
    return []


def _mark(obj: Any, special: re.Pattern[str], mark_open: str, mark_close: str) -> Any:
    """Copy of `obj` with every special-token text in its strings wrapped in the two markers."""
    if isinstance(obj, str):
        return special.sub(lambda m: f"{mark_open}{m.group(0)}{mark_close}", obj)
    if isinstance(obj, dict):
        return {k: _mark(v, special, mark_open, mark_close) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_mark(v, special, mark_open, mark_close) for v in obj]
    return obj


class StreamDecoder:
    """Per-run incremental detokenizer: `step(id)` returns only text whose characters are complete."""

    def __init__(self, backend: _Backend) -> None:
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=False)
        self._ids: list[int] = []
        self._emitted: list[str] = []

    def step(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        chunk = self._stream.step(self._backend, int(token_id))  # None while a character is still open
        if chunk:
            self._emitted.append(chunk)
        return chunk or ""

    def flush(self) -> str:
        """What the held-back tokens decode to at the end (U+FFFD if the stream really stopped mid-character)."""
        full = self._backend.decode(self._ids, skip_special_tokens=False)
        done = "".join(self._emitted)
        rest = full[len(done):] if full.startswith(done) else ""
        if rest:
            self._emitted.append(rest)
        return rest


# The spelling of an id in the model's vocabulary that the tokenizer has no entry for (a padded vocabulary: Qwen2.5's
# 151,936 rows for 151,665 tokens, Llama-3's shapes beside a smaller tokenizer): its id, never a made-up text. Its
# decoded text is "" (the tokenizers library's decode skips it).
NO_TEXT = "⟨id {} · no text⟩"


class Tokenizer:
    """A Hugging Face `tokenizer.json` plus the bits of tokenizer_config.json generation needs."""

    def __init__(self, tokenizer_json: str, config: dict[str, Any] | None = None,
                 extra_eos_ids: Sequence[int] = ()) -> None:
        config = dict(config or {})
        self._backend = _Backend.from_str(tokenizer_json)
        # The same tokenizer with special tokens disabled: user-typed "<|im_end|>" becomes plain text.
        self._plain = _Backend.from_str(tokenizer_json)
        self._plain.encode_special_tokens = True
        added = self._backend.get_added_tokens_decoder()
        self._added_ids: dict[str, int] = {tok.content: i for i, tok in added.items()}
        self._special_ids: frozenset[int] = frozenset(i for i, tok in added.items() if tok.special)
        specials = sorted((added[i].content for i in self._special_ids), key=len, reverse=True)
        # Longest first, so a token wins over the shorter tokens it contains (as tokenizers' matcher does).
        self._special_re = re.compile("|".join(map(re.escape, specials)) or "(?!)")
        decoder = json.loads(tokenizer_json).get("decoder") or {}
        parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
        self._byte_level = any(p.get("type") == "ByteLevel" for p in parts)

        self.vocab_size: int = self._backend.get_vocab_size(with_added_tokens=True)
        self.model_vocab_size: int = self.vocab_size      # the model's embedding rows (cover)
        self.chat_template: str | None = config.get("chat_template")
        self.special_tokens: dict[str, str] = {
            name: tok for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (tok := _token_str(config.get(name))) is not None
        }
        self.bos_id: int | None = self._id_or_none(self.special_tokens.get("bos_token"))
        eos = [self._id_or_none(self.special_tokens.get("eos_token")), *extra_eos_ids]
        eos += [self._added_ids[t] for t in CHAT_END_TOKENS if self._added_ids.get(t) in self._special_ids]
        self.eos_ids: list[int] = list(dict.fromkeys(int(i) for i in eos if i is not None))

    # ---- construction ---------------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json, special_tokens_map.json, generation_config.json)."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"No tokenizer.json at {tokenizer_file}")
        config = _read_json(root / "tokenizer_config.json")
        for name, value in _read_json(root / "special_tokens_map.json").items():
            config.setdefault(name, value)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is None and (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        if template is None:
            template = _read_json(root / "chat_template.json").get("chat_template")
        config["chat_template"] = template
        gen_eos = _read_json(root / "generation_config.json").get("eos_token_id")
        extra = gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else []
        return cls(tokenizer_file.read_text(encoding="utf-8"), config, extra_eos_ids=extra)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build straight from a GGUF file's metadata (see engine.gguf_tokenizer)."""
        from engine.gguf_file import open_gguf

        tokenizer_json, config = tokenizer_files_from_gguf(open_gguf(path))
        return cls(tokenizer_json, config)

    # ---- ids <-> text ---------------------------------------------------------------------------------------

    def encode(self, text: str, *, allow_special: bool = False, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token text counts as control tokens only if `allow_special`."""
        backend = self._backend if allow_special else self._plain
        return list(backend.encode(_check_text(text), add_special_tokens=add_special_tokens).ids)

    def encode_with_offsets(self, text: str, *, allow_special: bool = False
                            ) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids plus each token's (start, end) character span in `text` (a split character: its whole span)."""
        backend = self._backend if allow_special else self._plain
        enc = backend.encode(_check_text(text), add_special_tokens=False)
        return list(enc.ids), [(int(s), int(e)) for s, e in enc.offsets]

    def special_texts(self, text: str) -> list[str]:
        """The special tokens' texts written in `text`, in order (what encode(text, allow_special=True) would read as
        control tokens), found without tokenizing."""
        return self._special_re.findall(_check_text(text))

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its vocabulary string's length: byte-level strings
        have a character per byte, so this bounds the decoded text too). A text longer than n times this
        has more than n tokens, which a caller can know without tokenizing it."""
        return max(1, max((len(t) for t in self._backend.get_vocab(with_added_tokens=True)), default=1))

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self._backend)

    # ---- single tokens --------------------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        """The vocabulary spelling, e.g. 'Ġthe' (byte-level) or '▁the' (sentencepiece). An id past the tokenizer's
        entries but inside the model's embedding (cover: a padded vocabulary, which a model can still emit) is
        spelled NO_TEXT with its id, so every table and label shows it for what it is; any other id is an
        IndexError."""
        text = self._backend.id_to_token(int(token_id))
        if text is None:
            if self.vocab_size <= int(token_id) < self.model_vocab_size:
                return NO_TEXT.format(int(token_id))
            raise IndexError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return text

    def cover(self, model_vocab_size: int) -> None:
        """Say that the model this tokenizer serves has model_vocab_size rows of embedding (at least vocab_size):
        the ids past the tokenizer's own entries are the model's padding, with no text (token_text)."""
        if model_vocab_size < self.vocab_size:
            raise ValueError(f"the model's vocabulary ({model_vocab_size}) is smaller than the tokenizer's "
                             f"({self.vocab_size})")
        self.model_vocab_size = int(model_vocab_size)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes the token stands for; may be part of a UTF-8 character."""
        text = self.token_text(token_id)
        if text in self._added_ids:
            return text.encode("utf-8")
        if self._byte_level and all(c in CHAR_TO_BYTE for c in text):
            return bytes(CHAR_TO_BYTE[c] for c in text)
        if m := _BYTE_FALLBACK.fullmatch(text):
            return bytes([int(m.group(1), 16)])
        return text.replace("\u2581", " ").encode("utf-8")  # sentencepiece writes a space as '▁'

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self._special_ids

    def special_token_id(self, text: str) -> int:
        """Id of an added (special or user-defined) token, by its text."""
        if text in self._added_ids:
            return self._added_ids[text]
        known = ", ".join(sorted(self._added_ids)) or "none"
        raise UnknownTokenError(f"{text!r} is not a special token of this tokenizer (it has: {known})")

    def _id_or_none(self, text: str | None) -> int | None:
        return None if text is None else self._backend.token_to_id(text)

    # ---- chat -----------------------------------------------------------------------------------------------

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise TokenizerError("This tokenizer has no chat_template (none in tokenizer_config.json); "
                                 "cannot render a chat. Use encode() on plain text instead.")

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            # Like transformers: no HTML escaping, unlike jinja's own tojson.
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        # Same environment as transformers' apply_chat_template: templates are untrusted code, so sandboxed.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        _check_text("".join(_strings(messages)))
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except (jinja2.TemplateError, TypeError) as e:   # a broken template: syntax, raise_exception, not a str
            raise TokenizerError(f"the model's chat template failed: {type(e).__name__}: {e}") from None

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The chat template applied to `messages`, as text."""
        return self._render(messages, add_generation_prompt)

    def encode_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    allow_special_in_content: bool = False) -> list[int]:
        """Ids of the rendered chat. Only the template's own special tokens become control tokens, unless
        `allow_special_in_content`; special-token text inside messages is encoded as the plain text it is."""
        if allow_special_in_content:
            return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt),
                               allow_special=True)
        used = set("".join(_strings(messages)) + (self.chat_template or ""))
        mark_open, mark_close = islice((chr(c) for c in _MARK_RANGE if chr(c) not in used), 2)
        rendered = self._render(_mark(messages, self._special_re, mark_open, mark_close), add_generation_prompt)
        # group 1: marked (user-typed) special text; group 2: a template special token; else a lone marker.
        pattern = re.compile(f"{mark_open}({self._special_re.pattern}){mark_close}"
                             f"|[{mark_open}{mark_close}]|({self._special_re.pattern})")
        ids: list[int] = []
        text: list[str] = []
        pos = 0
        for m in pattern.finditer(rendered):
            text.append(rendered[pos:m.start()])
            if m.group(1) is not None:
                text.append(m.group(1))  # stays inside the surrounding plain text, tokenized as text
            elif m.group(2) is not None:
                ids += self._plain.encode("".join(text), add_special_tokens=False).ids
                text.clear()
                ids.append(self._added_ids[m.group(2)])
            pos = m.end()  # a lone marker (the template cut a marked token apart) is dropped
        text.append(rendered[pos:])
        ids += self._plain.encode("".join(text), add_special_tokens=False).ids
        return ids
