"""The models this server holds: a process-wide registry that loads each (source, device, dtype, and for a GGUF file
its weights mode: dequantised or kept as stored) once and shares it with every session. Models come only from model_choices() (inspector.session.model_choices: the server default,
the bundled model, models under $LLM_INSPECTOR_MODEL_ROOTS and the local hub cache; re-exported here). A page asks
with model_load(), which never waits: the load runs in a thread of the registry (one per model for every session)
and its progress is read by all.

The registry holds at most $LLM_INSPECTOR_MAX_MODELS models. A load past that unloads the least recently used model
that no session needs (its sidebar's choice, its debugger's or live run's model) and that nothing else holds any more
(a computation running on it keeps it); the sessions that had used it are told when they next ask for it
(LoadState.unloaded). Only when every model held is in use is a load refused (NoRoomError), naming how many sessions
hold each. Sessions are known weakly, by the record each passes to model_load (inspector.session.state.SessionState):
a closed session stops counting once Streamlit drops it.
"""
from __future__ import annotations

import functools
import gc
import logging
import threading
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

from engine import EngineError, Model, ModelLoadError, UnsupportedModelError, load_model
from engine.heap import trim
from engine.loader import QUANT_MODES, pick_device, pick_dtype
from engine.sources import cache_dir as engine_cache_dir
from engine.sources import hub_cache_dirs
from engine.variants import cast_model

from .admission import Admission, ServerBusyError
from .limits import Limits, LimitsConfigError
from .model_choices import BUNDLED, model_choices, model_roots  # noqa: F401 (the registry's users ask it here)
from .model_room import Held, ModelUser, NoRoomError, Unloaded, refusal

LOAD_RETRY_S = 30          # a model that failed to load is not tried again for this long (all sessions)
LOAD_QUEUE_TIMEOUT_S = 600
# Loads and GGUF imports take the CPU (or GPU) for seconds to minutes: one at a time, in a queue of their own,
# so a load never waits behind (or holds) a generation's slot: a page that holds a run slot may load a model.
_loads = Admission(max_concurrent=1, max_queue=8)
log = logging.getLogger("llm_inspector")


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
        self.used = time.monotonic()                           # last asked for, by any session (least recently used)

    def idle(self) -> bool:
        """Neither loaded nor loading (new, or its last load failed): loading it needs room."""
        return self.model is None and not self.lock.locked()

    def failed_recently(self) -> bool:
        return self.error is not None and time.monotonic() - self.error[0] < LOAD_RETRY_S


_models: dict[tuple, _Slot] = {}
_models_lock = threading.Lock()
_users: "weakref.WeakSet[ModelUser]" = weakref.WeakSet()     # sessions that asked for a model, never kept alive
_unloaded: dict[tuple, Unloaded] = {}                        # key -> its last unloading
# A refused session asks again at every script run: a full collection (what finds the sessions Streamlit dropped)
# at most once a second, so that refusals cost little.
COLLECT_EVERY_S = 1.0
_collected = [float("-inf")]


def shared_model(source: str | None, device: str, dtype: str, _progress=None, quant: str = "dequantized") -> Model:
    """The model for (source, device, dtype, quant: engine.loader.load_model's), loaded at most once per process and
    shared by all sessions; past max_models the least recently used model nobody needs is unloaded first. Raises
    ModelLoadError (with the reason) for a model that cannot be loaded, NoRoomError when every model held is in use,
    EngineError for a quant that is not a mode."""
    key = _key(source, device, dtype, quant)
    dev = pick_device(device)
    limit = _max_models()
    if _progress is not None:        # a load's progress is drawn in a student's browser: no server folders
        _progress = functools.partial(_redacted_progress, _progress, source)
    while True:
        with _models_lock:
            slot, fresh = _models.get(key), False
            if slot is None or slot.idle():
                if slot is None or not slot.failed_recently():     # a recent failure is said again below
                    _make_room(limit, key)
                slot, fresh = slot or _Slot(), True
                slot.lock.acquire()          # counted as loading from here on: no other load takes its room
                _models[key] = slot
        if not fresh and not slot.lock.acquire(blocking=False):
            if _progress:
                _progress(0.0, "another session is loading this model…")
            slot.lock.acquire()
        if _models.get(key) is slot:
            break
        slot.lock.release()          # unloaded to make room while this call waited for it: ask again
    try:
        slot.used = time.monotonic()
        if slot.model is None:
            if slot.failed_recently():
                raise slot.error[2](slot.error[1])
            try:
                with _loads.slot(on_wait=lambda n: _progress and _progress(0.0, f"waiting to load: number {n} in "
                                                                               "the queue for model loads"),
                                 timeout=LOAD_QUEUE_TIMEOUT_S, client=None):
                    slot.model = load_model(source, device=dev, dtype=key[-1].removeprefix("torch."),
                                            progress=_progress, quant=quant)
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


def _key(source: str | None, device: str, dtype: str, quant: str = "dequantized") -> tuple:
    """(source, device, dtype), or (source, "stored", device, dtype) for a GGUF file kept as stored: both modes of
    one file can be held. quant comes from a browser: anything but a mode is refused here, on the server."""
    if quant not in QUANT_MODES:
        raise EngineError(f"unsupported weights mode {str(quant)[:40]!r}; use {' or '.join(QUANT_MODES)}")
    dev = pick_device(device)
    dt = str(pick_dtype(None if dtype == "auto" else dtype, dev))
    return (source, str(dev), dt) if quant == "dequantized" else (source, quant, str(dev), dt)


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
    refused: bool = False          # every model held was in use (NoRoomError): tried again at the next ask
    unloaded: Unloaded | None = None   # this model was unloaded to make room since the asking session last had it

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
        self.refused = False
        self.done = False

    def progress(self, fraction: float, message: str) -> None:
        self.latest = (max(self.latest[0], min(max(fraction, 0.0), 1.0)), message)      # never moves back

    def run(self, source: str | None, device: str, dtype: str, quant: str) -> None:
        try:
            self.model = shared_model(source, device, dtype, _progress=self.progress, quant=quant)
        except EngineError as e:     # shared_model says why (redacted); pick_device may refuse a device
            self.error, self.unsupported = str(e), isinstance(e, UnsupportedModelError)
            self.refused = isinstance(e, NoRoomError)
        except Exception as e:       # a bug: the reason on screen, the server keeps running
            log.exception("loading model %r failed", source)
            self.error = redact(f"{type(e).__name__}: {e}", source)
        finally:
            self.ended, self.done = time.monotonic(), True

    def state(self) -> LoadState:
        if self.done:
            return LoadState(model=self.model, error=self.error, fraction=1.0, message="done",
                             seconds=self.ended - self.started, unsupported=self.unsupported, refused=self.refused)
        fraction, message = self.latest
        return LoadState(fraction=fraction, message=message, seconds=time.monotonic() - self.started)


_background: dict[tuple, _Load] = {}


def model_load(source: str | None, device: str, dtype: str, user: ModelUser | None = None,
               quant: str = "dequantized") -> LoadState:
    """The model for (source, device, dtype, quant) if it is loaded; otherwise its load's state, starting the load in a
    thread of this registry if none runs (one load per model for every session; a failed one is tried again
    after LOAD_RETRY_S, a refused one at once). Never waits for the load. user: the asking session's record, kept
    weakly; this model becomes its choice (what it needs while it stays), and it is told (LoadState.unloaded) if
    the model was unloaded to make room since it last had it."""
    try:
        key = _key(source, device, dtype, quant)
    except EngineError as e:
        return LoadState(error=str(e))
    with _models_lock:
        unloaded = _unloaded_since(user, key)
        if user is not None:
            _users.add(user)
            user.model_key = key
        slot = _models.get(key)
        if slot is not None and slot.model is not None:
            slot.used = time.monotonic()
            if user is not None:
                user.models_used[key] = slot.used
            return LoadState(model=slot.model, fraction=1.0, message="ready", unloaded=unloaded)
        load = _background.get(key)
        if load is None or (load.done and (load.model is not None or load.refused
                                           or time.monotonic() - load.ended >= LOAD_RETRY_S)):
            # room first, here: a refusal is an answer now, never a load that spins
            if slot is None or (slot.idle() and not slot.failed_recently()):
                try:
                    _make_room(_max_models(), key)
                except NoRoomError as e:
                    _background.pop(key, None)
                    return LoadState(error=str(e), refused=True, unloaded=unloaded)
            load = _background[key] = _Load()
            threading.Thread(target=load.run, args=(source, device, dtype, quant), daemon=True,
                             name=f"model-load-{label(source)}").start()
    return replace(load.state(), unloaded=unloaded)


def _unloaded_since(user: ModelUser | None, key: tuple) -> Unloaded | None:
    """Under _models_lock: this model's unloading, if it came after the user last had the model."""
    record = _unloaded.get(key)
    used = None if user is None else user.models_used.get(key)
    return record if record is not None and used is not None and used < record.at else None


def _redacted_progress(progress, source: str | None, fraction: float, message: str) -> None:
    progress(fraction, redact(message, source))


# ---- room for one more model ------------------------------------------------------------------------------------
def _held() -> list[tuple[tuple, _Slot]]:
    """Under _models_lock: every model counts, loading or loaded, and every low-precision copy."""
    return [(k, s) for k, s in _models.items() if s.model is not None or s.lock.locked()]


def _make_room(limit: int, for_key: tuple) -> None:
    """Under _models_lock: below limit, or unload the least recently used models that no session needs until it
    is; NoRoomError when every model held is in use."""
    for collected in (False, True):
        if len(_held()) < limit:
            return
        needs = _needs()
        idle = sorted(((s.used, k) for k, s in _held() if s.model is not None and not needs.get(k)),
                      key=lambda uk: uk[0])
        for _, k in idle:
            if _unload(k, for_key, limit) and len(_held()) < limit:
                return
        if collected or time.monotonic() - _collected[0] < COLLECT_EVERY_S:
            break
        gc.collect()       # sessions Streamlit has dropped leave _users (a closed tab's, once it expires)
        _collected[0] = time.monotonic()
    raise NoRoomError(_refusal(limit, _needs()))


def _needs() -> dict[tuple, list]:
    """Under _models_lock: key -> the sessions that need that model (their choice, or held by their debugger or
    generating run)."""
    out: dict[tuple, list] = {}
    for user in list(_users):
        held = user.held_models()
        for k, s in _models.items():
            if user.model_key == k or (s.model is not None and any(m is s.model for m in held)):
                out.setdefault(k, []).append(user)
    return out


def _unload(key: tuple, for_key: tuple, limit: int) -> bool:
    """Under _models_lock: drop the registry's reference to this model and check that it is freed; a model that
    something still holds (a computation running on it now) is kept, and False returned."""
    slot = _models[key]
    if not slot.lock.acquire(blocking=False):        # being handed to a caller right now
        return False
    try:
        ref, slot.model = weakref.ref(slot.model), None
        _background.pop(key, None)                    # its finished load holds the model too
        if ref() is not None:
            gc.collect()
        if ref() is not None:
            slot.model = ref()
            return False
        del _models[key]
        _unloaded[key] = Unloaded(time.monotonic(), time.strftime("%H:%M:%S"), _name(for_key), limit)
    finally:
        slot.lock.release()
    trim()            # the weights' memory goes back to the system, not to the allocator's free lists
    log.info("unloaded model %s (%s, %s) to make room for %s", _name(key), key[-2], key[-1], _name(for_key))
    return True


def _refusal(limit: int, needs: dict[tuple, list]) -> str:
    """Under _models_lock: why a load is refused (model_room.refusal)."""
    held = _held()
    rows = [(f"{_name(k)} ({k[-2]}, {k[-1].removeprefix('torch.')})", s.model is None, len(needs.get(k, [])))
            for k, s in held]
    return refusal(limit, rows, len({id(u) for k, _ in held for u in needs.get(k, [])}))


def held() -> list[Held]:
    """The models this process holds now (every session's, every low-precision copy), loaded ones and loading."""
    with _models_lock:
        slots = [(k, s.model) for k, s in _held()]
    return [Held(_name(k), k[-2], k[-1].removeprefix("torch."),
                 None if m is None else {str(d).removeprefix("torch."): n
                                         for d, n in m.weights.nbytes_by_dtype().items()})
            for k, m in slots]


def _name(key: tuple) -> str:
    """A registry key's model as a browser is told it: (source, device, dtype), (source, "stored", device, dtype) or
    ("copy", name, device, dtype) (a stored source is a .gguf file or the bundled None, never "copy")."""
    if key[0] == "copy" and len(key) == 4:
        return f"{key[1]} (a low-precision copy)"
    return label(key[0]) + ("" if len(key) != 4 else " (as stored, int8 products)" if key[1] == "stored-int8"
                            else " (as stored)")


def shared_copy(model: Model, dtype: str) -> Model:
    """The shared model's weights in another dtype (fp16/bf16 for precision checks): made once per process,
    counted against max_models like any loaded model, never the shared model itself."""
    key = ("copy", model.name, str(model.device), str(pick_dtype(dtype, model.device)))
    with _models_lock:
        slot = _models.get(key)
        if slot is None:
            _make_room(_max_models(), key)
            slot = _models[key] = _Slot()
        slot.lock.acquire()
    try:
        slot.used = time.monotonic()
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


def _forget_models() -> None:
    """Forget every loaded model and the listed choices (tests and admins start afresh)."""
    with _models_lock:
        _models.clear()
        _background.clear()
        _unloaded.clear()
        _users.clear()
    model_choices.clear()


shared_model.clear = _forget_models
