"""Why does this generation loop? Candidate causes, each tested by rerunning the same prompt and seed.

A cause is only listed with the rerun that tests it: the change, the rerun's text, and its verdict
(engine.tools.loop_verdict: loop gone, loop delayed, stopped or loop kept). Four kinds of change are tried,
within one budget of reruns (MAX_RERUNS generations):

    heads     the copy heads: the (layer, head) pairs whose attention from the looping positions puts the
              most mass on the earlier copy (the token one period back); the top k are zeroed at their
              attention output (engine.variants.without_heads: the rows of wo that read them zeroed, the
              same as zeroing them at blocks.{i}.attn.z; every other weight shared, and the native decode
              step kept), k in HEAD_KS, fewest first: the first k that breaks the loop is reported (as for
              the sampler), so "top-4" means the top 2 did not break it; when none breaks it, the first that
              delayed it, else the largest tried
    sampler   one setting at a time (SAMPLER_LADDERS), weakest first; the first rung that breaks the loop
              is reported, so "repetition_penalty 1.0 -> 1.1" means 1.05 did not break it (when none breaks
              it, the first rung that delayed it, else the strongest tried; no_repeat_ngram is not tried: it
              forbids an exact repeat by construction, see SAMPLER_LADDERS)
    numerics  the same run in another dtype (bfloat16 for a float32 model, float32 otherwise)
    prompt    each span of the prompt (a sentence or clause) left out in turn: which one seeded the loop

Which run is diagnosed. The user's own run: the same prompt, seed and settings for its own number of new tokens
(settings.max_new_tokens), so the loop diagnosed is the loop the Repetition page and the doctor show. When that
run holds no loop the report says so plainly and runs nothing more, unless asked to look further (look_further=N:
rerun the same prompt and seed for N tokens, LOOK_FURTHER = 64 by default where offered); then the report's first
line says that it diagnosed a longer rerun, and why.

A loop is engine.inspection.loops' one definition (three full periods, 12 tokens or more, running to the end of
the run). Each rerun runs past the diagnosed run's length, by twice the diagnosed loop's span (loop_verdict.
rerun_horizon; a run loop-free for exactly that length may be a loop on its way), and is judged by
engine.tools.loop_verdict: "loop gone" (no loop and no repeat heading into one, past the run's length), "loop
delayed" (loop-free for the run's length, then a loop, or a periodic tail of two copies or more, in the
continuation), "stopped" (the text ended within the run's length: no fix) or "loop kept". A rerun stops as soon as
its tokens end in a loop (the loop can only be left by tokens it has not made yet, and a loop of three full periods
seldom is), or, within the run's length, as soon as it has fallen back into the diagnosed loop itself: its last 2p
tokens are that loop's own p-token piece twice over, in any rotation (`fell_back`; stopped "loop"). So a rerun that
keeps the loop costs its first few periods, not the horizon; its text_after is the text up to that point. Stop
strings are off for reruns, and faults injected by the NaN doctor are not applied. The baseline (run to the run's
own length, no further) and the sampler reruns share their common forwards (SharedForwards): a sampler rerun
draws the baseline's tokens until its change first picks another one, and those steps, the prefill included, are
answered from the baseline's logits and KV cache rows, not run again.

Causes are ranked by their verdict (loop gone, loop delayed, stopped, loop kept), then by kind (heads, sampler,
numerics, prompt), then in the order tried (the weakest change first). The kinds are tried in that order too, so
when the budget runs out it is the prompt spans that go untried (listed in `skipped`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.generate import GenerationRun
from engine.inspection.loops import Loop, has_loop, tail_loop
from engine.inspection.probe import Probe
from engine.model import Model
from engine.progress import OnProgress, tell_units
from engine.settings import RunSettings
from engine.tools.prompt_spans import prompt_spans
from engine.tools.loop_verdict import OUTCOMES, judge, rerun_horizon
from engine.tools.shared_forwards import SharedForwards
from engine.variants import cast_model, without_heads

HORIZON = LOOK_FURTHER = 64     # how far "look further" reruns a run that holds no loop (tokens)
MAX_RERUNS = 40
HEAD_KS = (1, 2, 4, 8)

KIND_ORDER = ("heads", "sampler", "numerics", "prompt")
# Weakest first; temperature > 0 samples with the seed. no_repeat_ngram is not a rung: banning repeated n-grams
# of n tokens makes every loop of period p <= (its length - n) impossible by the loop's own definition (an exact
# repeat to the end of the run), whatever the model would do, so its rerun could not tell whether a cause is gone
# (a ban of 8-grams leaves "() temper like() temper like temper like()..." and would count as a fix).
SAMPLER_LADDERS: dict[str, tuple[float, ...]] = {
    "repetition_penalty": (1.05, 1.1, 1.2, 1.3, 1.5),
    "frequency_penalty": (0.1, 0.25, 0.5, 1.0),
    "presence_penalty": (0.1, 0.25, 0.5, 1.0),
    "temperature": (0.3, 0.7, 1.0),
}

def fell_back(tokens: Sequence[int], piece: Sequence[int] | None) -> bool:
    """Whether tokens end in the diagnosed loop's p-token piece twice over (in any rotation): the rerun is back in
    that very loop. A shortcut for stopping a rerun early, not a loop by itself (engine.inspection.loops)."""
    p = len(piece or ())
    if p == 0 or len(tokens) < 2 * p:
        return False
    last = list(tokens[-p:])
    if last != list(tokens[-2 * p:-p]):
        return False
    doubled = list(piece) * 2
    return any(doubled[i:i + p] == last for i in range(p))

def loops_in(tokens: Sequence[int]) -> bool:
    """The loop test every rerun is judged by: engine.inspection.loops.has_loop (the one definition)."""
    return has_loop(tokens)

@dataclass
class Cause:
    kind: str            # heads | sampler | numerics | prompt
    change: str          # what the rerun changed, e.g. "zero the top-2 copy heads: L8h1, L12h8"
    outcome: str         # engine.tools.loop_verdict.OUTCOMES: loop gone | loop delayed | stopped | loop kept
    verdict: str         # the outcome in a sentence (loop_verdict.Verdict.words), as the page and the doctor say it
    loop: dict | None    # kept / delayed: the rerun's loop or repeat heading into one (start: a generation step)
    text_after: str      # the rerun's text (up to where its loop showed, when it kept or delayed one)
    tokens: int          # tokens the rerun generated
    stopped: str         # loop (the loop test fired) | eos (the model ended the text) | max_new_tokens | context
    detail: dict = field(default_factory=dict)

    @property
    def loop_gone(self) -> bool:
        return self.outcome == "loop gone"

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "loop_gone": self.loop_gone}

@dataclass
class WhyLoopReport:
    status: str                      # "loop" | "no loop"
    loop: dict | None                # the diagnosed run's loop (engine.inspection.loops.tail_loop)
    horizon: int                     # tokens of the diagnosed run (every rerun is judged past it)
    baseline_text: str
    causes: list[Cause]              # loop-breaking causes first, then by kind (KIND_ORDER), weakest first
    copy_heads: list[dict]           # layer, head, mass (mean attention to the earlier copy), best first
    reruns: int                      # generations run, the baseline included
    max_reruns: int
    skipped: list[str]               # changes not tried because the budget ran out
    run_tokens: int = 0              # tokens of the user's own run (settings.max_new_tokens, or fewer at its end)
    looked_further: bool = False     # the diagnosed run is a longer rerun (the user's run held no loop)
    headline: str = ""               # the report's first line, in words
    rerun_horizon: int = 0           # tokens each rerun may run to (loop_verdict.rerun_horizon)

    def as_dict(self) -> dict:
        return {"headline": self.headline, "status": self.status, "loop": self.loop, "horizon": self.horizon,
                "rerun_horizon": self.rerun_horizon,
                "run_tokens": self.run_tokens, "looked_further": self.looked_further,
                "baseline_text": self.baseline_text, "causes": [c.as_dict() for c in self.causes],
                "copy_heads": self.copy_heads, "reruns": self.reruns, "max_reruns": self.max_reruns,
                "skipped": self.skipped}

class _OutOfReruns(Exception):
    pass

class _Reruns:
    """The budget: every generation goes through here, so the count in the report is the true one."""

    def __init__(self, settings: RunSettings, horizon: int, limit: int, planned: int,
                 on_progress: OnProgress | None):
        self.settings, self.horizon, self.limit = settings, horizon, limit
        self.run_len = horizon            # the diagnosed run's length (fell_back applies within it)
        self.planned, self.on_progress, self.count = max(1, min(planned, limit)), on_progress, 0
        self.last_prompt_ids: list[int] = []
        self.piece: tuple[int, ...] | None = None        # the diagnosed loop's piece, once known (fell_back)

    def check(self, label: str) -> None:
        if self.count >= self.limit:
            raise _OutOfReruns(label)

    def generate(self, model: Model, label: str, *, prompt: str | None = None, params=None,
                 probe: Probe | None = None, early_stop: bool = True) -> tuple[list[int], str, str]:
        """One rerun: the run's settings (or the given prompt / params), `horizon` tokens, stop strings off;
        with early_stop it ends as soon as the loop test fires (or, within run_len, fell_back does). Returns
        (token ids, text, why it stopped: "loop", "eos", "context" or "max_new_tokens")."""
        self.check(label)
        tell_units(self.on_progress, self.count, self.planned, f"rerun {self.count + 1}: {label}")
        self.count += 1
        s = self.settings
        run = GenerationRun(model, s.prompt if prompt is None else prompt, params=params or s.params,
                            max_new_tokens=self.horizon, seed=s.seed, chat=s.chat, system=s.system,
                            allow_special=s.allow_special, ignore_eos=s.ignore_eos, probe=probe)
        while run.step() is not None:
            if early_stop and ((len(run.token_ids) <= self.run_len and fell_back(run.token_ids, self.piece))
                               or loops_in(run.token_ids)):
                break
        self.last_prompt_ids = run.prompt_ids
        if run.done:
            return list(run.token_ids), run.text, run.stop_reason
        return list(run.token_ids), run.text + run.detok.flush(), "loop"

def copy_head_scores(model: Model, ids: Sequence[int], n_prompt: int, loop: Loop) -> torch.Tensor:
    """(layers, heads): mean attention weight from each looping token (from the loop's second repeat on)
    to its earlier copy, one period back. One forward; each layer's pattern is read and dropped."""
    ids = [int(i) for i in ids]
    queries = [n_prompt + i for i in range(loop.start + loop.period, loop.end) if n_prompt + i < len(ids)]
    scores = torch.zeros(model.config.num_layers, model.config.num_heads)
    if not queries:
        return scores
    qi = torch.tensor(queries, dtype=torch.long)

    def grab(x: torch.Tensor, ctx) -> None:                     # x (H, T, S); reads, never replaces
        scores[ctx.layer] = x[:, qi, qi - loop.period].float().mean(-1).cpu()
    probe = Probe().replace("blocks.*.attn.pattern", grab)
    model.forward(torch.tensor(ids), model.new_cache(len(ids)), probe, last_only=True)
    return scores

def _cause(kind: str, change: str, rerun: tuple[list[int], str, str], run_len: int, **detail) -> Cause:
    """The cause with its rerun's verdict (engine.tools.loop_verdict.judge: the one judgement)."""
    tokens, text, stopped = rerun
    v = judge(tokens, stopped, run_len)
    looping = stopped == "loop" or loops_in(tokens)        # "loop": stopped early in a loop (_Reruns.generate)
    return Cause(kind, change, v.outcome, v.words(run_len), None if v.loop is None else v.loop.as_dict(), text,
                 len(tokens), "loop" if looping else stopped, detail)


def _reported(tried: list[Cause]) -> Cause:
    """A ladder's one cause: the rung that broke the loop, else the first that delayed it, else the last tried;
    its detail's `tried` lists every rung run."""
    pick = next((c for c in tried if c.loop_gone), None) or next(
        (c for c in tried if c.outcome == "loop delayed"), tried[-1])
    pick.detail["tried"] = [c.detail["k" if c.kind == "heads" else "value"] for c in tried]
    return pick

# Each _try_* appends to `causes` as its reruns finish, so what ran before the budget ended is still listed.
def _try_heads(model, reruns: _Reruns, top: list[dict], causes: list[Cause]) -> None:
    """The top-k copy heads zeroed, k in HEAD_KS, fewest first until one breaks the loop; one cause (the k that
    broke it, or the largest tried when none did), as for a sampler setting."""
    done: list[Cause] = []
    try:
        for k in HEAD_KS:
            if k > len(top):
                break
            heads = [(h["layer"], h["head"]) for h in top[:k]]
            names = ", ".join(f"L{layer}h{head}" for layer, head in heads)
            reruns.check(f"zero {names}")             # before the variant is made
            rerun = reruns.generate(without_heads(model, heads), f"zero {names}")
            done.append(_cause("heads", f"zero the top-{k} copy head{'s' if k > 1 else ''}: {names}", rerun,
                               reruns.run_len, k=k, heads=[list(h) for h in heads]))
            if done[-1].loop_gone:
                break
    finally:
        if done:
            causes.append(_reported(done))

def _rungs(name: str, now: float) -> list[float]:
    """The ladder's rungs stronger than the run's own value (a smaller n-gram bans more)."""
    ladder = SAMPLER_LADDERS[name]
    if name == "no_repeat_ngram":
        return [v for v in ladder if now == 0 or v < now]
    return [v for v in ladder if v > now]

def _try_sampler(model, reruns: _Reruns, params, causes: list[Cause]) -> None:
    """Per setting, the rungs weakest first until one breaks the loop; one cause per setting (the breaking
    rung, else the first that delayed the loop, else the strongest one tried)."""
    for name in SAMPLER_LADDERS:
        now, done = getattr(params, name), []
        try:
            for v in _rungs(name, now):
                new = dataclasses.replace(params, **{name: int(v) if name == "no_repeat_ngram" else v})
                rerun = reruns.generate(model, f"{name} {v:g}", params=new)
                done.append(_cause("sampler", f"{name} {now:g} -> {v:g}", rerun, reruns.run_len, setting=name,
                                   value=v))
                if done[-1].loop_gone:
                    break
        finally:
            if done:
                causes.append(_reported(done))

def _try_numerics(model, reruns: _Reruns, causes: list[Cause]) -> None:
    now = str(model.dtype).removeprefix("torch.")
    other = "bfloat16" if model.dtype == torch.float32 else "float32"
    reruns.check(f"dtype {other}")                 # before the copy is made
    copy = cast_model(model, other)
    try:
        rerun = reruns.generate(copy, f"dtype {other}")
    finally:
        del copy                                   # one extra model at a time
    causes.append(_cause("numerics", f"dtype {now} -> {other}", rerun, reruns.run_len, dtype=other))

def _try_prompt(model, reruns: _Reruns, prompt: str, causes: list[Cause]) -> None:
    spans = prompt_spans(prompt)
    for n, (a, b) in enumerate(spans if len(spans) > 1 else []):   # leaving out the whole prompt tests nothing
        rest = (prompt[:a] + prompt[b:]).strip()
        if not rest:
            continue
        label = f"prompt without span {n + 1}/{len(spans)} {prompt[a:b].strip()!r}"
        rerun = reruns.generate(model, label, prompt=rest)
        causes.append(_cause("prompt", label, rerun, reruns.run_len, span=[a, b], prompt_after=rest))

def _planned(prompt: str) -> int:
    """Reruns at most (for the progress bar): baseline, heads, every sampler rung, dtype, prompt spans."""
    sampler = sum(len(v) for v in SAMPLER_LADDERS.values())
    return 1 + len(HEAD_KS) + sampler + 1 + len(prompt_spans(prompt))

def _loop_words(lp: Loop) -> str:
    return f"from step {lp.start} with period {lp.period} (×{lp.count})"

def _headline(run_tokens: int, run_stop: str, horizon: int, looked_further: bool, loop: Loop | None,
              causes: list[Cause], look_further: int | None) -> str:
    """The report's first line: which run was diagnosed, and what came of it."""
    ended = "" if run_stop in ("max_new_tokens", "loop") else f" (it ended: {run_stop})"
    own = f"Your run's {run_tokens} generated token{'s' if run_tokens != 1 else ''}{ended}"
    if loop is None and not looked_further:
        further = ("" if look_further else f" To look further, rerun the same prompt and seed for up to "
                   f"{LOOK_FURTHER} tokens and diagnose any loop there.")
        return f"{own} hold no loop: there is nothing to diagnose.{further}"
    if loop is None:
        return (f"{own} hold no loop, and neither does a longer rerun of the same prompt and seed "
                f"({horizon} tokens asked): there is nothing to diagnose.")
    gone = sum(c.loop_gone for c in causes)
    delayed = sum(c.outcome == "loop delayed" for c in causes)
    stopped = sum(c.outcome == "stopped" for c in causes)
    tail = (f" {gone} of {len(causes)} changes break it"
            + (f"; {delayed} more only delay{'s' if delayed == 1 else ''} it (the loop comes back after the run's "
               f"{horizon} tokens)"
               if delayed else "")
            + (f"; {stopped} more only stopped the text early" if stopped else "") + ".") if causes else ""
    if looked_further:
        return (f"{own} hold no loop, so this diagnoses a longer rerun of the same prompt and seed ({horizon} "
                f"tokens), which loops {_loop_words(loop)}.{tail}")
    return f"{own} end in a loop {_loop_words(loop)}: the loop diagnosed here.{tail}"

def why_loop(model: Model, settings: RunSettings, *, look_further: int | None = None, max_reruns: int = MAX_RERUNS,
             top_heads: int = max(HEAD_KS), on_progress: OnProgress | None = None) -> WhyLoopReport:
    """Rerun the user's run (settings' prompt, seed and max_new_tokens) and, if it ends in a loop, test the
    candidate causes (see the module docstring), at most max_reruns generations in all. A run without a loop is
    reported as "no loop" after that one rerun, unless look_further=N (> max_new_tokens): then the same prompt
    and seed are rerun for N tokens and a loop there is diagnosed, the headline saying so.
    on_progress (engine.progress) hears each rerun before it runs and the end (done == total == reruns); a
    STOP answer raises engine.progress.Stopped before the next rerun."""
    run_len = settings.max_new_tokens
    if look_further is not None and look_further <= run_len:
        look_further = None                      # the run itself already reaches that far
    reruns = _Reruns(settings, run_len, max_reruns, _planned(settings.prompt) + (look_further is not None),
                     on_progress)
    shared = SharedForwards(model)      # the baseline's forwards, answered again to the sampler reruns
    # The baseline runs to the horizon (no early stop): the copy heads are read from the loop's repeats.
    base_ids, base_text, base_stop = reruns.generate(shared, "your run", early_stop=False)
    run_tokens, run_stop, looked_further = len(base_ids), base_stop, False
    if not loops_in(base_ids) and look_further is not None and base_stop == "max_new_tokens":
        reruns.horizon, looked_further = look_further, True          # its first run_len forwards are shared
        base_ids, base_text, base_stop = reruns.generate(shared, f"a longer rerun ({look_further} tokens)",
                                                         early_stop=False)
    horizon = reruns.horizon
    base_loop = tail_loop(base_ids)
    if base_loop is None:
        tell_units(on_progress, reruns.count, reruns.count, "no loop")
        return WhyLoopReport("no loop", None, horizon, base_text, [], [], reruns.count, max_reruns, [], run_tokens,
                             looked_further, _headline(run_tokens, run_stop, horizon, looked_further, None, [],
                                                       look_further))
    reruns.piece = tuple(base_ids[base_loop.start:base_loop.start + base_loop.period])
    reruns.run_len, reruns.horizon = horizon, rerun_horizon(horizon, base_loop)   # each rerun runs past the run
    n_prompt = len(reruns.last_prompt_ids)
    scores = copy_head_scores(model, reruns.last_prompt_ids + base_ids, n_prompt, base_loop)
    H = scores.shape[1]
    order = scores.flatten().argsort(descending=True, stable=True)[:top_heads].tolist()
    top = [{"layer": i // H, "head": i % H, "mass": round(float(scores.flatten()[i]), 6)} for i in order]
    causes, skipped = [], []
    for kind, attempt in (("heads", lambda: _try_heads(model, reruns, top, causes)),
                          ("sampler", lambda: _try_sampler(shared, reruns, settings.params, causes)),
                          ("numerics", lambda: _try_numerics(model, reruns, causes)),
                          ("prompt", lambda: _try_prompt(model, reruns, settings.prompt, causes))):
        try:
            attempt()
        except _OutOfReruns as e:
            skipped.append(f"{kind}: {e} and what follows it (the budget of {max_reruns} reruns is spent)")
    causes.sort(key=lambda c: (OUTCOMES.index(c.outcome), KIND_ORDER.index(c.kind)))   # stable: weakest first kept
    tell_units(on_progress, reruns.count, reruns.count, f"done: {reruns.count} reruns")
    return WhyLoopReport("loop", base_loop.as_dict(), horizon, base_text, causes, top, reruns.count, max_reruns,
                         skipped, run_tokens, looked_further,
                         _headline(run_tokens, run_stop, horizon, looked_further, base_loop, causes, look_further),
                         reruns.horizon)
