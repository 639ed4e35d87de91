"""Steering vectors (activation addition): a direction in the residual stream from two contrasting prompt sets, added
at one layer with a coefficient while a prompt is continued, beside the same prompt continued plainly.

- steering_vector(model, positive, negative, layer): the mean over the positive prompts of each prompt's mean
  residual stream after block `layer` (the stage blocks.{layer}.resid_post, every position of the prompt), less the
  same mean over the negative prompts (Turner et al.'s ActAdd takes one pair at the last positions; the mean over
  positions and prompts is the "mean difference" vector of Rimsky et al.'s contrastive activation addition).
- steer(model, settings, vector, coefficient): the plain run and the run with coefficient * vector added to
  blocks.{layer}.resid_post at every position (prompt and generated tokens: the steered run's probe declares it,
  Probe.add), the two prefills on the PyTorch forward, then, where the model has the native batched step, both runs'
  decode steps in lockstep, one call of it a step (engine.native.step: NativeDecoder.rows adds the steered row's
  vector; each row computed as its run alone would be, so the plain run is the model's own plain run), else each run
  on the PyTorch forward; the two differ by the vector only (at coefficient 0 they are bit for bit one run), and per
  step of the steered run, how far the steering moved the distribution: KL(steered || plain)
  with the plain model's distribution on the steered run's own prefix (teacher-forced), and the
  probability of the steered token under each (the plain run's own logits up to the step where the two runs part,
  then one forward over the steered prefix).

Bounds: MAX_PROMPTS prompts a side, MAX_PROMPT_TOKENS tokens a prompt, a finite coefficient of at most MAX_COEFFICIENT
in size; a bad layer or an empty set is an InputError naming it."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from engine.accelerator import PLAIN
from engine.errors import InputError
from engine.generate import GenerationRun, prefill_chunks, prompt_ids
from engine.inspection.probe import Probe
from engine.model import Model
from engine.settings import RunSettings

MAX_PROMPTS = 16
MAX_PROMPT_TOKENS = 256
MAX_COEFFICIENT = 1e4


@dataclass(frozen=True, eq=False)
class SteeringVector:
    layer: int
    vector: torch.Tensor           # (d,) float32 on the CPU
    positive: tuple[str, ...]
    negative: tuple[str, ...]

    @property
    def stage(self) -> str:
        return f"blocks.{self.layer}.resid_post"

    @property
    def norm(self) -> float:
        return float(self.vector.norm())

    def as_dict(self) -> dict:
        return {"layer": self.layer, "stage": self.stage, "norm": self.norm, "positive": list(self.positive),
                "negative": list(self.negative), "vector": self.vector.tolist()}


def _prompts(side: str, prompts) -> tuple[str, ...]:
    if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
        raise InputError(f"{side} prompts must be a list of strings")
    out = tuple(p for p in prompts if p.strip())
    if not out:
        raise InputError(f"the {side} set needs at least one non-empty prompt")
    if len(out) > MAX_PROMPTS:
        raise InputError(f"the {side} set has {len(out)} prompts; at most {MAX_PROMPTS}")
    return out


def steering_vector(model: Model, positive, negative, layer: int, *, chat: bool = False) -> SteeringVector:
    """mean_p mean_t resid_post[layer](p)[t] over the positive prompts less the same over the negative ones."""
    last = model.config.num_layers - 1
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= last:
        raise InputError(f"layer must be a whole number in 0..{last}, got {layer!r}")
    pos, neg = _prompts("positive", positive), _prompts("negative", negative)
    stage = f"blocks.{layer}.resid_post"

    def mean_of(prompts: tuple[str, ...]) -> torch.Tensor:
        means = []
        for p in prompts:
            ids = prompt_ids(model, p, chat=chat)
            if len(ids) > MAX_PROMPT_TOKENS:
                raise InputError(f"a steering prompt has {len(ids)} tokens; at most {MAX_PROMPT_TOKENS}")
            probe = Probe().capture(stage)
            # the forward ends after the stage (the later blocks and the logits would change nothing it reads)
            model.forward(torch.tensor(ids), model.new_cache(max(1, len(ids))), probe, stop_after=stage)
            means.append(probe.recording.captured(stage)[0].value.float().mean(0))
        return torch.stack(means).mean(0)
    return SteeringVector(layer, (mean_of(pos) - mean_of(neg)).cpu(), pos, neg)


def steering_probe(vec: SteeringVector, coefficient: float, probe: Probe | None = None) -> Probe:
    """probe (a new one by default) with coefficient * vec added to vec.stage at every position (Probe.add: the
    float32 product rounded to the model's dtype, then added)."""
    return (probe or Probe()).add(vec.stage, _coefficient(coefficient) * vec.vector)


def _coefficient(c) -> float:
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or abs(c) > MAX_COEFFICIENT:
        raise InputError(f"the coefficient must be a finite number of at most {MAX_COEFFICIENT:g} in size, got {c!r}")
    return float(c)


@dataclass
class SteeredRun:
    coefficient: float
    layer: int
    plain_ids: list[int]
    plain_text: str
    steered_ids: list[int]
    steered_text: str
    steps: list[dict]               # per steered step: token, text, KL(steered || plain), p steered / plain, plain top

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@torch.inference_mode()
def _plain_on_steered_prefix(model: Model, prompt: list[int], plain_ids: list[int], plain_logits: list[torch.Tensor],
                             tokens: list[int]) -> list[torch.Tensor]:
    """The plain model's float32 logits before each of the steered tokens (after the prompt and each prefix of
    tokens). Up to the first step where the steered run left the plain one, the prefix is the plain run's own, so its
    logits are the plain run's, bit for bit (at coefficient 0 every step: KL 0 exactly). After it, one forward over
    the prompt and the steered tokens (in a run's prefill chunks, engine.generate.prefill_chunks, every position's
    logits kept): the prefix's logits at the cost of one prefill instead of a decode step a token."""
    j = min(_parted(tokens, plain_ids), len(plain_logits))
    got = plain_logits[:min(j + 1, len(plain_logits), len(tokens))]
    if len(got) == len(tokens):
        return got
    ids, first = prompt + tokens[:-1], len(prompt) - 1 + len(got)     # the positions whose logits are wanted
    cache, rows = model.new_cache(len(ids)), []
    for a, b in prefill_chunks(model, ids):
        logits = model.forward(torch.tensor(ids[a:b]), cache)
        rows += [logits[i - a].float() for i in range(max(a, first), b)]     # only those rows kept (chunk x V each)
    return got + rows


def steer(model: Model, settings: RunSettings, vec: SteeringVector, coefficient: float) -> SteeredRun:
    """The plain and the steered continuation of settings' prompt (same seed and sampler), and the shift per step."""
    if not isinstance(vec, SteeringVector) or vec.vector.shape != (model.config.hidden_size,):
        raise InputError("the steering vector does not fit this model (another model's, or not a SteeringVector)")
    c = _coefficient(coefficient)
    # both prefills on the PyTorch forward (a prompt of one token would otherwise take the native lone step in the
    # plain run only, and coefficient 0 would no longer be the plain run bit for bit)
    plain_model = model.with_accelerator(PLAIN)
    kw = settings.generation_kwargs()
    plain = GenerationRun(plain_model, settings.prompt, probe=Probe().capture("logits"), **kw)
    steered = GenerationRun(plain_model, settings.prompt, probe=steering_probe(vec, c, Probe().capture("logits")),
                            **kw)
    plain_logits, steered_logits, forked = _run_both(model, plain, steered)
    steps = []
    if steered.token_ids:
        base = plain_logits[:_parted(plain.token_ids, steered.token_ids) + 1] + forked
        if len(base) < len(steered.token_ids):      # no native batched step (or the plain run ended first)
            base = _plain_on_steered_prefix(plain_model, steered.prompt_ids, plain.token_ids, plain_logits,
                                            steered.token_ids)
        for k, tok in enumerate(steered.token_ids):
            got = steered_logits[k]
            lp, lq = torch.log_softmax(got, -1), torch.log_softmax(base[k], -1)
            top = int(base[k].argmax())
            steps.append({"step": k, "token": tok, "text": model.tokenizer.decode([tok]),
                          "kl_steered_plain": max(0.0, float((lp.exp() * (lp - lq)).sum())),   # (-0.0 and last-bit negatives: 0)
                          "p_steered": float(lp[tok].exp()), "p_plain": float(lq[tok].exp()),
                          "plain_top": top, "plain_top_text": model.tokenizer.decode([top])})
    return SteeredRun(c, vec.layer, list(plain.token_ids), plain.result().text, list(steered.token_ids),
                      steered.result().text, steps)


def _parted(a: list[int], b: list[int]) -> int:
    """The first index where the token lists a and b differ (len of the shorter when one is the other's prefix)."""
    j = 0
    while j < len(a) and j < len(b) and a[j] == b[j]:
        j += 1
    return j


@torch.inference_mode()
def _run_both(model: Model, plain: GenerationRun, steered: GenerationRun) -> tuple[list, list, list]:
    """Both runs to their ends -> (the plain run's float32 logits of every step, the steered run's, and the plain
    model's logits before each steered token after the one where the runs part: [] when not computed here). The
    prefills on the runs' own (PyTorch) forward; then, where the model has the native batched step (engine.native.step:
    NativeDecoder.rows, which adds each row's probe's additions, Probe.add, at its resid_post), every run's decode
    step in one call of it, the runs in lockstep (batch invariance: each row as its run alone would be computed; the
    plain run's rows as its native decode steps alone), so both continuations cost about one. From the step where
    the steered token is not the plain one, a third row: the plain model (no addition) fed the steered run's tokens,
    on a fork of the plain run's cache (its prefix is the steered run's up to there: KVCache.fork), which gives the
    plain distribution on the steered prefix at the cost of one more row a step. Without the native batched step
    each run runs alone on its PyTorch forward, which applies the additions itself."""
    runs = [plain, steered]
    for run in runs:
        run.step()
    out = [[run.probe.recording.captured("logits", 0)[0].value.float()[-1]] if run.steps else [] for run in runs]
    step = model.accelerator.decode
    if step is None or step.rows_refusal or not all(run.probe.served_by(step.names, adds=True) for run in runs):
        for run in runs:
            run.run()
        return (*([run.probe.recording.captured("logits", k)[0].value.float()[-1]
                   for k in range(len(run.token_ids))] for run in runs), [])
    eps, fork, forked = model.config.rms_norm_eps, None, []
    while True:
        if fork is None and steered.token_ids and not plain.done and not steered.done \
                and plain.cache.get_pos() == steered.cache.get_pos() \
                and _parted(plain.token_ids, steered.token_ids) == len(steered.token_ids) - 1 < len(plain.token_ids):
            fork = plain.cache.fork()           # the prefix both runs share, before the token where they part
        live = [(run, rows) for run, rows in zip(runs, out) if run.decode_input() is not None]
        if not live:
            return out[0], out[1], forked
        with_fork = fork is not None and steered.decode_input() is not None
        for run, _ in live:
            run.cache.check_room(1)
        rows = [(run.decode_input(), run.cache, run.probe.additions) for run, _ in live]
        rows += [(steered.decode_input(), fork, None)] if with_fork else []
        t0 = time.perf_counter()
        logits, _, _, _ = step.rows([t for t, _, _ in rows], [c for _, c, _ in rows], [c.get_pos() for _, c, _ in rows],
                                    eps, False, adds=[a for _, _, a in rows])
        seconds = time.perf_counter() - t0
        if with_fork:
            fork.advance(1)
            forked.append(logits[-1].float())
        for (run, rows), row in zip(live, logits):
            run.cache.advance(1)
            rows.append(row.float())
            run.step(row, seconds=seconds)
