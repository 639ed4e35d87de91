"""Generation: prefill, decode one token at a time, sample, detokenise. Steppable for the debugger.

    run = GenerationRun(model, "prompt", params=SamplingParams(temperature=0.7), max_new_tokens=32, seed=1,
                        probe=probe)
    while (step := run.step()) is not None: ...      # or: result = run.run()

Stop reasons: eos, stop_string, max_new_tokens, context; "non-finite logits" when a step's logits hold a NaN or
Inf (nothing is sampled from them: that step draws no token; nonfinite_stop(result) names it); "stopped" when
on_token or on_progress returned STOP.

Long prompts are prefilled in chunks of engine.progress.PREFILL_CHUNK positions (the same attention, causal within a
chunk and over the cache before it), so on_progress can report the prefill by chunk and layer and a stop can land
between them, and no attention map larger than chunk x prompt is ever materialised. A chat prompt's template opening
is a chunk of its own (prefill_chunks), its keys and values copied from the process's prefix cache when another run
computed them (engine.prefix_cache): the same arithmetic either way.

The loop sits above the model: its progress record and answer (Progress, STOP, Stopped) live in engine.progress,
its results (Step, Candidate, GenerationResult) in engine.results, both below engine.model (imported here from
there, and importable from here as before).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

import engine.progress
from engine.errors import InputError
from engine.inspection.probe import Probe
from engine.inspection.stat_columns import Col
from engine.kv_cache import ReleasedCache
from engine.prefix_cache import PrefixCache, prefix_key, shared_prefix_cache, shared_prefix_len
from engine.progress import STOP, Progress, Stopped
from engine.prompt import prompt_ids
from engine.results import Candidate, GenerationResult, Step
from engine.sampling import SamplingParams, all_finite, draw, entropy, first_max, sampler_chain
from engine.settings import check_stop
from engine.threads import one_thread

TOP_CANDIDATES = 10
NONFINITE = "non-finite logits"
STOPPED = "stopped"


class GenerationRun:
    def __init__(self, model, prompt_or_ids, *, params: SamplingParams | None = None, max_new_tokens: int = 64,
                 seed: int = 0, stop: list[str] | str | None = None, chat: bool = False,
                 system: str | None = None, allow_special: bool = False, ignore_eos: bool = False,
                 use_cache: bool = True, probe: Probe | None = None,
                 on_token: Callable[[Step], object] | None = None,
                 on_progress: Callable[[Progress], object] | None = None,
                 prefix_cache: PrefixCache | None | bool = True) -> None:
        """use_cache=False recomputes the whole sequence at every step (a fresh cache each time): the same
        tokens as with the cache up to rounding, at the cost of a full forward per token (Compare runs).

        on_token(step) after each token and on_progress(Progress) during the prefill may return STOP to end
        the run. prefix_cache: where the prompt's chat-template opening is shared (engine.prefix_cache): True the
        process's cache, a PrefixCache that one, None computed here and kept nowhere (the opening still its own
        chunk), False no opening rule at all (the prompt prefilled as any other). prompt_or_ids: text (tokenised
        here, as chat / system / allow_special say) or the prompt's token ids as the model sees them (taken as they
        are: a caller that already tokenised, such as the app's checked run, never tokenises twice)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 63:
            raise InputError(f"seed must be a whole number in [0, 2**63), got {seed!r}")
        if params is not None and not isinstance(params, SamplingParams):
            raise InputError(f"params must be a SamplingParams, got {type(params).__name__}")
        self.params = params or SamplingParams()
        self.use_cache = use_cache
        self.stop = [s for s in check_stop(stop) if s]
        self.model, self.probe, self.on_token, self.seed = model, probe, on_token, seed
        self.on_progress = on_progress
        t0 = time.perf_counter()
        self.prompt_ids = prompt_ids(model, prompt_or_ids, chat=chat, system=system, allow_special=allow_special)
        self.timings = {"tokenize": time.perf_counter() - t0, "prefill": 0.0, "decode": 0.0}
        self.max_new_tokens = max_new_tokens
        self.cache = model.new_cache(len(self.prompt_ids) + max_new_tokens)
        # the chat-template opening prefilled as a chunk of its own (0: none); where it is shared
        self.prefix_len = 0 if prefix_cache is False or not use_cache else shared_prefix_len(model, self.prompt_ids)
        shared = shared_prefix_cache() if prefix_cache is True else prefix_cache    # (an empty PrefixCache is falsy)
        self.prefix_cache = None if prefix_cache is False else shared
        self.prefix_copied = False     # the opening's keys and values came from the prefix cache
        self.generator = torch.Generator().manual_seed(seed)
        self.detok = model.tokenizer.stream()
        self.eos = set() if ignore_eos else set(model.tokenizer.eos_ids) | set(model.config.eos_token_ids)
        self.token_ids: list[int] = []
        self.steps: list[Step] = []
        self.batched_steps = 0       # decode steps whose logits came from a forward shared with other runs
        self.packed_prefill = False  # the prefill's came from a packed forward (engine.batch.prefill)
        self.text = ""
        self.stop_reason: str | None = None
        if probe is not None:
            probe.step = 0
            with model.attached(probe, 0):
                probe("tokenizer", torch.tensor(self.prompt_ids))

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def decode_input(self) -> int | None:
        """The one token this run's next step feeds the model when that step is a plain decode step on its cache
        (engine.batch steps several such runs in one forward); None: done, the prefill, or no cache."""
        if self.done or not self.steps or not self.use_cache:
            return None
        return self.token_ids[-1]

    def prefill_input(self) -> list[int] | None:
        """The prompt this run's next step feeds the model when that step is its prefill in one piece on its cache
        (engine.batch packs several such runs into one forward): the positions after the template opening
        (prefix_len; fill_prefix puts the opening into the cache first); None: any other step, or a chunked prompt."""
        if self.done or self.steps or not self.use_cache \
                or len(self.prompt_ids) - self.prefix_len > engine.progress.PREFILL_CHUNK:
            return None
        return self.prompt_ids[self.prefix_len:]

    def fill_prefix(self) -> None:
        """The template opening (prefix_len positions) into the cache, once, before the rest of the prefill: copied
        from the prefix cache, or computed by this run's own forward (and kept there). Stopped: on_progress's STOP."""
        n = self.prefix_len
        if n == 0 or self.cache.get_pos() >= n:
            return
        if self.probe is not None:
            self.probe.step = 0
        if self.prefix_cache is None:
            self._chunk(0, n)
            return
        key = prefix_key(self.model, self.prompt_ids[:n], self.cache, self.probe)
        self.prefix_copied = self.prefix_cache.fill(self.model, key, n, self.cache, None if self.probe is None
                                                    else self.probe.recording, lambda: self._chunk(0, n))
        if self.prefix_copied:          # its chunk's one report: done
            self._tell(Progress(0, n, len(self.prompt_ids), *(self.model.config.num_layers,) * 2))

    def prefill_ask(self, layer: int) -> object:
        """What on_progress answers just before block `layer` of this run's prefill in one piece (== layers: after
        the last), as _prefill asks it; STOP ends the run there (engine.batch asks it for a packed prefill)."""
        if self.on_progress is None:
            return None
        n = len(self.prompt_ids)
        return self.on_progress(Progress(self.prefix_len, n, n, layer, self.model.config.num_layers))

    def step(self, logits: torch.Tensor | None = None, *, seconds: float = 0.0, tell: bool = True) -> Step | None:
        """Run one forward + sample + detokenize. None once the run has stopped (also when this step's logits held a
        NaN or Inf: no token is drawn, the run stops with NONFINITE). logits (V,), seconds: this step's forward done
        elsewhere (engine.batch) and what it took: for decode_input() (the cache advanced, the probe told), or a packed
        prefill's row (its cache advanced) or Stopped (prefill_ask said STOP). tell=False: see tell_token."""
        if self.done:
            return None
        probe, index = self.probe, len(self.steps)
        if probe is not None:
            probe.step = index
        t0 = time.perf_counter() - seconds
        try:
            if logits is None:
                logits = self._forward(index)
            elif isinstance(logits, Stopped):
                raise logits
            else:
                logits, self.batched_steps = logits.float().cpu(), self.batched_steps + (index > 0)
                self.packed_prefill = self.packed_prefill or index == 0
        except Stopped:
            self.stop_reason = STOPPED
            return None
        finally:
            self.timings["prefill" if index == 0 else "decode"] += time.perf_counter() - t0
        t1 = time.perf_counter()
        with one_thread():      # the sampler's small ops (vocabulary-wide vectors): a team's wake-up costs more
            step = self._sample(logits, t0, t1)
        if tell:
            self.tell_token(step)
        return step

    def tell_token(self, step: Step | None) -> None:
        """on_token(step) for what step(tell=False) took (None: no token), in the caller's thread; STOP ends the run."""
        if step is not None and self.on_token and self.on_token(step) is STOP and not self.done:
            self.stop_reason = STOPPED
            self.text += self.detok.flush()

    def _sample(self, logits: torch.Tensor, t0: float, t1: float) -> Step | None:
        """step() after the forward: the sampler chain on this step's logits (V,), the token, its text, the stops."""
        model, probe, index = self.model, self.probe, len(self.steps)
        if not all_finite(logits):
            self._stop_nonfinite()
            return None
        context = self.prompt_ids + self.token_ids
        with model.attached(probe, self.cache.get_pos()):
            stages = sampler_chain(logits, self.params, context, self.token_ids, offer=probe)
        probs = stages["sampler.probs"]
        token = first_max(probs) if self.params.temperature == 0 else draw(probs, self.generator)
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
        return step

    def _forward(self, index: int) -> torch.Tensor:
        """This step's logits (V,) float32 on the CPU: the prefill (in chunks for a long prompt) or one token."""
        model = self.model
        if not self.use_cache:      # the whole sequence again, into a fresh cache of the same size
            self.cache = model.new_cache(self.cache.max_len)
            ids = self.prompt_ids + self.token_ids
        elif index == 0:
            return self._prefill()
        else:
            ids = self.token_ids[-1:]
        return model.forward(torch.tensor(ids), self.cache, self.probe, last_only=True)[0].float().cpu()

    def _prefill(self) -> torch.Tensor:
        """The prompt into the cache by prefill_chunks (the opening by fill_prefix). Only the last chunk computes
        logits (the step's); the others end at the final norm: the probe holds what one forward would have left."""
        self.fill_prefix()
        logits = None
        for a, b in prefill_chunks(self.model, self.prompt_ids, self.prefix_len):
            if a >= self.prefix_len:            # the opening's chunk is fill_prefix's
                logits = self._chunk(a, b)
        return logits[0].float().cpu()

    def _chunk(self, a: int, b: int) -> torch.Tensor:
        """Prompt positions [a, b) through the model into the cache (the last chunk's logits; another ends at the
        final norm), on_progress told before each block and after the chunk."""
        n, layers = len(self.prompt_ids), self.model.config.num_layers
        on_layer = None
        if self.on_progress is not None:          # told just before each block runs
            def on_layer(i: int) -> object:
                return self.on_progress(Progress(a, b, n, i, layers))      # STOP: the forward ends there
        logits = self.model.forward(torch.tensor(self.prompt_ids[a:b]), self.cache, self.probe, last_only=True,
                                    on_layer=on_layer, stop_after=None if b == n else "final_norm")
        self._tell(Progress(a, b, n, layers, layers))
        return logits

    def _tell(self, progress: Progress) -> None:
        if self.on_progress is not None and self.on_progress(progress) is STOP:
            raise Stopped

    def _stop_nonfinite(self) -> None:
        """Logits holding NaN or Inf are no distribution: stop here and draw nothing. Which step and position
        follow from the result (nonfinite_stop), so a saved run keeps them without a field of its own."""
        self.stop_reason = NONFINITE
        self.text += self.detok.flush()

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

    def release_cache(self) -> None:
        """Once the run has ended, give the KV cache's memory back; result() still reports its figures."""
        if self.done and not isinstance(self.cache, ReleasedCache):
            c = self.cache
            self.cache = ReleasedCache(c.bytes_allocated, c.bytes_used, c.bytes_per_token, c.get_pos())

    def result(self) -> GenerationResult:
        n_dec = max(1, len(self.steps) - 1)
        timings = dict(self.timings, per_token_decode=self.timings["decode"] / n_dec)
        c = self.cache
        return GenerationResult(self.prompt_ids, list(self.token_ids), self.text, list(self.steps),
                                self.stop_reason or "running", self.params, self.seed, timings,
                                {"bytes_allocated": c.bytes_allocated, "bytes_used": c.bytes_used,
                                 "bytes_per_token": c.bytes_per_token},
                                None if self.probe is None else self.probe.recording)


def prefill_chunks(model, ids: list[int], opening: int | None = None) -> list[tuple[int, int]]:
    """The pieces [a, b) a run prefills ids in (what repeats its prefill bit for bit follows them): the template
    opening alone (opening: its length; None: the model's, engine.prefix_cache), then engine.progress.PREFILL_CHUNK
    at a time."""
    n, first = len(ids), shared_prefix_len(model, ids) if opening is None else opening
    size = min(engine.progress.PREFILL_CHUNK, n - first)
    return [(0, first)] * (first > 0) + [(a, min(n, a + size)) for a in range(first, n, size)]


def nonfinite_stop(result: GenerationResult) -> dict | None:
    """Where a run stopped on non-finite logits: {step, position, nan, inf}, or None for any other stop.

    The step is the one after the last token drawn and its logits belong to the last position fed (cache on
    or off, the same position). The NaN / Inf counts come from the run's probe when it recorded statistics of
    the "logits" stage (the app's inspected runs, the doctor), else they are None."""
    if result.stop_reason != NONFINITE:
        return None
    step, position = len(result.steps), len(result.all_ids) - 1
    nan = inf = None
    for rec in (result.recording.stat_records("logits") if result.recording is not None else []):
        if rec.step == step and rec.pos0 <= position < rec.pos0 + rec.values.shape[0]:
            row = rec.values[position - rec.pos0]
            nan, inf = int(row[Col.NAN]), int(row[Col.INF])
    return {"step": step, "position": position, "nan": nan, "inf": inf}


def generate(model, prompt_or_ids, **kwargs) -> GenerationResult:
    return GenerationRun(model, prompt_or_ids, **kwargs).run()
