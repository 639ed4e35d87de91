"""The models this server offers: a fixed list of choices (the browser picks a label, never a path), from the server
default ($LLM_INSPECTOR_MODEL), the bundled model, models under $LLM_INSPECTOR_MODEL_ROOTS and the local hub cache,
listed again at most once a minute; which of them are GGUF files, whose weights can be held as stored (QUANT_LABELS).
inspector.session.models loads and holds them."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from engine.errors import EngineError
from engine.sources import find_in_hub_cache, gguf_path_of, hub_cache_dirs

BUNDLED = "SmolLM2-135M-Instruct (bundled)"
CHOICES_TTL_S = 60
# A GGUF file's weights as a browser chooses them -> engine.loader.load_model's quant (the one list of labels)
QUANT_LABELS = {"dequantised (floats)": "dequantized", "as stored (GGUF blocks, CPU float32)": "stored",
                "as stored, llama.cpp's arithmetic (x rounded to 8 bits)": "stored-int8"}
_choices: list = []        # [when, {label: source}]
_choices_lock = threading.Lock()


def model_roots() -> list[Path]:
    """Folders whose models the browser may choose from ($LLM_INSPECTOR_MODEL_ROOTS, os.pathsep separated)."""
    raw = os.environ.get("LLM_INSPECTOR_MODEL_ROOTS", "")
    return [Path(p).expanduser() for p in raw.split(os.pathsep) if p.strip()]


def model_choices() -> dict[str, str | None]:
    """Display label -> source, for the bundled model, models under the roots and the hub cache (the
    folders are listed again at most once a minute)."""
    now = time.monotonic()
    with _choices_lock:
        if _choices and now - _choices[0] < CHOICES_TTL_S:
            return dict(_choices[1])
    choices = _list_choices()
    with _choices_lock:
        _choices[:] = [now, choices]
    return dict(choices)


def _list_choices() -> dict[str, str | None]:
    choices: dict[str, str | None] = {}
    default = os.environ.get("LLM_INSPECTOR_MODEL")
    if default:
        choices[f"{Path(default).name} (server default)"] = default
    choices[BUNDLED] = None
    for root in model_roots():
        for p in _entries(root):
            if _is_file(p / "config.json") or (p.suffix == ".gguf" and _is_file(p)):
                choices[f"{p.name} (server models)"] = str(p)
    for hub in hub_cache_dirs():
        for repo in _entries(hub):
            if not repo.name.startswith("models--") or "--" not in repo.name.removeprefix("models--"):
                continue
            repo_id = repo.name.removeprefix("models--").replace("--", "/", 1)
            snap = find_in_hub_cache(repo_id)
            if snap is not None and _is_file(snap / "config.json"):
                choices[f"{repo_id} (hub cache)"] = repo_id
    return choices


def is_gguf(source: str | None) -> bool:
    """Whether a listed source is a GGUF file (the bundled model's included): the ones that can be kept as stored."""
    try:
        return gguf_path_of(source) is not None
    except (EngineError, OSError):         # the bundled package missing, an unreadable path: not offered
        return False


def quant_of(label, source: str | None) -> str:
    """The weights mode a browser's label asks for: "dequantized" for a source that is no GGUF file or no label;
    a label that is not one of QUANT_LABELS is passed on as it came, for the registry to refuse (models._key)."""
    if label is None or not is_gguf(source):
        return "dequantized"
    return next((mode for text, mode in QUANT_LABELS.items() if text == label), label)


# Every page's sidebar lists the choices: an entry that cannot be read (a dangling symlink, a folder without
# permission) is left out rather than raised.
def _entries(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except OSError:
        return []


def _is_file(p: Path) -> bool:
    try:
        return p.is_file()
    except OSError:
        return False


def _forget_choices() -> None:
    """List the model folders again at the next call (tests change the environment)."""
    with _choices_lock:
        _choices.clear()


model_choices.clear = _forget_choices
