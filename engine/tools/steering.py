"""Steering vectors (activation addition): a direction in the residual stream from two contrasting prompt sets, added
at one layer with a coefficient while a prompt is continued, beside the same prompt continued plainly.

- steering_vector(model, positive, negative, layer): the mean over the positive prompts of each prompt's mean
  residual stream after block `layer` (the stage blocks.{layer}.resid_post, every position of the prompt), less the
  same mean over the negative prompts (Turner et al.'s ActAdd takes one pair at the last positions; the mean over
  positions and prompts is the "mean difference" vector of Rimsky et al.'s contrastive activation addition). The
  prompts share forwards (a block-diagonal causal mask, blocks 0 .. layer only): one call of each block, not one per
  prompt.
- steer(model, settings, vector, coefficient): the plain run and the run with coefficient * vector added to
  blocks.{layer}.resid_post at every position (prompt and generated tokens: the steered run's probe declares it,
  Probe.add). The two prefills on the PyTorch forward, the steered one sharing the plain one's blocks 0 .. layer
  (their keys and values copied, KVCache.copy_layers; the later blocks run on the plain stream plus the vector: the
  steered run's own prefill bit for bit); then, where the model has the native batched step, both runs'
  decode steps in lockstep, one call of it a step (engine.native.step: NativeDecoder.rows adds the steered row's
  vector; each row computed as its run alone would be, so the plain run is the model's own plain run), else each run
  on the PyTorch forward; the two differ by the vector only (at coefficient 0 they are bit for bit one run), and per
  step of the steered run, how far the steering moved the distribution: KL(steered || plain)
  with the plain model's distribution on the steered run's own prefix (teacher-forced), and the
  probability of the steered token under each (the plain run's own logits up to the step where the two runs part,
  then a third row of the batched step: the plain model on a fork of the plain run's cache fed the steered tokens;
  without the batched step one forward over the steered prefix).

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
from engine.tools.patching import PrefixKV

MAX_PROMPTS = 16
MAX_PROMPT_TOKENS = 256
MAX_COEFFICIENT = 1e4
PACK_ROWS = 512         # the vector's prompts share forwards of at most this many rows (its mask: rows x rows)


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
    ids = []
    for p in pos + neg:
        ids.append(prompt_ids(model, p, chat=chat))
        if len(ids[-1]) > MAX_PROMPT_TOKENS:
            raise InputError(f"a steering prompt has {len(ids[-1])} tokens; at most {MAX_PROMPT_TOKENS}")
    means = _mean_streams(model, ids, layer)
    vector = torch.stack(means[:len(pos)]).mean(0) - torch.stack(means[len(pos):]).mean(0)
    return SteeringVector(layer, vector.cpu(), pos, neg)


@torch.inference_mode()
def _mean_streams(model: Model, prompts: list[list[int]], layer: int) -> list[torch.Tensor]:
    """Each prompt's mean over its positions of the stream leaving block `layer` (float32). The prompts share
    forwards of at most PACK_ROWS rows, each row attending to its own prompt's earlier rows only (a block-diagonal
    causal mask, its own positions): the same blocks as a forward of each prompt alone, up to the products' rounding
    (one call of each block per pack, not per prompt; the later blocks and the logits are never computed)."""
    cfg, out = model.config, []
    for pack in _packs(prompts):
        # each prompt embedded alone (its positions from 0: GPT-2's learned positions are added there)
        x = torch.cat([model.forward(torch.tensor(ids), model.new_cache(len(ids)), stop_after="embed") for ids in pack])
        positions = torch.cat([torch.arange(len(ids)) for ids in pack])
        owner = torch.cat([torch.full((len(ids),), j) for j, ids in enumerate(pack)])
        mask = (owner[:, None] == owner[None, :]) & (positions[None, :] <= positions[:, None])
        none = torch.empty(cfg.num_kv_heads, 0, cfg.head_dim, device=model.device, dtype=model.cache_dtype)
        y = model.run_blocks(x, PrefixKV(none, none), 0, layer + 1, positions=positions, mask=mask)
        out += [part.float().mean(0) for part in y.split([len(ids) for ids in pack])]
    return out


def _packs(prompts: list[list[int]]) -> list[list[list[int]]]:
    """The prompts in order, in packs of at most PACK_ROWS rows (a longer prompt alone)."""
    packs, rows = [[]], 0
    for ids in prompts:
        if packs[-1] and rows + len(ids) > PACK_ROWS:
            packs, rows = packs + [[]], 0
        packs[-1].append(ids)
        rows += len(ids)
    return packs


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
    plain = GenerationRun(plain_model, settings.prompt, probe=Probe().capture(["logits", vec.stage]), **kw)
    steered = GenerationRun(plain_model, settings.prompt, probe=steering_probe(vec, c, Probe().capture("logits")),
                            **kw)
    first = _prefill_both(plain_model, plain, steered, vec.layer)
    plain_logits, steered_logits, forked = _run_both(model, plain, steered, first)
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
def _prefill_both(model: Model, plain: GenerationRun, steered: GenerationRun, layer: int) -> list[list[torch.Tensor]]:
    """Both prefills -> each run's first logits (float32, [] when it drew no token). The plain run prefills itself
    (its chunks, its template opening: the model's own plain run), its probe keeping the prompt's stream after
    block `layer`. The steered prompt is the plain one up to there (its vector is added after block `layer`): its
    cache takes the plain run's keys and values of blocks 0 .. layer, and only the later blocks run, on the plain
    stream plus the vector (x + v.to(x.dtype), as the steered forward adds it), in the same chunks as the plain
    prefill (each chunk a call of Model.run_blocks, the same blocks as the forward's), then the final norm and the
    head on the last row (Model.unembed). At coefficient 0 it is the plain prefill bit for bit."""
    plain.step()
    if not plain.steps:         # no token (non-finite logits): the steered run prefills alone
        steered.step()
        return [[], _first_logits(steered)]
    stage, ids, t0 = f"blocks.{layer}.resid_post", steered.prompt_ids, time.perf_counter()
    kept = sorted(plain.probe.recording.captured(stage, 0), key=lambda cap: cap.positions[0])
    x = torch.cat([cap.value for cap in kept]).to(model.device)
    add = steered.probe.additions[layer].to(x.dtype).to(model.device)
    steered.cache.copy_layers(plain.cache, range(layer + 1))
    logits = None
    for a, b in prefill_chunks(model, ids, steered.prefix_len):
        y = model.run_blocks(x[a:b] + add, steered.cache, layer + 1, model.config.num_layers,
                             positions=torch.arange(a, b))
        steered.cache.advance(b - a)
        logits = y[-1:]
    logits = model.unembed(logits)[0]
    steered.step(logits, seconds=time.perf_counter() - t0)
    return [_first_logits(plain), [logits] if steered.steps else []]


def _first_logits(run: GenerationRun) -> list[torch.Tensor]:
    """The logits of run's first step, as its probe captured them (float32), or [] when it drew no token."""
    return [run.probe.recording.captured("logits", 0)[0].value.float()[-1]] if run.steps else []


@torch.inference_mode()
def _run_both(model: Model, plain: GenerationRun, steered: GenerationRun, first: list) -> tuple[list, list, list]:
    """Both runs to their ends -> (the plain run's float32 logits of every step, the steered run's, and the plain
    model's logits before each steered token after the one where the runs part: [] when not computed here). The
    prefills done (_prefill_both: `first`, each run's first logits); then, where the model has the native batched step (engine.native.step:
    NativeDecoder.rows, which adds each row's probe's additions, Probe.add, at its resid_post), every run's decode
    step in one call of it, the runs in lockstep (batch invariance: each row as its run alone would be computed; the
    plain run's rows as its native decode steps alone), so both continuations cost about one. From the step where
    the steered token is not the plain one, a third row: the plain model (no addition) fed the steered run's tokens,
    on a fork of the plain run's cache (its prefix is the steered run's up to there: KVCache.fork), which gives the
    plain distribution on the steered prefix at the cost of one more row a step. Without the native batched step
    each run runs alone on its PyTorch forward, which applies the additions itself."""
    runs, out = [plain, steered], first
    step = model.accelerator.decode
    if step is None or step.rows_refusal or not steered.probe.served_by(step.names, adds=True):
        for run in runs:
            run.run()
        return (*(rows + [run.probe.recording.captured("logits", k)[0].value.float()[-1]
                          for k in range(len(rows), len(run.token_ids))] for run, rows in zip(runs, out)), [])
    # the plain run's decode steps need no probe (their logits are the batched call's); its prefill's, which kept
    # the stream for the steered prefill, would hold the native step off (a capture it does not serve)
    plain.probe = None
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
        rows = [(run.decode_input(), run.cache, run.probe.additions if run.probe else None) for run, _ in live]
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
