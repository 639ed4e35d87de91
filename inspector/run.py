"""One inspected run: the settings a user chose, and the engine's result with everything its probe kept.

This is the code path every page (and the concurrency tests) use: the model is shared, the probe, cache,
RNG and result belong to this run alone. Before the engine sees a request it is checked against the
server's limits (inspector.limits) and then waits for a device slot (inspector.admission).

Nothing at module level holds a run: a RunRecord lives exactly as long as the session (or caller) that
keeps it. `live_runs()` counts the records still alive through weak references, which never keep one.
"""
from __future__ import annotations

import dataclasses
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Callable

from engine import GenerationResult, Model, Probe, SamplingParams, Step
from engine.generate import prompt_ids

from .admission import Admission, shared_admission
from .limits import LimitError, Limits, check_text, env_name

_live: "weakref.WeakSet[RunRecord]" = weakref.WeakSet()


@dataclass(frozen=True)
class RunSettings:
    prompt: str
    chat: bool = True
    system: str | None = None
    allow_special: bool = False        # let special-token text typed in the prompt act as control tokens
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    no_repeat_ngram: int = 0
    seed: int = 0
    timing: bool = True                # per-layer timing marks

    def generation_kwargs(self) -> dict:
        kw = asdict(self)
        for k in ("prompt", "timing"):
            kw.pop(k)
        return kw

    def sampling_params(self) -> SamplingParams:
        """The sampler settings, validated by the engine (InputError naming the bad one)."""
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty,
                              self.frequency_penalty, self.presence_penalty, self.no_repeat_ngram)


@dataclass(eq=False)
class RunRecord:
    settings: RunSettings
    result: GenerationResult
    probe: Probe
    model_name: str
    seconds: float
    created: float = field(default_factory=time.time)
    notes: list[str] = field(default_factory=list)     # what the app changed or wants the user to know

    def __post_init__(self) -> None:
        _live.add(self)

    @property
    def ids(self) -> list[int]:
        """Prompt and generated ids: every position of the run."""
        return self.result.all_ids

    @property
    def n_prompt(self) -> int:
        return len(self.result.prompt_ids)


def live_runs() -> int:
    """RunRecords alive in this process (all sessions), counted without keeping any alive."""
    return len(_live)


def inspection_probe(timing: bool = True) -> Probe:
    """Statistics of every stage at every step, and the logits of each step (for the sampling page)."""
    return Probe(timing=timing).record_stats("*").capture("logits")


def check_settings(model: Model, settings: RunSettings, limits: Limits) -> tuple[RunSettings, list[str]]:
    """Settings safe to hand to the engine, and notes for the user; PromptError / LimitError / InputError
    (each an engine InputError naming what is wrong) before any device work or queueing."""
    prompt, notes = check_text(settings.prompt, limits, "prompt")
    system = settings.system
    if system is not None:
        system, more = check_text(system, limits, "system message", allow_empty=True)
        notes += more
    n_new = settings.max_new_tokens
    if isinstance(n_new, int) and not isinstance(n_new, bool) and n_new > limits.max_new_tokens:
        raise LimitError(f"{n_new:,} new tokens asked for; this server generates at most {limits.max_new_tokens:,} "
                         f"per run ({env_name('max_new_tokens')})")
    settings = dataclasses.replace(settings, prompt=prompt, system=system)
    settings.sampling_params()
    ids = prompt_ids(model, prompt, chat=settings.chat, system=system, allow_special=settings.allow_special)
    if len(ids) > limits.max_prompt_tokens:
        raise LimitError(f"the prompt is {len(ids):,} tokens long (as the model sees it); this server accepts at "
                         f"most {limits.max_prompt_tokens:,} ({env_name('max_prompt_tokens')})")
    if not settings.allow_special:
        tok = model.tokenizer
        special = sorted({tok.token_text(i) for i in tok.encode(prompt, allow_special=True) if tok.is_special(i)})
        if special:
            notes.append(f"The prompt contains special-token text ({', '.join(special[:5])}); it was read as plain "
                         "text. Turn on 'Special-token text in the prompt acts as control tokens' to use it as "
                         "control tokens.")
    return settings, notes


def inspect_run(model: Model, settings: RunSettings, on_token: Callable[[Step], None] | None = None, *,
                limits: Limits | None = None, on_queue: Callable[[int], None] | None = None,
                admission: Admission | None = None) -> RunRecord:
    """Check the request, wait for a device slot (on_queue(position) while waiting), generate with full
    inspection. Limits default to the environment's, admission to the process-wide queue."""
    limits = limits or Limits.from_env()
    settings, notes = check_settings(model, settings, limits)
    admission = admission or shared_admission(limits)
    with admission.slot(on_wait=on_queue, timeout=limits.queue_timeout_s):
        probe = inspection_probe(settings.timing)
        t0 = time.perf_counter()
        result = model.generate(settings.prompt, probe=probe, on_token=on_token, **settings.generation_kwargs())
        seconds = time.perf_counter() - t0
    return RunRecord(settings, result, probe, model.name, seconds, notes=notes)
