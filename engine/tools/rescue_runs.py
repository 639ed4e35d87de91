"""The reruns of the fp32 rescue (engine.tools.rescue): the fp32 reference run and a plan judged against it.

The run: the fp32 model generates from the prompt (with the same faults, if any: the fault is the
experiment, the precision is the question). Every rerun, the fp32 reference's and each plan's, then
computes that run's logits as generation computes them (engine.generate.GenerationRun): the prompt
prefilled into a KV cache, then one token at a time, fed the fp32 run's tokens (`replay`). That is the
computation of the check the page and the CLI print (`python -m engine doctor ... --fp32 SET --verify`,
which calls `check_plan`), so the search's verdict and the check's are the same numbers; a one-forward
teacher-forced read of all positions rounds differently and could flip a near tie the check then reports.

A plan passes when no stage holds a NaN/Inf (the NaN doctor's criterion; a rerun stops at the first
non-finite stage, so a failing plan costs only what ran up to it) and its top-1 token agrees with fp32's at
>= AGREEMENT of the steps that are not ties. A tie: the plan's top-1 differs from fp32's, but fp32 scores
the plan's token within TIE_ULPS spacings of the low dtype (at the size of fp32's top logit) of its own
best. Below that margin rounding alone can swap the two, so a tie is reported (`ties`, and every step where
fp32's top two are that close: `near_ties`) and never counts against a plan: no unit joins the set for it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.errors import InputError
from engine.generate import GenerationRun, prefill_chunks
from engine.inspection.interventions import HookContext
from engine.inspection.probe import Probe
from engine.inspection.stages import forward_stages
from engine.model import Model
from engine.settings import RunSettings
from engine.tools.doctor import Injection

AGREEMENT = 0.99
MAX_NEW_TOKENS = 8            # float16 matmuls on a CPU are slow: each rerun runs prompt + these tokens
# A tie margin of 4 spacings of the low dtype at the top logit's size (float16, logits of 16-32: 4 x 2^-6 =
# 0.0625; bfloat16: 0.5). On the bundled model, 64 steps over 4 prompts, a float16 run moved fp32's top-2 gap
# by at most 2.8 such spacings (0.044 logits) and a bfloat16 run by at most 3.4 (0.42).
TIE_ULPS = 4


def tie_margin(top_logit: float, dtype: torch.dtype) -> float:
    """TIE_ULPS spacings of dtype's numbers at |top_logit| (the gap under which rounding can swap two logits)."""
    info = torch.finfo(dtype)
    size = max(abs(float(top_logit)), float(info.tiny))
    return TIE_ULPS * float(info.eps) * 2.0 ** math.floor(math.log2(size))


@dataclass
class Trial:
    units: list[str]
    label: str
    finite: bool
    first_nonfinite: str | None       # the first stage holding a NaN/Inf (None when finite)
    top1_agreement: float             # over the steps that are not ties (0 when not finite)
    logit_rel_err: float | None
    ties: list[int] = field(default_factory=list)           # steps whose different top-1 is within the margin
    disagreements: list[int] = field(default_factory=list)  # steps whose different top-1 is not

    def passes(self, agreement: float = AGREEMENT) -> bool:
        return self.finite and self.top1_agreement >= agreement

    def as_dict(self) -> dict:
        return {"label": self.label, "units": len(self.units), "finite": self.finite,
                "first_nonfinite": self.first_nonfinite, "top1_agreement": self.top1_agreement,
                "logit_rel_err": self.logit_rel_err, "ties": self.ties, "disagreements": self.disagreements}


class Watch:
    """A hook that reads every stage and remembers the first one holding a NaN or Inf (it never replaces or
    raises: a rerun checks `stage` after each forward and goes no further once it is set)."""

    def __init__(self) -> None:
        self.stage: str | None = None

    def __call__(self, x: torch.Tensor, ctx: HookContext) -> None:
        # one reduction instead of isfinite + all: a float64 sum of float32 or narrower values cannot overflow,
        # and a NaN or an Inf anywhere makes it NaN or Inf, so it is finite exactly when every value is
        if self.stage is None and x.is_floating_point() and not bool(torch.isfinite(x.sum(dtype=torch.float64))):
            self.stage = ctx.name


def fault_only_probe(model: Model, injections, norm_eps: float | None, *, watch: Watch | None = None) -> Probe:
    """The faults (and the run-only epsilon) without statistics; with a Watch, every watched stage is read by
    it."""
    probe = Probe()
    for inj in injections:
        (Injection.parse(inj) if isinstance(inj, str) else inj).apply(probe, model)
    probe.norm_eps = norm_eps
    if watch:
        probe.replace(forward_stages(model.config, maps=False), watch)   # the maps' -inf masks are no fault
    return probe


def replay(model: Model, prompt_ids: list[int], fed: list[int], probe: Probe | None = None,
           watch: Watch | None = None) -> torch.Tensor | None:
    """Logits (1 + len(fed), V), float32 on the CPU, as a generation computes them: the prompt prefilled into
    a KV cache in a run's chunks (engine.generate.prefill_chunks, last row kept), then each token of fed, one at a
    time. None as soon as the watch (reading the probe's stages) has seen a NaN or Inf: the rest could only say the
    same."""
    cache = model.new_cache(len(prompt_ids) + len(fed))
    for a, b in prefill_chunks(model, prompt_ids):
        last = model.forward(torch.tensor(prompt_ids[a:b]), cache, probe, last_only=True)
        if watch is not None and watch.stage is not None:
            return None
    rows = [last[0].float().cpu()]
    for t in fed:
        rows.append(model.forward(torch.tensor([t]), cache, probe, last_only=True)[0].float().cpu())
        if watch is not None and watch.stage is not None:
            return None
    return torch.stack(rows)


@dataclass
class Reference:
    """The fp32 run every plan is judged against; logits is None when the fp32 run itself is not finite."""
    prompt_ids: list[int]
    tokens: list[int]
    injections: list[str]
    norm_eps: float | None
    logits: torch.Tensor | None       # (len(tokens), V): the logits each generated token was chosen from
    margins: list[float]              # tie margin per step (tie_margin of the low dtype at fp32's top logit)
    nonfinite: str | None = None      # the first non-finite stage of the fp32 run

    @property
    def fed(self) -> list[int]:
        return self.tokens[:-1]

    @property
    def near_ties(self) -> list[dict]:
        """Steps where fp32's top two logits are within the margin: a different top-1 there is a tie."""
        if self.logits is None or self.logits.shape[-1] < 2:
            return []
        top2 = self.logits.topk(2, dim=-1).values
        return [{"step": i, "gap": float(g), "margin": m} for i, (g, m) in
                enumerate(zip((top2[:, 0] - top2[:, 1]).tolist(), self.margins)) if g < m]


def fp32_reference(ref: Model, low_dtype: torch.dtype, settings: RunSettings, n_new: int, *, injections=(),
                   norm_eps: float | None = None) -> Reference:
    """The fp32 model generates n_new tokens (EOS does not end it: every rerun reads the same steps) with the
    faults, watched as every plan's rerun is; its logits are the run's own, kept as it goes: the same forwards
    (prefill, then one token at a time) that `replay` runs for a plan, so the run is not computed twice."""
    specs = [i if isinstance(i, str) else i.spec for i in injections]
    watch = Watch()
    probe = fault_only_probe(ref, specs, norm_eps, watch=watch).capture("logits")
    run = GenerationRun(ref, settings.prompt, params=settings.params, max_new_tokens=n_new, seed=settings.seed,
                        chat=settings.chat, system=settings.system, allow_special=settings.allow_special,
                        ignore_eos=True, probe=probe)
    out = Reference(run.prompt_ids, run.token_ids, specs, norm_eps, None, [])
    try:
        while run.step() is not None and watch.stage is None:
            pass
    except InputError as e:
        if "not a valid distribution" not in str(e):
            raise
        raise InputError(f"the fp32 run with these faults samples from NaN/Inf logits ({e}); no precision plan "
                         "can fix that") from None
    if watch.stage is not None:
        out.nonfinite = watch.stage
        return out
    logits = torch.cat([c.value.reshape(1, -1) for c in probe.recording.captures if c.name == "logits"]).float().cpu()
    out.logits, out.margins = logits, [tie_margin(x, low_dtype) for x in logits.max(-1).values.tolist()]
    return out


def judge(reference: Reference, plan: Model, label: str = "") -> Trial:
    """One rerun: the plan (a float16 / bfloat16 model, perhaps with fp32 units) replays the reference's run
    with its faults; finite, top-1 agreement outside ties, the ties and the logits' relative error."""
    watch = Watch()
    probe = fault_only_probe(plan, reference.injections, reference.norm_eps, watch=watch)
    units = list(plan.fp32_units)
    logits = replay(plan, reference.prompt_ids, reference.fed, probe, watch)
    if logits is None:
        return Trial(units, label, False, watch.stage, 0.0, None)
    ref_logits = reference.logits
    if not bool(torch.isfinite(logits).all()):
        return Trial(units, label, False, "logits", 0.0, None)
    mine, best = logits.argmax(-1), ref_logits.argmax(-1)
    rows = torch.arange(len(mine))
    behind = (ref_logits[rows, best] - ref_logits[rows, mine]).tolist()   # fp32's own preference, >= 0
    differ = [i for i in range(len(mine)) if mine[i] != best[i]]
    ties = [i for i in differ if behind[i] < reference.margins[i]]
    disagree = [i for i in differ if behind[i] >= reference.margins[i]]
    judged = len(mine) - len(ties)
    agree = (judged - len(disagree)) / judged if judged else 1.0
    err = float((logits - ref_logits).norm() / ref_logits.norm().clamp(min=1e-30))
    return Trial(units, label, True, None, agree, err if math.isfinite(err) else None, ties, disagree)


def check_plan(ref: Model, plan: Model, settings: RunSettings, *, injections=(), norm_eps: float | None = None,
               max_new_tokens: int | None = None) -> tuple[Reference, Trial]:
    """The check the rescue prints: the fp32 run of settings (min(settings.max_new_tokens, MAX_NEW_TOKENS) new
    tokens unless given) and the plan judged against it, exactly as the search judges each of its reruns."""
    n_new = max_new_tokens or min(settings.max_new_tokens, MAX_NEW_TOKENS)
    reference = fp32_reference(ref, plan.dtype, settings, n_new, injections=injections, norm_eps=norm_eps)
    if reference.nonfinite:
        raise InputError(f"the fp32 run itself is not finite (first at {reference.nonfinite}): no precision plan "
                         "can be checked against it")
    return reference, judge(reference, plan, "the plan")
