"""A run that generates in a background thread while the page shows its progress, and can be stopped.

Streamlit runs a script top to bottom in one thread, and a button press reaches the server only as a new
script run: a run generating inside the script could never see its Stop button. So the sidebar's Run starts
a LiveRun (inspector.session.run.inspect_run in a thread of its own, holding a device slot like any run) and
the script only watches it: the prefill by chunk and layer, each decoded token, the place in the queue. The
Stop button's callback sets the run's threading.Event before the next script run; the engine sees it at the
next layer or token (engine.progress.STOP) and ends the run, which is kept with stop reason "stopped".
Navigating to another page while it runs is the same: the new script run finds the LiveRun and keeps
watching. Nothing here draws: the worker thread never makes a Streamlit call.

Also here: the measured speed of this server (per model), for an estimate before a long run starts and for
weighing a running prefill's progress (inspector.session.estimate).
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

from engine import Model, RunSettings, Step, Trace
from engine.config import ModelConfig
from engine.heap import trim
from engine.progress import STOP, Progress

from .admission import ServerBusyError
from .estimate import FULL_TERMS, Estimate, estimate, fit_prefill, flop_shape
from .limits import Limits
from .run import Checked, inspect_run

PER_CLIENT_REFUSAL = "You already have "
log = logging.getLogger("llm_inspector")     # how admission's refusal for one browser's runs begins


class Cancelled(Exception):
    """Stop was pressed while the run was still waiting in the queue."""


class StillFinishing(ServerBusyError):
    """The queue refused this run for its browser's runs in flight, and one of them is this same session's
    previous click, still finishing (not another tab, as the queue's own message guesses)."""
    message = "Your previous click is still finishing; try again in a moment."

    def __init__(self) -> None:
        super().__init__(self.message)


def own_refusal(e: BaseException, previous_click: Callable[[], bool] | None) -> BaseException:
    """e, or StillFinishing when e is the queue's per-browser refusal while previous_click() says this
    session's previous click still holds its device slot."""
    if (isinstance(e, ServerBusyError) and str(e).startswith(PER_CLIENT_REFUSAL) and previous_click is not None
            and previous_click()):
        return StillFinishing()
    return e


class _Listener:
    """What the engine calls back (on_token and on_progress): records, and answers STOP once asked."""

    def __init__(self, live: "LiveRun") -> None:
        self.live = live

    def on_token(self, step: Step):
        live = self.live
        live.admitted()
        live.pieces.append(step.text)
        live.tokens += 1
        live.last_token_at = time.monotonic()
        live.tell("token", step)
        return STOP if live.stop_event.is_set() else None

    def on_progress(self, p: Progress):
        self.live.admitted()
        self.live.prefill = p
        self.live.tell("progress", p.fraction)
        return STOP if self.live.stop_event.is_set() else None


@dataclass(eq=False)
class LiveRun:
    settings: RunSettings
    model_name: str
    n_prompt: int                              # prompt tokens as the model sees them
    estimate_s: float | None = None            # the estimate shown before it started
    shape: tuple[float, float] = (1.0, 0.0)    # (c1, c2): a prefill's work in its positions n, c1·n + c2·n²;
                                               # set by start() (Rates.shape), weighs the prefill's progress
    stop_event: threading.Event = field(default_factory=threading.Event)
    pieces: list[str] = field(default_factory=list)
    tokens: int = 0
    prefill: Progress | None = None
    queue_position: int | None = None
    first_position: int | None = None          # the place it was first told
    demo: str | None = None                    # the demo (inspector.ui.demos) this run is for
    client: str | None = None                  # who asks, for the queue's per-browser turns: resolved by the app
                                               # in the script thread (a worker thread may not see the cookie)
    previous_click: Callable[[], bool] | None = None   # whether this session's previous click still computes
    observer: object | None = None             # told progress(fraction), token(step), finished(kept, stopped) in the
                                               # run's thread (a room's LivePublisher: rooms_live); never fails it
    started_at: float = field(default_factory=time.monotonic)
    queued_at: float | None = None             # first time the queue reported a place
    admitted_at: float | None = None           # when generation began (the first progress or token)
    decode_from: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    record: Trace | None = None
    error: BaseException | None = None
    thread: threading.Thread | None = None
    model_ref: Callable[[], Model | None] | None = None   # a weak reference to the model the thread holds (never
                                                          # the model itself: the registry asks what is in use)

    def start(self, model: Model, limits: Limits, prepare: Callable[[threading.Thread], None] | None = None, *,
              checked: Checked | None = None) -> "LiveRun":
        """Generate in a new thread; `prepare` sees the thread before it starts (the app gives it the starting
        script's run context, so that the admission queue knows which browser asks, inspector.ui.common.client_key);
        the thread never draws. checked: these settings as check_settings checked them against these limits (the
        run then neither checks nor tokenises again); without it the run checks them itself. The model reaches the
        thread through a closure, so this object never holds the model (the session's memory budget counts what
        session state holds)."""
        self.shape = rates(model).shape(model.config)
        self.model_ref = weakref.ref(model)
        request = self.settings if checked is None else checked
        self.thread = threading.Thread(target=lambda: self._work(model, limits, request), daemon=True,
                                       name=f"llm-inspector-run-{id(self):x}")
        if prepare is not None:
            prepare(self.thread)
        self.thread.start()
        return self

    def _work(self, model: Model, limits: Limits, request: RunSettings | Checked) -> None:
        listener = _Listener(self)
        try:
            self.record = inspect_run(model, request, on_token=listener.on_token, on_progress=listener.on_progress,
                                      limits=limits, on_queue=self._on_queue, client=self.client)
            rates(model).add(self.record)
        except BaseException as e:             # shown by the script; the thread itself never raises
            self.error = own_refusal(e, self.previous_click)
        finally:
            trim()                             # its KV cache and working tensors go back to the system
            r = self.record
            self.tell("finished", r is not None and bool(r.result.steps), r is not None
                      and r.result.stop_reason == "stopped")
            self.finished_at = time.monotonic()

    def tell(self, what: str, *args) -> None:
        """The observer's `what`(*args), if there is one; what it raises is logged, never the run's end."""
        if self.observer is None:
            return
        try:
            getattr(self.observer, what)(*args)
        except Exception:
            log.warning("the run's observer failed at %s", what, exc_info=True)

    def _on_queue(self, position: int) -> None:
        if self.queued_at is None:
            self.queued_at, self.first_position = time.monotonic(), position
        self.queue_position = position
        if self.stop_event.is_set():
            raise Cancelled("stopped while waiting in the queue")

    def admitted(self) -> None:
        if self.admitted_at is None:
            self.admitted_at = time.monotonic()
        if self.decode_from is None and self.tokens:
            self.decode_from = time.monotonic()

    def stop(self) -> None:
        self.stop_event.set()

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    @property
    def waited_s(self) -> float | None:
        """Seconds spent in the queue only (from the first place it was told to the start of generation)."""
        if self.queued_at is None:
            return None
        return (self.admitted_at or self.finished_at or time.monotonic()) - self.queued_at

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def wait(self, timeout: float | None = None) -> bool:
        if self.thread is not None:
            self.thread.join(timeout)
        return self.done


# ---- the measured speed of this server ---------------------------------------------------------------
class Rates:
    """Prefill and decode times of the runs made here with one model: the estimate for the next run.

    Prefill time is fitted as fixed cost + linear + quadratic in the prompt length (inspector.session.estimate,
    which also says how sure the estimate is); decode as the measured times per token."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prefills: list[tuple[int, float]] = []        # (prompt tokens, seconds), the latest 32
        self.per_token: list[float] = []                   # seconds per decoded token, the latest 32

    def add(self, record: Trace) -> None:
        r = record.result
        with self._lock:
            if r.steps and r.timings.get("prefill"):
                self.prefills = (self.prefills + [(len(r.prompt_ids), float(r.timings["prefill"]))])[-32:]
            if len(r.steps) > 1:
                self.per_token = (self.per_token + [float(r.timings["per_token_decode"])])[-32:]

    def forecast(self, n_prompt: int, max_new: int) -> Estimate | None:
        """The estimate for a run (seconds, their range, why rough), or None before anything was measured."""
        with self._lock:
            pre, dec = list(self.prefills), list(self.per_token)
        return estimate(pre, dec, n_prompt, max_new)

    def shape(self, config: ModelConfig) -> tuple[float, float]:
        """(c1, c2): how a prefill's work grows with its positions, for weighing its progress: measured here
        once three prompt lengths were, else from the model's arithmetic."""
        with self._lock:
            fit = fit_prefill(list(self.prefills))
        if fit is not None and fit.lengths >= FULL_TERMS and fit.c1 + fit.c2 > 0:
            return fit.c1, fit.c2
        return flop_shape(config)


_rates: dict[tuple, Rates] = {}
_rates_lock = threading.Lock()


def rates(model: Model) -> Rates:
    """This process's measurements for one loaded model (name, device, dtype)."""
    key = (model.name, model.device.type, str(model.dtype))
    with _rates_lock:
        return _rates.setdefault(key, Rates())
