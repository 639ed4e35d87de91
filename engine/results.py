"""What a generation run hands back: the typed results of engine.generate's loop (a Step per token with its top
Candidates, the GenerationResult of the whole run). Here, below the model, so that what reads them (the trace, the
batch layer, the tools) imports the record and not the loop that makes it."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.inspection.recording import Recording
from engine.sampling import SamplingParams

__all__ = ["Candidate", "GenerationResult", "Step"]


@dataclass
class Candidate:
    id: int
    text: str
    prob: float          # under the model's raw distribution (softmax of the logits)


@dataclass
class Step:
    index: int           # 0 = the token chosen after prefill
    position: int        # absolute position the chosen token will occupy
    token_id: int
    text: str            # text the detokenizer completed at this step ('' mid-character)
    prob: float          # chosen token's probability under the sampling distribution
    model_prob: float    # ... under the raw model distribution
    entropy: float       # nats, raw model distribution
    kept: int            # tokens with non-zero sampling probability
    top: list[Candidate]
    seconds: dict[str, float]   # forward, sample, detokenize


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    steps: list[Step]
    stop_reason: str                   # eos | stop_string | max_new_tokens | context | non-finite logits | stopped
    params: SamplingParams
    seed: int
    timings: dict[str, float]          # tokenize, prefill, decode (total), per_token_decode
    cache: dict[str, int]              # bytes_allocated, bytes_used, bytes_per_token
    recording: Recording | None = field(default=None, repr=False)   # what the run's probe saw

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.token_ids
