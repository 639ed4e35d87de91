"""Rebuild a Hugging Face `tokenizer.json` + `tokenizer_config.json` from a GGUF file's metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, merges, token types and special ids as
`tokenizer.ggml.*` fields. This mirrors transformers' GGUF loader (`integrations/gguf/gguf_tokenizer_mapping.py`:
`byte_level_tokenizer`, `add_gguf_special_tokens`, `set_split_regex`) with one deliberate difference:
`tokenizer.ggml.pre` is honoured for 'smollm' (digits split one by one *before* the GPT-2 regex), as llama.cpp
and SmolLM2's original tokenizer.json do. transformers 5.x ignores 'smollm' and so tokenizes whitespace before a
digit differently ("a  1" -> a|Ġ|Ġ|1 there, a|ĠĠ|1 here and in llama.cpp).

Only byte-level BPE (`tokenizer.ggml.model == 'gpt2'`) is supported; anything else raises
UnsupportedTokenizerError (a ValueError and an engine UnsupportedModelError) naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.errors import UnsupportedModelError
from engine.gguf_file import GGUFFile


class UnsupportedTokenizerError(UnsupportedModelError, ValueError):
    """A GGUF tokenizer this module cannot rebuild; the message names the metadata field."""


# llama.cpp token types (gguf.TokenType): CONTROL tokens are special, USER_DEFINED are matched whole but not special.
_CONTROL = int(gguf.TokenType.CONTROL)
_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)

# Llama 3's split regex, as transformers and llama.cpp use it for 'llama-bpe'.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SUPPORTED_MODELS = ("gpt2",)
SUPPORTED_PRE = ("smollm", "gpt2", "default", "llama-bpe", "llama3", "llama-v3")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the byte-level 'alphabet')."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


BYTE_TO_CHAR: dict[int, str] = _bytes_to_unicode()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}


def _field(reader: GGUFFile, name: str, default: Any = None) -> Any:
    field = reader.fields.get(name)
    return default if field is None else field.contents()


def _required(reader: GGUFFile, name: str) -> Any:
    value = _field(reader, name)
    if value is None:
        raise UnsupportedTokenizerError(f"GGUF tokenizer metadata is missing the field {name!r}")
    return value


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":
        # Same shape as SmolLM2's own tokenizer.json; llama.cpp: regex "\p{N}" first, then the GPT-2 regex.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in ("gpt2", "default"):
        # transformers maps both to GPT2Tokenizer's plain byte-level regex (llama.cpp's 'default' differs slightly).
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # llama-bpe and its aliases: split with Llama 3's regex, then byte-map without GPT-2's regex.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _post_processor(bos: str | None, eos: str | None, add_bos: bool, add_eos: bool,
                    ids: dict[str, int]) -> processors.TemplateProcessing:
    """`add_special_tokens=True` adds BOS/EOS exactly when the GGUF says llama.cpp would."""
    single = "$A"
    pair = "$A $B:1"
    specials: list[tuple[str, int]] = []
    if add_bos and bos is not None:
        single, pair = f"{bos} {single}", f"{bos} {pair}"
        specials.append((bos, ids[bos]))
    if add_eos and eos is not None:
        single, pair = f"{single} {eos}", f"{pair} {eos}"
        specials.append((eos, ids[eos]))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def tokenizer_files_from_gguf(reader: GGUFFile) -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config dict) equivalent to the tokenizer this GGUF describes."""
    model = _required(reader, "tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        raise UnsupportedTokenizerError(
            f"Unsupported GGUF tokenizer: tokenizer.ggml.model={model!r}; supported: {list(SUPPORTED_MODELS)}"
        )
    # Files written before llama.cpp had pre-tokenizer types carry no field; llama.cpp then uses 'default'.
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in SUPPORTED_PRE:
        raise UnsupportedTokenizerError(
            f"Unsupported GGUF pre-tokenizer: tokenizer.ggml.pre={pre!r}; supported: {list(SUPPORTED_PRE)}"
        )
    tokens: list[str] = _required(reader, "tokenizer.ggml.tokens")
    merges: list[str] = _required(reader, "tokenizer.ggml.merges")
    token_types: list[int] = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)

    # Every real byte-level token is spelled in the byte alphabet; respell any that is not (as transformers does).
    alphabet = set(CHAR_TO_BYTE)
    spelled = [t if set(t) <= alphabet else "".join(BYTE_TO_CHAR[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}  # a duplicated spelling keeps its last id, as in transformers

    bpe = models.BPE(
        vocab=vocab,
        merges=[tuple(m.split(" ", 1)) for m in merges],
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        # Llama 3 looks whole words up before merging (its tokenizer.json and llama.cpp both do).
        ignore_merges=pre in ("llama-bpe", "llama3", "llama-v3"),
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()

    # CONTROL -> special added tokens; a control token outside the byte alphabet is a llama.cpp mislabel: skip it.
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, token_types)
        if int(kind) == _CONTROL and set(t) <= alphabet
    ]
    user_defined = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, token_types)
        if int(kind) == _USER_DEFINED and t in vocab
    ]
    tok.add_special_tokens(control)
    tok.add_tokens(user_defined)

    def token_at(key: str) -> str | None:
        idx = _field(reader, f"tokenizer.ggml.{key}")
        return None if idx is None or not 0 <= int(idx) < len(tokens) else spelled[int(idx)]

    bos, eos = token_at("bos_token_id"), token_at("eos_token_id")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    tok.post_processor = _post_processor(bos, eos, add_bos, add_eos, vocab)

    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        if (text := token_at(key)) is not None:
            config[name] = text
    config["add_bos_token"] = add_bos
    config["add_eos_token"] = add_eos
    config["clean_up_tokenization_spaces"] = False
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    arch = _field(reader, "general.architecture")
    context = _field(reader, f"{arch}.context_length") if arch else None
    if context is not None:
        config["model_max_length"] = int(context)
    return tok.to_str(), config


def write_tokenizer_dir(reader: GGUFFile, out_dir: str | Path) -> None:
    """Write tokenizer.json and tokenizer_config.json into `out_dir` (which must exist)."""
    tokenizer_json, config = tokenizer_files_from_gguf(reader)
    out = Path(out_dir)
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
