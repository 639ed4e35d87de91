"""Generation: prefill, decode one token at a time, sample, detokenise. Steppable for the debugger.

    run = GenerationRun(model, "prompt", params=SamplingParams(temperature=0.7), max_new_tokens=32, seed=1,
                        probe=probe)
    while (step := run.step()) is not None: ...      # or: result = run.run()
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import InputError
from .probe import Probe
from .sampling import SamplingParams, draw, entropy, sampler_chain

TOP_CANDIDATES = 10


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
    stop_reason: str                   # eos | stop_string | max_new_tokens | context
    params: SamplingParams
    seed: int
    timings: dict[str, float]          # tokenize, prefill, decode (total), per_token_decode
    cache: dict[str, int]              # bytes_allocated, bytes_used, bytes_per_token
    probe: Probe | None = field(default=None, repr=False)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.token_ids


def prompt_ids(model, prompt_or_ids, *, chat: bool = False, system: str | None = None,
               allow_special: bool = False) -> list[int]:
    if isinstance(prompt_or_ids, str):
        if not prompt_or_ids.strip():
            raise InputError("the prompt is empty")
        if chat:
            msgs = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt_or_ids}]
            ids = model.tokenizer.encode_chat(msgs, add_generation_prompt=True,
                                              allow_special_in_content=allow_special)
        else:
            ids = model.tokenizer.encode(prompt_or_ids, allow_special=allow_special)
    else:
        ids = [int(i) for i in prompt_or_ids]
    if not ids:
        raise InputError("the prompt is empty (no tokens)")
    if len(ids) >= model.context_length:
        raise InputError(f"the prompt has {len(ids)} tokens; the model's context is {model.context_length} "
                         "tokens and at least one must be left to generate")
    return ids


class GenerationRun:
    def __init__(self, model, prompt_or_ids, *, params: SamplingParams | None = None, max_new_tokens: int = 64,
                 seed: int = 0, stop: list[str] | str | None = None, chat: bool = False,
                 system: str | None = None, allow_special: bool = False, ignore_eos: bool = False,
                 use_cache: bool = True, probe: Probe | None = None,
                 on_token: Callable[[Step], None] | None = None) -> None:
        """use_cache=False recomputes the whole sequence at every step (a fresh cache each time): the same
        tokens as with the cache up to rounding, at the cost of a full forward per token (Compare runs)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 63:
            raise InputError(f"seed must be a whole number in [0, 2**63), got {seed!r}")
        if params is not None and not isinstance(params, SamplingParams):
            raise InputError(f"params must be a SamplingParams, got {type(params).__name__}")
        self.params = params or SamplingParams()
        self.use_cache = use_cache
        self.stop = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]
        self.model, self.probe, self.on_token, self.seed = model, probe, on_token, seed
        t0 = time.perf_counter()
        self.prompt_ids = prompt_ids(model, prompt_or_ids, chat=chat, system=system, allow_special=allow_special)
        self.timings = {"tokenize": time.perf_counter() - t0, "prefill": 0.0, "decode": 0.0}
        self.max_new_tokens = max_new_tokens
        self.cache = model.new_cache(len(self.prompt_ids) + max_new_tokens)
        self.generator = torch.Generator().manual_seed(seed)
        self.detok = model.tokenizer.stream()
        self.eos = set() if ignore_eos else set(model.tokenizer.eos_ids) | set(model.config.eos_token_ids)
        self.token_ids: list[int] = []
        self.steps: list[Step] = []
        self.text = ""
        self.stop_reason: str | None = None
        if probe is not None:
            probe.step = 0
            with model.attached(probe, 0):
                probe("tokenizer", torch.tensor(self.prompt_ids))

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def step(self) -> Step | None:
        """Run one forward + sample + detokenize. None once the run has stopped."""
        if self.done:
            return None
        model, probe, index = self.model, self.probe, len(self.steps)
        if probe is not None:
            probe.step = index
        t0 = time.perf_counter()
        if self.use_cache:
            ids = self.prompt_ids if index == 0 else self.token_ids[-1:]
        else:           # the whole sequence again, into a fresh cache of the same size
            ids = self.prompt_ids + self.token_ids
            self.cache = model.new_cache(self.cache.max_len)
        logits = model.forward(torch.tensor(ids), self.cache, probe, last_only=True)[0].float().cpu()
        t1 = time.perf_counter()
        self.timings["prefill" if index == 0 else "decode"] += t1 - t0

        context = self.prompt_ids + self.token_ids
        with model.attached(probe, self.cache.get_pos()):
            stages = sampler_chain(logits, self.params, context, self.token_ids, offer=probe)
        probs = stages["sampler.probs"]
        token = int(torch.argmax(probs)) if self.params.temperature == 0 else draw(probs, self.generator)
        raw = torch.softmax(logits, dim=-1)
        top = torch.topk(raw, TOP_CANDIDATES)
        t2 = time.perf_counter()

        tok = model.tokenizer
        is_eos = token in self.eos
        piece = "" if is_eos else self.detok.step(token)
        if probe is not None:
            with model.attached(probe, self.cache.get_pos()):
                piece = probe("detokenizer", piece)
        t3 = time.perf_counter()
        step = Step(index=index, position=self.cache.get_pos(), token_id=token, text=piece,
                    prob=float(probs[token]), model_prob=float(raw[token]), entropy=entropy(raw),
                    kept=int((probs > 0).sum()),
                    top=[Candidate(int(i), tok.decode([int(i)]), float(p)) for p, i in zip(top.values, top.indices)],
                    seconds={"forward": t1 - t0, "sample": t2 - t1, "detokenize": t3 - t2})
        self.steps.append(step)
        self.token_ids.append(token)
        self.text += piece
        self._check_stop(is_eos)
        if self.on_token:
            self.on_token(step)
        return step

    def _check_stop(self, is_eos: bool) -> None:
        if is_eos:
            self.stop_reason = "eos"
        for s in self.stop:
            if s in self.text:
                self.text = self.text[:self.text.index(s)]
                self.stop_reason = "stop_string"
                return
        if self.stop_reason is None and len(self.token_ids) >= self.max_new_tokens:
            self.stop_reason = "max_new_tokens"
        elif self.stop_reason is None and self.cache.get_pos() + 1 > self.cache.max_len:
            self.stop_reason = "context"
        if self.done and self.stop_reason != "stop_string":
            self.text += self.detok.flush()

    def run(self) -> GenerationResult:
        while self.step() is not None:
            pass
        return self.result()

    def result(self) -> GenerationResult:
        n_dec = max(1, len(self.steps) - 1)
        timings = dict(self.timings, per_token_decode=self.timings["decode"] / n_dec)
        c = self.cache
        return GenerationResult(self.prompt_ids, list(self.token_ids), self.text, list(self.steps),
                                self.stop_reason or "running", self.params, self.seed, timings,
                                {"bytes_allocated": c.bytes_allocated, "bytes_used": c.bytes_used,
                                 "bytes_per_token": c.bytes_per_token}, self.probe)


def generate(model, prompt_or_ids, **kwargs) -> GenerationResult:
    return GenerationRun(model, prompt_or_ids, **kwargs).run()
