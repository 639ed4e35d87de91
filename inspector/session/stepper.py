"""The debugger's live run: one steppable, fully inspected GenerationRun per browser session, its breakpoints,
and the sampler settings in force from each step on. Published to every page as an ordinary run record (engine.Trace).

    dbg = Debugger(model, settings)
    dbg.step(); dbg.cont(); dbg.set_params(SamplingParams(temperature=0.7)); dbg.run_to_end()
    record = dbg.record()          # Trace of the run so far (the pages' st.session_state["run"])
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import replace

from engine import (
    GenerationRun,
    InputError,
    KVCache,
    Model,
    RunSettings,
    SamplingParams,
    Step,
    Trace,
    inspection_probe,
    make_trace,
)
from engine.tools.breakpoints import ROUTING_CAPTURE, Breakpoint, run_until

from .limits import Limits
from .run import check_settings, track


_open: "weakref.WeakSet[Debugger]" = weakref.WeakSet()     # every debugger alive (the server's memory line)


def debugger_caches() -> tuple[int, int]:
    """(debuggers alive in this process whose run still holds its KV cache, the bytes those caches allocate)."""
    caches = [c for d in list(_open) if isinstance(c := d.run.cache, KVCache)]
    return len(caches), sum(c.bytes_allocated for c in caches)


class Debugger:
    def __init__(self, model: Model, settings: RunSettings, breakpoints: list[Breakpoint] | None = None, *,
                 limits: Limits | None = None) -> None:
        checked = check_settings(model, settings, limits or Limits.from_env())   # as inspect_run does
        self.settings = settings = checked.settings
        self.notes = list(checked.notes)
        self.model_name = model.name
        self.probe = inspection_probe(timing=settings.timing)
        if model.config.num_experts:        # routing breakpoints read each step's gates
            self.probe.capture(ROUTING_CAPTURE)
        t0 = time.perf_counter()
        self.run = GenerationRun(model, list(checked.prompt_ids), probe=self.probe, **settings.generation_kwargs())
        self.run.timings["tokenize"] = checked.tokenize_s     # tokenised once, by the check
        self.seconds = time.perf_counter() - t0
        self.breakpoints: list[Breakpoint] = list(breakpoints or [])
        self.params_log: list[tuple[int, SamplingParams]] = [(0, self.run.params)]   # (first step, params)
        self.message: str | None = None          # what the last break said
        self.published: Trace | None = None   # the last record() made
        self._stepping = threading.Lock()
        _open.add(self)

    @property
    def steps(self) -> list[Step]:
        return self.run.steps

    @property
    def done(self) -> bool:
        return self.run.done

    def advance(self, max_steps: int | None = None, *, use_breakpoints: bool = True) -> list[Step]:
        """Step until a breakpoint fires, the run ends, or max_steps. The fired message is kept in .message."""
        # A double click can start two script runs of one session at once; stepping one run from two threads
        # would skip a KV-cache position and attend to a zero slot. The second one is refused instead.
        if not self._stepping.acquire(blocking=False):
            raise InputError("this run is already stepping (a second click?); wait for it to finish")
        t0 = time.perf_counter()
        try:
            steps, self.message = run_until(self.run, self.breakpoints if use_breakpoints else (), max_steps)
            if self.run.done:
                self.release_cache()
        finally:
            self.seconds += time.perf_counter() - t0
            self._stepping.release()
        return steps

    def release_cache(self) -> None:
        """Give the KV cache's memory back once the run has ended (nothing steps it again); its figures stay."""
        self.run.release_cache()

    def step(self) -> list[Step]:
        return self.advance(1)

    def cont(self) -> list[Step]:
        return self.advance(None)

    def run_to_end(self) -> list[Step]:
        return self.advance(None, use_breakpoints=False)

    def set_params(self, params: SamplingParams) -> bool:
        """Sample the next steps with new settings. True when they differ from the current ones."""
        if params == self.run.params:
            return False
        self.run.params = params
        n = len(self.run.steps)
        self.params_log = [(s, p) for s, p in self.params_log if s < n] + [(n, params)]
        return True

    def params_at(self, step: int) -> SamplingParams:
        """The sampler settings that chose the token of this step."""
        return [p for s, p in self.params_log if s <= step][-1]

    def record(self) -> Trace:
        """The run so far, as the record every page reads (settings show the sampler now in force).

        Each record is a new snapshot with its own `created`: pages memoise by (id(record), created), and an
        earlier snapshot's id may be reused once it is garbage-collected."""
        settings = replace(self.settings, params=self.run.params)
        created = time.time()
        if self.published is not None:
            created = max(created, self.published.created + 1e-6)
        self.published = track(make_trace(settings, self.run.result(), self.probe, self.model_name, self.seconds,
                                          created=created, notes=self.notes))
        return self.published
