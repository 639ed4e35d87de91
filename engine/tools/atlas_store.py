"""A head atlas (engine.tools.head_atlas) computed once per model and kept on disk beside its imports:
$LLM_INSPECTOR_CACHE (default ~/.cache/llm-inspector)/atlases, next to models/ (where GGUF files are imported).
A model's own folder is never written to: an HF folder may be read-only (the hub cache) or the user's own.

    kept = kept_head_atlas(model)                 # the file when it is there and valid, else computed and written
    kept.atlas, kept.source, kept.note            # source "disk" or "computed"; note: why a file was not used

The file is named and checked by two identities, both recorded in it and compared on every load:
- the model's fingerprint (weights_fingerprint): SHA-256 of its config.json and tokenizer.json and of what its
  weights are: a GGUF import's recorded source SHA-256 (engine.gguf_import checks it when the model loads), else
  each weight file's name, size and modification time in its resolved folder (engine.gguf_import.is_imported
  trusts unchanged path, size and time the same way); a rewritten weight file is a new model;
- the recipe: this format's version, the model's name (a variant or plan is another model), dtype, device, the
  texts' SHA-256, repeats, length, seed, tokens per text and windows per head.

A file is trusted only whole: its magic, header, version, both identities, every array's name, dtype and shape,
the body's SHA-256, finite values within each score's bounds, and positions inside their sequences. Anything else
is refused with a note naming what was wrong and the atlas is computed again and rewritten. Writes go to a temp
file in the same folder, then os.replace: a reader sees the old file or the new one, never half of one, and two
sessions writing at once leave one of their (identical) files.

Layout: MAGIC, the header's length (8 bytes, little-endian), the header (JSON, sorted keys), then the arrays'
little-endian bytes in the header's order. Encoding is deterministic: a file read and written again is the same
bytes.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import InputError
from engine.sources import cache_dir
from engine.tools.atlas_windows import TOP_K
from engine.tools.head_atlas import MAX_TEXT_TOKENS, SCORE_NAMES, HeadAtlas, default_corpus, head_atlas

FORMAT, VERSION = "llm-inspector-head-atlas", 1
MAGIC = b"LLMI-HEAD-ATLAS\n"
TOP_TEXT = ("previous-token", "duplicate-token")
SLACK = 1e-6                     # a weight is a softmax output: within [0, 1] up to rounding


class AtlasFileError(InputError):
    """An atlas file that cannot be trusted; the message says what is wrong with it."""


@dataclass
class KeptAtlas:
    atlas: HeadAtlas | None
    source: str                  # "disk", "computed" or "none" (looked for on disk only, not there)
    path: Path | None            # None: the model has no folder to identify it by; nothing is kept
    note: str | None = None      # why a file there was not used, or why the atlas could not be written
    seconds: float = 0.0         # to read it, or to compute and write it


def _sha_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def weights_fingerprint(model) -> str | None:
    """The model's identity for its atlas (see the module docstring); None when it has no folder to name it by."""
    if getattr(model, "path", None) is None or not (Path(model.path) / "config.json").is_file():
        return None
    root = Path(model.path).resolve()
    parts: dict = {"config": _sha_file(root / "config.json")}
    if (root / "tokenizer.json").is_file():
        parts["tokenizer"] = _sha_file(root / "tokenizer.json")
    try:
        meta = json.loads((root / "import.json").read_text()) if (root / "import.json").is_file() else None
    except (OSError, json.JSONDecodeError, RecursionError):
        meta = None
    if isinstance(meta, dict) and isinstance(meta.get("source_sha256"), str):
        parts["weights"] = {"gguf_sha256": meta["source_sha256"], "import_version": meta.get("import_version")}
    else:
        files = sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
        if not files:
            return None
        parts["weights"] = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
        parts["folder"] = str(root)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def atlas_recipe(model, texts: list[str], repeats: int, length: int, seed: int, max_text_tokens: int) -> dict:
    """What else decides an atlas besides the weights (see the module docstring)."""
    return {"version": VERSION, "model": str(model.name), "dtype": str(model.dtype).removeprefix("torch."),
            "device": model.device.type, "texts_sha256": hashlib.sha256(json.dumps(texts).encode()).hexdigest(),
            "repeats": int(repeats), "length": int(length), "seed": int(seed),
            "max_text_tokens": int(max_text_tokens), "top_k": TOP_K}


def atlas_path(model, fingerprint: str, recipe: dict) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model.path).resolve().name)[:48] or "model"
    key = hashlib.sha256(json.dumps([fingerprint, recipe], sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "atlases" / f"{slug}-{key}.atlas"


def _arrays_of(atlas: HeadAtlas) -> list[tuple[str, np.ndarray]]:
    """Every array of an atlas in the file's order, as the little-endian types the file holds."""
    out = [(f"scores.{n}", atlas.scores[n].astype("<f8")) for n in SCORE_NAMES]
    out += [(f"top_text.{n}", atlas.top_text[n].astype("<i8")) for n in TOP_TEXT]
    out += [(f"window_value.{n}", atlas.window_value[n].astype("<f8")) for n in SCORE_NAMES]
    out += [(f"window_at.{n}", atlas.window_at[n].astype("<i8")) for n in SCORE_NAMES]
    return out


def _expected_arrays(layers: int, heads: int) -> list[list]:
    """[name, dtype, shape] of every array a file for this many layers and heads must hold, in order."""
    L, H = layers, heads
    return ([[f"scores.{n}", "<f8", [L, H]] for n in SCORE_NAMES] + [[f"top_text.{n}", "<i8", [L, H]] for n in TOP_TEXT]
            + [[f"window_value.{n}", "<f8", [L, H, TOP_K]] for n in SCORE_NAMES]
            + [[f"window_at.{n}", "<i8", [L, H, TOP_K, 3]] for n in SCORE_NAMES])


def encode_atlas(atlas: HeadAtlas, fingerprint: str, recipe: dict) -> bytes:
    arrays = _arrays_of(atlas)
    body = b"".join(np.ascontiguousarray(a).tobytes() for _, a in arrays)
    header = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint, "recipe": recipe,
              "layers": atlas.layers, "heads": atlas.heads, "tokens": atlas.tokens, "repeats": atlas.repeats,
              "length": atlas.length, "seed": atlas.seed, "texts": atlas.texts,
              "text_ids": [[int(t) for t in ids] for ids in atlas.text_ids],
              "random_ids": [[int(t) for t in ids] for ids in atlas.random_ids],
              "arrays": [[name, a.dtype.str, list(a.shape)] for name, a in arrays],
              "body_sha256": hashlib.sha256(body).hexdigest()}
    head = json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return MAGIC + len(head).to_bytes(8, "little") + head + body


def _ids(value, what: str, vocab: int) -> list[list[int]]:
    if not isinstance(value, list) or not all(isinstance(s, list) and all(type(t) is int and 0 <= t < vocab
                                                                          for t in s) for s in value):
        raise AtlasFileError(f"{what} is not a list of token-id lists within the vocabulary ({vocab})")
    return value


def _check_values(atlas: HeadAtlas) -> None:
    """Scores and windows finite and within their bounds, window positions inside their sequences."""
    longest = max([len(s) for s in atlas.sequences()] + [2])
    for name in SCORE_NAMES:
        hi = math.log(longest) + SLACK if name == "entropy" else 1 + SLACK
        s = atlas.scores[name]
        if not (name == "duplicate-token" and np.isnan(s).all()) and not (
                np.isfinite(s).all() and (s >= -SLACK).all() and (s <= hi).all()):
            raise AtlasFileError(f"its {name} scores are not finite numbers in [0, {hi:.3f}]")
        v, at = atlas.window_value[name], atlas.window_at[name]
        full = at[..., 0] >= 0
        if not ((at[~full] == -1).all() and np.isnan(v[~full]).all()):
            raise AtlasFileError(f"its empty {name} windows are not marked empty throughout")
        if not (np.isfinite(v[full]).all() and (v[full] >= -SLACK).all() and (v[full] <= hi).all()):
            raise AtlasFileError(f"its {name} window scores are not finite numbers in [0, {hi:.3f}]")
        seqs = atlas.sequences()
        for seq, q, k in at[full].tolist():
            if not (seq < len(seqs) and 0 <= k <= q < len(seqs[seq])):
                raise AtlasFileError(f"a {name} window points outside its sequence ({seq}, {q}, {k})")
    for name in TOP_TEXT:
        t = atlas.top_text[name]
        if not ((t >= 0).all() and (t < max(len(atlas.texts), 1)).all()):
            raise AtlasFileError(f"its top text indices ({name}) fall outside its {len(atlas.texts)} texts")


def decode_atlas(data: bytes, fingerprint: str, recipe: dict, layers: int, heads: int, vocab: int) -> HeadAtlas:
    """The atlas a file holds, checked whole against this model (see the module docstring); AtlasFileError names
    the first thing wrong."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        raise AtlasFileError("it is not a head atlas file (no magic)")
    n = int.from_bytes(data[len(MAGIC):len(MAGIC) + 8], "little")
    start = len(MAGIC) + 8
    if n > len(data) - start:
        raise AtlasFileError("it is cut short inside its header")
    try:
        h = json.loads(data[start:start + n])
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise AtlasFileError("its header is not JSON") from None
    if not isinstance(h, dict) or (h.get("format"), h.get("version")) != (FORMAT, VERSION):
        raise AtlasFileError(f"it is not version {VERSION} of {FORMAT}")
    if h.get("fingerprint") != fingerprint:
        raise AtlasFileError("it was computed for other weights (its model fingerprint differs)")
    if h.get("recipe") != recipe:
        raise AtlasFileError("it was computed with another recipe (texts, sizes, dtype, device or version)")
    if (h.get("layers"), h.get("heads")) != (layers, heads) or h.get("arrays") != _expected_arrays(layers, heads):
        raise AtlasFileError(f"its arrays are not those of {layers} layers x {heads} heads")
    body = data[start + n:]
    sizes = [int(np.prod(shape)) * 8 for _, _, shape in h["arrays"]]
    if len(body) != sum(sizes) or hashlib.sha256(body).hexdigest() != h.get("body_sha256"):
        raise AtlasFileError("its arrays are cut short or damaged (their SHA-256 differs)")
    arrays, at = {}, 0
    for (name, dtype, shape), size in zip(h["arrays"], sizes):
        arrays[name] = np.frombuffer(body, dtype=dtype, count=size // 8, offset=at).reshape(shape).copy()
        at += size
    texts = h.get("texts")
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise AtlasFileError("its texts are not a list of strings")
    text_ids, random_ids = _ids(h.get("text_ids"), "its text tokens", vocab), _ids(h.get("random_ids"),
                                                                                 "its random tokens", vocab)
    ints = [h.get(k) for k in ("tokens", "repeats", "length", "seed")]
    if not all(type(v) is int and v >= 0 for v in ints) or len(text_ids) != len(texts) or len(random_ids) != ints[1] \
            or any(len(r) != 2 * ints[2] for r in random_ids):
        raise AtlasFileError("its sizes (tokens, repeats, length, seed) do not match its sequences")
    atlas = HeadAtlas(layers, heads, {n: arrays[f"scores.{n}"] for n in SCORE_NAMES}, texts,
                      {n: arrays[f"top_text.{n}"] for n in TOP_TEXT}, *ints, random_ids, text_ids,
                      {n: arrays[f"window_value.{n}"] for n in SCORE_NAMES},
                      {n: arrays[f"window_at.{n}"] for n in SCORE_NAMES})
    _check_values(atlas)
    return atlas


def write_atomic(path: Path, data: bytes) -> None:
    """data at path, whole or not at all: a temp file beside it, flushed, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _identity(model, texts, repeats, length, seed, max_text_tokens):
    texts = list(texts) if texts is not None else default_corpus(tokenizer=model.tokenizer)
    fingerprint = weights_fingerprint(model)
    recipe = atlas_recipe(model, texts, repeats, length, seed, max_text_tokens)
    return texts, fingerprint, recipe, (atlas_path(model, fingerprint, recipe) if fingerprint else None)


def _read(model, path: Path, fingerprint: str, recipe: dict) -> tuple[HeadAtlas | None, str | None]:
    if not path.is_file():
        return None, None
    cfg = model.config
    try:
        return decode_atlas(path.read_bytes(), fingerprint, recipe, cfg.num_layers, cfg.num_heads,
                            cfg.vocab_size), None
    except AtlasFileError as e:
        return None, f"the head atlas kept at {path} was not used: {e}; it is computed again"
    except OSError as e:
        return None, f"the head atlas kept at {path} could not be read ({e.strerror or e}); it is computed again"


def stored_head_atlas(model, texts: list[str] | None = None, *, repeats: int = 4, length: int = 64, seed: int = 0,
                      max_text_tokens: int = MAX_TEXT_TOKENS) -> KeptAtlas:
    """The atlas kept on disk for this model and recipe, read and checked; nothing is computed (source "none"
    and atlas None when there is no valid file; note says what was wrong with one that is there)."""
    t0 = time.perf_counter()
    texts, fingerprint, recipe, path = _identity(model, texts, repeats, length, seed, max_text_tokens)
    if path is None:
        return KeptAtlas(None, "none", None)
    atlas, note = _read(model, path, fingerprint, recipe)
    return KeptAtlas(atlas, "disk" if atlas is not None else "none", path, note, time.perf_counter() - t0)


def kept_head_atlas(model, texts: list[str] | None = None, *, repeats: int = 4, length: int = 64, seed: int = 0,
                    max_text_tokens: int = MAX_TEXT_TOKENS, recompute: bool = False, on_progress=None) -> KeptAtlas:
    """head_atlas(model, texts, ...) read from its file when one is there and valid (recompute=False), else
    computed and written (atomically); a model with no folder is computed and not kept. A file that cannot be
    written leaves the computed atlas, with a note."""
    t0 = time.perf_counter()
    texts, fingerprint, recipe, path = _identity(model, texts, repeats, length, seed, max_text_tokens)
    note = None
    if path is not None and not recompute:
        atlas, note = _read(model, path, fingerprint, recipe)
        if atlas is not None:
            return KeptAtlas(atlas, "disk", path, None, time.perf_counter() - t0)
    atlas = head_atlas(model, texts, repeats=repeats, length=length, seed=seed, max_text_tokens=max_text_tokens,
                       on_progress=on_progress)
    if path is not None:
        try:
            write_atomic(path, encode_atlas(atlas, fingerprint, recipe))
        except OSError as e:
            note = ((note + "; ") if note else "") + (f"the head atlas could not be kept at {path} "
                                                      f"({e.strerror or e}): set LLM_INSPECTOR_CACHE to a writable "
                                                      "folder")
    return KeptAtlas(atlas, "computed", path, note, time.perf_counter() - t0)
