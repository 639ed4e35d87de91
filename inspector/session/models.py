"""The models this server offers and holds: a fixed list of choices (the browser picks a label, never a
path) and a process-wide registry that loads each (source, device, dtype) once and shares it with every
session.

Models come only from model_choices(): the server default ($LLM_INSPECTOR_MODEL), the bundled model, models
under $LLM_INSPECTOR_MODEL_ROOTS and the local hub cache. A page asks with model_load(), which never waits: the
load runs in a thread of the registry (one per model for every session) and its progress is read by all.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from engine import EngineError, Model, ModelLoadError, UnsupportedModelError, load_model
from engine.loader import pick_device, pick_dtype
from engine.sources import cache_dir as engine_cache_dir
from engine.sources import find_in_hub_cache, hub_cache_dirs
from engine.variants import cast_model

from .admission import Admission, ServerBusyError
from .limits import Limits, LimitsConfigError, env_name

BUNDLED = "SmolLM2-135M-Instruct (bundled)"
LOAD_RETRY_S = 30          # a model that failed to load is not tried again for this long (all sessions)
CHOICES_TTL_S = 60
LOAD_QUEUE_TIMEOUT_S = 600
# Loads and GGUF imports take the CPU (or GPU) for seconds to minutes: one at a time, in a queue of their own,
# so a load never waits behind (or holds) a generation's slot: a page that holds a run slot may load a model.
_loads = Admission(max_concurrent=1, max_queue=8)
log = logging.getLogger("llm_inspector")
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


def _max_models() -> int:
    try:
        return Limits.from_env().max_models
    except LimitsConfigError:
        return Limits().max_models


# ---- the shared model -----------------------------------------------------------------------------------------
# A process-wide registry rather than st.cache_resource: a cached function that draws a progress bar made
# outside it cannot be replayed for the next session (CacheReplayClosureError), and any client may ask
# Streamlit to clear its caches, which would drop the model every session shares.
class _Slot:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.model: Model | None = None
        self.error: tuple[float, str, type] | None = None     # (when, message, error class) of the last failed load


_models: dict[tuple, _Slot] = {}
_models_lock = threading.Lock()


def shared_model(source: str | None, device: str, dtype: str, _progress=None) -> Model:
    """The model for (source, device, dtype), loaded at most once per process and shared by all sessions.
    Raises ModelLoadError (with the reason) for a model that cannot be loaded or would exceed max_models."""
    key = _key(source, device, dtype)
    dev = pick_device(device)
    limit = _max_models()
    if _progress is not None:        # a load's progress is drawn in a student's browser: no server folders
        _progress = functools.partial(_redacted_progress, _progress, source)
    with _models_lock:
        slot = _models.get(key)
        if slot is None:
            _check_room(limit)
            slot = _models[key] = _Slot()
    if not slot.lock.acquire(blocking=False):
        if _progress:
            _progress(0.0, "another session is loading this model…")
        slot.lock.acquire()
    try:
        if slot.model is None:
            if slot.error and time.monotonic() - slot.error[0] < LOAD_RETRY_S:
                raise slot.error[2](slot.error[1])
            try:
                with _loads.slot(on_wait=lambda n: _progress and _progress(0.0, f"waiting to load: number {n} in "
                                                                               "the queue for model loads"),
                                 timeout=LOAD_QUEUE_TIMEOUT_S, client=None):
                    slot.model = load_model(source, device=dev, dtype=key[2].removeprefix("torch."),
                                            progress=_progress)
            except ServerBusyError as e:      # the load queue is full: try again later, nothing is remembered
                raise ModelLoadError(str(e)) from None
            except Exception as e:
                log.warning("loading model %r failed", source, exc_info=not isinstance(e, EngineError))
                msg = str(e) if isinstance(e, EngineError) else f"{type(e).__name__}: {e}"
                # an architecture this engine does not implement stays unsupported: said so, not "try again"
                kind = UnsupportedModelError if isinstance(e, UnsupportedModelError) else ModelLoadError
                slot.error = (time.monotonic(), redact(msg, source), kind)
                raise kind(slot.error[1]) from None
            slot.error = None
        return slot.model
    finally:
        slot.lock.release()


def _key(source: str | None, device: str, dtype: str) -> tuple:
    dev = pick_device(device)
    return source, str(dev), str(pick_dtype(None if dtype == "auto" else dtype, dev))


# ---- loading in the background -------------------------------------------------------------------------------
# The first visitor after a start sees the app at once: the page asks model_load(), which starts the load in a
# thread and answers at once; every session asking for the same model reads the one load's progress.
@dataclass(frozen=True)
class LoadState:
    """A model's load as a page sees it: the model once loaded, the reason when it failed, else its progress."""
    model: Model | None = None
    error: str | None = None
    fraction: float = 0.0
    message: str = "starting"
    seconds: float = 0.0           # since the load began
    unsupported: bool = False      # the failure was an architecture this engine does not implement: a retry cannot help

    @property
    def loading(self) -> bool:
        return self.model is None and self.error is None


class _Load:
    def __init__(self) -> None:
        self.started = self.ended = time.monotonic()
        self.latest = (0.0, "starting")       # (fraction, what it is doing): one attribute, read whole
        self.model: Model | None = None
        self.error: str | None = None
        self.unsupported = False
        self.done = False

    def progress(self, fraction: float, message: str) -> None:
        self.latest = (max(self.latest[0], min(max(fraction, 0.0), 1.0)), message)      # never moves back

    def run(self, source: str | None, device: str, dtype: str) -> None:
        try:
            self.model = shared_model(source, device, dtype, _progress=self.progress)
        except EngineError as e:     # shared_model says why (redacted); pick_device may refuse a device
            self.error, self.unsupported = str(e), isinstance(e, UnsupportedModelError)
        except Exception as e:       # a bug: the reason on screen, the server keeps running
            log.exception("loading model %r failed", source)
            self.error = redact(f"{type(e).__name__}: {e}", source)
        finally:
            self.ended, self.done = time.monotonic(), True

    def state(self) -> LoadState:
        if self.done:
            return LoadState(model=self.model, error=self.error, fraction=1.0, message="done",
                             seconds=self.ended - self.started, unsupported=self.unsupported)
        fraction, message = self.latest
        return LoadState(fraction=fraction, message=message, seconds=time.monotonic() - self.started)


_background: dict[tuple, _Load] = {}


def model_load(source: str | None, device: str, dtype: str) -> LoadState:
    """The model for (source, device, dtype) if it is loaded; otherwise its load's state, starting the load in a
    thread of this registry if none runs (one load per model for every session; a failed one is tried again
    after LOAD_RETRY_S). Never waits for the load."""
    try:
        key = _key(source, device, dtype)
    except EngineError as e:
        return LoadState(error=str(e))
    with _models_lock:
        slot = _models.get(key)
        if slot is not None and slot.model is not None:
            return LoadState(model=slot.model, fraction=1.0, message="ready")
        load = _background.get(key)
        if load is None or (load.done and (load.model is not None or time.monotonic() - load.ended >= LOAD_RETRY_S)):
            load = _background[key] = _Load()
            threading.Thread(target=load.run, args=(source, device, dtype), daemon=True,
                             name=f"model-load-{label(source)}").start()
    return load.state()


def _redacted_progress(progress, source: str | None, fraction: float, message: str) -> None:
    progress(fraction, redact(message, source))


def _check_room(limit: int) -> None:
    """Under _models_lock: every model counts, loading or loaded, and every low-precision copy."""
    held = [(k, s) for k, s in _models.items() if s.model is not None or s.lock.locked()]
    if len(held) >= limit:
        names = "; ".join(f"{label(k[0])} ({k[1]}, {k[2].removeprefix('torch.')})" for k, _ in held)
        raise ModelLoadError(f"this server keeps at most {limit} model(s) loaded ({env_name('max_models')}) "
                             f"and that many are: {names}. Choose one of those.")


def shared_copy(model: Model, dtype: str) -> Model:
    """The shared model's weights in another dtype (fp16/bf16 for precision checks): made once per process,
    counted against max_models like any loaded model, never the shared model itself."""
    key = ("copy", model.name, str(model.device), str(pick_dtype(dtype, model.device)))
    with _models_lock:
        slot = _models.get(key)
        if slot is None:
            _check_room(_max_models())
            slot = _models[key] = _Slot()
        slot.lock.acquire()
    try:
        if slot.model is None:
            slot.model = cast_model(model, dtype)
        return slot.model
    finally:
        slot.lock.release()


def label(source: str | None) -> str:
    """What a browser is told a model is called: a folder or file name, or a hub id, never a server path."""
    if source is None:
        return BUNDLED
    if source == "copy":
        return "a low-precision copy"
    p = Path(source)
    return p.name if (p.is_absolute() or source.startswith((".", "~"))) else source


def redact(message: str, source: str | None) -> str:
    """A load error or progress line as a browser may see it: the model's own folders replaced by its name,
    the server's model caches and home folder by "…" and "~"."""
    swaps: dict[str, str] = {}
    if source and label(source) != source:          # a path on the server (a hub id is a name already)
        p = Path(source).expanduser()
        for folder in (p, p.resolve(), p.parent, p.resolve().parent):
            swaps[str(folder)] = label(source) if folder.name == p.name else "…"
    for cache in (engine_cache_dir(), *hub_cache_dirs()):
        swaps[str(cache)] = swaps[str(cache.resolve())] = "…"
    # Only whole absolute folders: a relative one ("org") or "/" would eat ordinary words and every slash.
    for folder in sorted(swaps, key=len, reverse=True):      # the longest first: a folder before its parent
        if Path(folder).is_absolute() and Path(folder) != Path(folder).parent:
            message = message.replace(folder, swaps[folder])
    return message.replace(str(Path.home()), "~")


def _forget_choices() -> None:
    """List the model folders again at the next call (tests change the environment)."""
    with _choices_lock:
        _choices.clear()


def _forget_models() -> None:
    """Forget every loaded model and the listed choices (tests and admins start afresh)."""
    with _models_lock:
        _models.clear()
        _background.clear()
    _forget_choices()


model_choices.clear = _forget_choices
shared_model.clear = _forget_models
