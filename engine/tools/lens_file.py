"""A tuned lens on disk: a safetensors file of U, V (float16) and b (float32), with metadata naming the model weights
it was fitted for (their checksum) and the recipe that made it. Shipped lenses live in engine/lenses/ (the bundled
model's, made by scripts/fit_tuned_lens.py); a lens fitted on demand for any other model is kept in the cache
(engine.sources.cache_dir()/lenses/), one file per weights checksum.

    save_lens(lens, path)                 # writes the file (atomic: a temporary beside it, then renamed)
    read_lens(path, model)                # TunedLens, or LensFileError naming what does not match
    find_lens(model)                      # the shipped or cached lens of model's weights, or None: not fitted yet
    weights_checksum(model)               # "gguf-sha256:<hex>" or "safetensors-sha256:<hex>"

Checked at load, each a refusal naming the field: the format; every recipe field (RECIPE_FIELDS) present; the
SHA-256 of the recipe and tensors equal to the one recorded (the file was not altered after its fit); the weights
checksum equal to the model's (a lens fitted for other weights reads them wrongly); the shapes the model's; and for
a shipped file, its recipe the one SHIPPED records for it.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.errors import EngineError
from engine.sources import cache_dir
from engine.tools.tuned_lens import TunedLens

FORMAT = "llm-inspector tuned lens 1"
RECIPE_FIELDS = ("method", "rank", "tokens", "texts", "ridge", "steps", "lr", "batch", "seed", "validation_every",
                 "kl_layers", "corpus", "modules", "python", "sha256", "script")
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "lenses"
# weights checksum -> (file in SHIPPED_DIR, SHA-256 of its recipe as scripts/fit_tuned_lens.py wrote it)
SHIPPED = {
    "gguf-sha256:b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53":      # the bundled SmolLM2-135M
        ("smollm2-135m-instruct-q4_1.safetensors", "7fa39f7fa167f292d6a088881f37dc6cd27da92d1c98bed4fc256e6c592f4c0d"),
}
_checksums: dict[tuple, str] = {}        # (path, sizes, mtimes) -> checksum: hashing 500 MB once per process


class LensFileError(EngineError):
    """A tuned-lens file that cannot be used for this model: altered, incomplete, or fitted for other weights."""


def weights_checksum(model) -> str:
    """What identifies model's weights: the SHA-256 of the GGUF file it was imported from (recorded and verified by
    engine.gguf_import at load), else the SHA-256 of its safetensors files' bytes in name order."""
    path = Path(model.path)
    marker = path / "import.json"
    if marker.is_file():
        try:
            sha = json.loads(marker.read_text()).get("source_sha256")
        except (ValueError, OSError, AttributeError):
            sha = None
        if isinstance(sha, str) and len(sha) == 64:
            return f"gguf-sha256:{sha}"
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise LensFileError(f"{path}: no GGUF import record and no safetensors file to identify the weights by")
    key = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key not in _checksums:
        digest = hashlib.sha256()
        for f in files:
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    digest.update(chunk)
        _checksums[key] = f"safetensors-sha256:{digest.hexdigest()}"
    return _checksums[key]


def _recipe_sha(recipe: dict) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def _content_sha(recipe: dict, checksum: str, tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode() + checksum.encode())
    for name in ("U", "V", "b"):
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _stored(lens: TunedLens) -> dict[str, torch.Tensor]:
    return {"U": lens.U.detach().half().contiguous(), "V": lens.V.detach().half().contiguous(),
            "b": lens.b.detach().float().contiguous()}


def save_lens(lens: TunedLens, path: str | os.PathLike) -> Path:
    """Write lens (its recipe and weights checksum must be set) to path."""
    missing = [k for k in RECIPE_FIELDS if k not in lens.recipe]
    if missing or not lens.weights_checksum:
        raise LensFileError(f"a lens is saved with its full recipe and weights checksum; missing: "
                            f"{', '.join(missing + ([] if lens.weights_checksum else ['weights_checksum']))}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = _stored(lens)
    meta = {"format": FORMAT, "recipe": json.dumps(lens.recipe, sort_keys=True),
            "weights_checksum": lens.weights_checksum,
            "content_sha256": _content_sha(lens.recipe, lens.weights_checksum, tensors)}
    fd, tmp = tempfile.mkstemp(suffix=".safetensors", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_lens(path: str | os.PathLike, model, *, expect_recipe_sha: str | None = None) -> TunedLens:
    """The lens in path, checked against model (see the module's list); LensFileError naming the first mismatch."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, ValueError, RuntimeError) as e:
        raise LensFileError(f"{path.name}: not a readable safetensors file ({str(e)[:80]})") from None
    if meta.get("format") != FORMAT:
        raise LensFileError(f"{path.name}: format {meta.get('format')!r}, expected {FORMAT!r}")
    try:
        recipe = json.loads(meta.get("recipe", ""))
    except ValueError:
        recipe = None
    if not isinstance(recipe, dict):
        raise LensFileError(f"{path.name}: no recipe recorded (the metadata's 'recipe' is missing or not JSON)")
    missing = [k for k in RECIPE_FIELDS if k not in recipe]
    if missing:
        raise LensFileError(f"{path.name}: the recipe lacks {', '.join(missing)}")
    if expect_recipe_sha is not None and _recipe_sha(recipe) != expect_recipe_sha:
        raise LensFileError(f"{path.name}: its recipe is not the one shipped (recipe SHA-256 "
                            f"{_recipe_sha(recipe)[:12]}…, expected {expect_recipe_sha[:12]}…)")
    if set(tensors) != {"U", "V", "b"}:
        raise LensFileError(f"{path.name}: tensors {sorted(tensors)}, expected U, V, b")
    checksum = meta.get("weights_checksum", "")
    if meta.get("content_sha256") != _content_sha(recipe, checksum, tensors):
        raise LensFileError(f"{path.name}: its content SHA-256 does not match the one recorded: the file was altered "
                            "after its fit")
    ours = weights_checksum(model)
    if not checksum:
        raise LensFileError(f"{path.name}: no weights checksum recorded")
    if checksum != ours:
        raise LensFileError(f"{path.name} was fitted for weights {checksum[:28]}…, not this model's {ours[:28]}…")
    L, d = model.config.num_layers, model.config.hidden_size
    u, v, b = tensors["U"], tensors["V"], tensors["b"]
    if u.shape != v.shape or u.dim() != 3 or tuple(u.shape[:2]) != (L, d) or tuple(b.shape) != (L, d):
        raise LensFileError(f"{path.name}: U {tuple(u.shape)}, V {tuple(v.shape)}, b {tuple(b.shape)} do not fit a "
                            f"model of {L} layers of width {d}")
    return TunedLens(u.float(), v.float(), b.float(), recipe, checksum)


def cached_path(checksum: str) -> Path:
    """Where a lens fitted on demand for these weights is kept."""
    return cache_dir() / "lenses" / f"{checksum.replace(':', '-')}.safetensors"


def find_lens(model) -> TunedLens | None:
    """The shipped lens of model's weights (checked against SHIPPED's recipe), else one fitted earlier and kept in
    the cache; None when neither exists (not fitted yet: fit_tuned_lens, then keep_lens)."""
    checksum = weights_checksum(model)
    if checksum in SHIPPED:
        name, recipe_sha = SHIPPED[checksum]
        return read_lens(SHIPPED_DIR / name, model, expect_recipe_sha=recipe_sha)
    path = cached_path(checksum)
    return read_lens(path, model) if path.is_file() else None


def keep_lens(model, lens: TunedLens, script: str = "on demand (engine.tools.tuned_lens.fit_tuned_lens)") -> Path:
    """Record lens as model's (its weights checksum and the script that ran the fit) and keep it in the cache, where
    find_lens finds it next time."""
    lens.weights_checksum = weights_checksum(model)
    lens.recipe.setdefault("script", script)
    return save_lens(lens, cached_path(lens.weights_checksum))


def recipe_sha(lens: TunedLens) -> str:
    """The SHA-256 SHIPPED records for a shipped lens' recipe."""
    return _recipe_sha(lens.recipe)
