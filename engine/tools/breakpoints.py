"""Conditional breakpoints for a steppable GenerationRun: each condition looks at the step just taken (and the
probe's statistics of that step's forward) and returns a message when it fires.

    bps = [NonFinite(), AbsAbove(1e4, "blocks.*.resid_post"), EntropyBelow(0.1), RepeatedNgram(3), TokenIs((7042,))]
    steps, fired = run_until(run, bps)              # stops after the step that fired, at the end, or at max_steps
    run.params = SamplingParams(temperature=0.7)    # change the sampler, then continue
    steps, fired = run_until(run, bps)

Stage conditions read StatsBlock rows (engine.inspection.stat_columns.Col) of the blocks
whose `step` is the step's index, so the run's probe must record statistics of those stages
(engine.inspection.probe.inspection_probe does, for every stage).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from types import SimpleNamespace
from typing import Iterator, Protocol, Sequence

from engine.errors import EngineError, InputError
from engine.inspection.probe import Probe
from engine.inspection.stat_columns import Col

ABSMAX, NAN, INF = Col.ABSMAX, Col.NAN, Col.INF


class Breakpoint(Protocol):
    def check(self, run, step, probe: Probe | None) -> str | None: ...

    def describe(self) -> str: ...


def step_stats(probe: Probe | None, index: int, pattern: str = "*") -> Iterator[tuple[str, int, "object"]]:
    """(stage name, absolute position, stats row (7,)) of one step's forward, in forward order."""
    if probe is None:
        raise EngineError("this breakpoint reads stage statistics: give the run a probe that records them "
                          "(Probe().record_stats('*'))")
    for b in probe.recording.stats:
        if b.step != index:
            continue
        for g, name in enumerate(b.names):
            if fnmatchcase(name, pattern):
                for t in range(b.values.shape[1]):
                    yield name, b.pos0 + t, b.values[g, t]


def _label(run, token_id: int) -> str:
    return repr(run.model.tokenizer.decode([token_id])) + f" (id {token_id})"


@dataclass(frozen=True)
class NonFinite:
    """Any NaN or Inf in a stage (glob) of the step's forward. -inf that masks (attention, sampler cuts) is no fault."""
    stage: str = "*"

    def describe(self) -> str:
        return f"NaN/Inf in {self.stage}"

    def check(self, run, step, probe: Probe | None) -> str | None:
        for name, pos, row in step_stats(probe, step.index, self.stage):
            n_nan, n_inf = int(row[NAN]), int(row[INF])
            if n_nan or n_inf:
                return (f"step {step.index}: {name} holds {n_nan} NaN and {n_inf} Inf at position {pos} "
                        "(first stage in forward order)")
        return None


@dataclass(frozen=True)
class AbsAbove:
    """|value| above a threshold in a stage (glob) of the step's forward."""
    threshold: float
    stage: str = "*"

    def __post_init__(self) -> None:
        if not (isinstance(self.threshold, (int, float)) and self.threshold >= 0):
            raise InputError(f"the |value| threshold must be a number >= 0, got {self.threshold!r}")

    def describe(self) -> str:
        return f"|value| > {self.threshold:g} in {self.stage}"

    def check(self, run, step, probe: Probe | None) -> str | None:
        for name, pos, row in step_stats(probe, step.index, self.stage):
            v = float(row[ABSMAX])
            if v > self.threshold:
                return f"step {step.index}: {name} reaches |value| {v:.4g} > {self.threshold:g} at position {pos}"
        return None


@dataclass(frozen=True)
class EntropyBelow:
    """The raw model distribution's entropy (nats, Step.entropy) below a threshold."""
    threshold: float

    def describe(self) -> str:
        return f"entropy < {self.threshold:g} nats"

    def check(self, run, step, probe: Probe | None) -> str | None:
        if step.entropy < self.threshold:
            return f"step {step.index}: entropy {step.entropy:.4f} nats < {self.threshold:g}"
        return None


@dataclass(frozen=True)
class RepeatedNgram:
    """The step's token completes an n-gram that already occurred (in the generated tokens, or with the prompt)."""
    n: int = 3
    include_prompt: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise InputError(f"the n-gram length must be a whole number >= 1, got {self.n!r}")

    def describe(self) -> str:
        return f"repeated {self.n}-gram" + (" (prompt included)" if self.include_prompt else "")

    def check(self, run, step, probe: Probe | None) -> str | None:
        gen = list(run.token_ids[:step.index + 1])
        seq = (list(run.prompt_ids) if self.include_prompt else []) + gen
        n = self.n
        if len(seq) < n:
            return None
        last = tuple(seq[-n:])
        for i in range(len(seq) - n):
            if tuple(seq[i:i + n]) == last:
                g = i - (len(run.prompt_ids) if self.include_prompt else 0)      # its first generated step
                where = f"at prompt position {i}" if g < 0 else f"at steps {g}..{g + n - 1}"
                text = run.model.tokenizer.decode(list(last))
                return f"step {step.index}: the {n}-gram {text!r} {list(last)} already occurred {where}"
        return None


@dataclass(frozen=True)
class TokenIs:
    """The step chose one of these token ids. texts: each id's text, for describe (the engine's breakpoints hold
    no tokenizer; whoever makes one from what a user typed knows them)."""
    token_ids: tuple[int, ...]
    texts: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise InputError("a token breakpoint needs at least one token id")
        if self.texts and len(self.texts) != len(self.token_ids):
            raise InputError(f"a token breakpoint has {len(self.token_ids)} ids but {len(self.texts)} texts")

    def describe(self) -> str:
        if self.texts:
            named = [f"{t!r} (id {i})" for i, t in zip(self.token_ids, self.texts)]
            return ("token " if len(named) == 1 else "token one of ") + ", ".join(named)
        return f"token id in {list(self.token_ids)}"

    def check(self, run, step, probe: Probe | None) -> str | None:
        if step.token_id in self.token_ids:
            return f"step {step.index}: chose token {_label(run, step.token_id)}"
        return None


@dataclass(frozen=True)
class RoutedTo:
    """Mixture of experts: the step's token (the last position of its forward) went to this expert at this layer. It
    reads the gates the run's probe captured at blocks.{layer}.mlp.experts (ROUTING_CAPTURE: the debugger's probe
    captures them for a model with experts)."""
    layer: int
    expert: int

    def __post_init__(self) -> None:
        for what, v in (("layer", self.layer), ("expert", self.expert)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InputError(f"a routing breakpoint's {what} must be a whole number >= 0, got {v!r}")

    @property
    def stage(self) -> str:
        return f"blocks.{self.layer}.mlp.experts"

    def describe(self) -> str:
        return f"token routed to expert {self.expert} at layer {self.layer}"

    def check(self, run, step, probe: Probe | None) -> str | None:
        caps = [] if probe is None else probe.recording.captured(self.stage, step=step.index)
        if not caps:
            raise EngineError(f"this breakpoint reads the gates at {self.stage}: the run's probe must capture them "
                              f"(Probe().capture({ROUTING_CAPTURE!r}))")
        gates = caps[-1].value[-1]                                             # (E,) at the forward's last position
        if not 0 <= self.expert < gates.shape[0]:
            raise InputError(f"expert {self.expert} does not exist: layer {self.layer} has {gates.shape[0]} experts")
        g = float(gates[self.expert])
        if g != 0:
            pos = caps[-1].positions[-1]
            ids = list(run.prompt_ids) + list(run.token_ids)
            tok = ids[pos] if pos < len(ids) else None
            what = f"token {_label(run, tok)} at position {pos}" if tok is not None else f"position {pos}"
            return f"step {step.index}: {what} went to expert {self.expert} at layer {self.layer} (gate {g:.4f})"
        return None


ROUTING_CAPTURE = "blocks.*.mlp.experts"


def check_all(run, step, breakpoints: Sequence[Breakpoint]) -> str | None:
    """Every condition that fires at this step, joined; None when none does."""
    fired = [m for bp in breakpoints if (m := bp.check(run, step, run.probe)) is not None]
    return "; ".join(fired) if fired else None


def _fired_at_nonfinite_stop(run, breakpoints: Sequence[Breakpoint]) -> str | None:
    """A run that stopped because a step's logits were NaN/Inf drew no token at that step, but its forward ran:
    the breakpoints on stage values (NaN/Inf, |value|) still say where it went wrong."""
    if getattr(run, "stop_reason", None) != "non-finite logits":
        return None
    stopped = SimpleNamespace(index=len(run.steps))
    for bp in breakpoints:
        if isinstance(bp, (NonFinite, AbsAbove)):
            fired = bp.check(run, stopped, run.probe)
            if fired is not None:
                return fired
    return None


def run_until(run, breakpoints: Sequence[Breakpoint] = (), max_steps: int | None = None):
    """Step the run until a breakpoint fires (that step included), the run ends, or max_steps steps.
    Returns (the steps taken, the fired message or None)."""
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
        raise InputError(f"max_steps must be a whole number >= 1 or None, got {max_steps!r}")
    steps = []
    while max_steps is None or len(steps) < max_steps:
        step = run.step()
        if step is None:
            return steps, _fired_at_nonfinite_stop(run, breakpoints)
        steps.append(step)
        fired = check_all(run, step, breakpoints)
        if fired is not None:
            return steps, fired
    return steps, None

