"""The debugger's live run: one steppable, fully inspected GenerationRun per browser session, its breakpoints,
and the sampler settings in force from each step on. Published to every page as an ordinary RunRecord.

    dbg = Debugger(model, settings)
    dbg.step(); dbg.cont(); dbg.set_params(SamplingParams(temperature=0.7)); dbg.run_to_end()
    record = dbg.record()          # RunRecord of the run so far (the pages' st.session_state["run"])
"""
from __future__ import annotations

import time
from dataclasses import asdict, replace

import pandas as pd

from engine import GenerationRun, InputError, Model, SamplingParams, Step
from engine.breakpoints import Breakpoint, run_until

from .limits import Limits
from .run import RunRecord, RunSettings, check_settings, inspection_probe
from .tokens import bytes_label, visible


class Debugger:
    def __init__(self, model: Model, settings: RunSettings, breakpoints: list[Breakpoint] | None = None, *,
                 limits: Limits | None = None) -> None:
        settings, self.notes = check_settings(model, settings, limits or Limits.from_env())   # as inspect_run does
        self.settings = settings
        self.model_name = model.name
        self.probe = inspection_probe(settings.timing)
        t0 = time.perf_counter()
        self.run = GenerationRun(model, settings.prompt, probe=self.probe, **settings.generation_kwargs())
        self.seconds = time.perf_counter() - t0
        self.breakpoints: list[Breakpoint] = list(breakpoints or [])
        self.params_log: list[tuple[int, SamplingParams]] = [(0, self.run.params)]   # (first step, params)
        self.message: str | None = None          # what the last break said
        self.published: RunRecord | None = None  # the last record() made

    @property
    def steps(self) -> list[Step]:
        return self.run.steps

    @property
    def done(self) -> bool:
        return self.run.done

    def advance(self, max_steps: int | None = None, *, use_breakpoints: bool = True) -> list[Step]:
        """Step until a breakpoint fires, the run ends, or max_steps. The fired message is kept in .message."""
        t0 = time.perf_counter()
        try:
            steps, self.message = run_until(self.run, self.breakpoints if use_breakpoints else (), max_steps)
        finally:
            self.seconds += time.perf_counter() - t0
        return steps

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

    def add_breakpoint(self, bp: Breakpoint) -> None:
        if bp not in self.breakpoints:
            self.breakpoints.append(bp)

    def remove_breakpoint(self, i: int) -> None:
        del self.breakpoints[i]

    def record(self) -> RunRecord:
        """The run so far, as the record every page reads (settings show the sampler now in force).

        Each record is a new snapshot with its own `created`: pages memoise by (id(record), created), and an
        earlier snapshot's id may be reused once it is garbage-collected."""
        settings = replace(self.settings, **asdict(self.run.params))
        created = time.time()
        if self.published is not None:
            created = max(created, self.published.created + 1e-6)
        self.published = RunRecord(settings, self.run.result(), self.probe, self.model_name, self.seconds,
                                   created=created, notes=list(self.notes))
        return self.published


def candidates_table(step: Step, tok=None) -> pd.DataFrame:
    """The step's top candidates under the raw model distribution; the chosen token is flagged (and added
    at the end when the sampler chose one outside the top)."""
    def label(i: int, text: str) -> str:
        return visible(bytes_label(tok.token_bytes(i)) if tok is not None else text)
    rows = [{"rank": r + 1, "id": c.id, "token": label(c.id, c.text), "model_prob": c.prob,
             "chosen": c.id == step.token_id} for r, c in enumerate(step.top)]
    if not any(r["chosen"] for r in rows):
        rows.append({"rank": None, "id": step.token_id, "token": label(step.token_id, step.text),
                     "model_prob": step.model_prob, "chosen": True})
    return pd.DataFrame(rows, columns=["rank", "id", "token", "model_prob", "chosen"])


def params_table(log: list[tuple[int, SamplingParams]]) -> pd.DataFrame:
    """One row per change of the sampler settings: from which step on, and the settings."""
    return pd.DataFrame([{"from_step": s, **asdict(p)} for s, p in log])


def describe_step(step: Step, tok=None) -> str:
    text = visible(bytes_label(tok.token_bytes(step.token_id)) if tok is not None else step.text)
    return (f"step {step.index}: {text!r} (id {step.token_id}) p={step.prob:.4f} "
            f"model p={step.model_prob:.4f} entropy {step.entropy:.3f} nats")


def token_ids_for(tok, text: str, vocab_size: int | None = None) -> tuple[int, ...]:
    """A token breakpoint's ids from what the user typed: ids ('7042' or '7042, 13') or text of one token."""
    parts = [p.strip() for p in text.split(",")]
    if parts and all(p.isdigit() for p in parts):
        ids = tuple(int(p) for p in parts)
        if vocab_size is not None and max(ids) >= vocab_size:
            raise InputError(f"token id {max(ids)} is outside the vocabulary [0, {vocab_size})")
        return ids
    if not text:
        raise InputError("enter a token's text (' Paris') or its id")
    ids = tok.encode(text)
    if len(ids) != 1:
        raise InputError(f"{text!r} is {len(ids)} tokens {ids}; a token breakpoint needs one token "
                         "(mind the leading space: ' Paris') or its id")
    return (ids[0],)
