"""One inspected run: the settings a user chose, and the engine's result with everything its probe kept.

This is the code path every page (and the concurrency tests) use: the model is shared, the probe, cache,
RNG and result belong to this run alone.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from engine import GenerationResult, Model, Probe, Step


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


@dataclass
class RunRecord:
    settings: RunSettings
    result: GenerationResult
    probe: Probe
    model_name: str
    seconds: float
    created: float = field(default_factory=time.time)

    @property
    def ids(self) -> list[int]:
        """Prompt and generated ids: every position of the run."""
        return self.result.prompt_ids + self.result.token_ids

    @property
    def n_prompt(self) -> int:
        return len(self.result.prompt_ids)


def inspection_probe(timing: bool = True) -> Probe:
    """Statistics of every stage at every step, and the logits of each step (for the sampling page)."""
    return Probe(timing=timing).record_stats("*").capture("logits")


def inspect_run(model: Model, settings: RunSettings, on_token: Callable[[Step], None] | None = None) -> RunRecord:
    probe = inspection_probe(settings.timing)
    t0 = time.perf_counter()
    result = model.generate(settings.prompt, probe=probe, on_token=on_token, **settings.generation_kwargs())
    return RunRecord(settings, result, probe, model.name, time.perf_counter() - t0)
