"""fp32 rescue: the smallest set of units that must run in fp32 for a float16 / bfloat16 run to be finite
and agree with fp32.

The run: the fp32 model generates from the prompt (with the same faults, if any: the fault is the
experiment, the precision is the question), then every candidate plan reads those same tokens in one
teacher-forced forward. A plan passes when no stage holds a NaN/Inf (the NaN doctor's criterion; a
forward stops at the first non-finite stage, so a failing plan costs only the layers up to it) and its
top-1 token agrees with fp32's at >= AGREEMENT of the run's generated positions.

Units (engine.model.Model.with_fp32): blocks.{i}.attn, blocks.{i}.mlp, blocks.{i}.resid (the residual
stream in fp32 from layer i on), final_norm, logits. Search, assuming more fp32 never hurts:

1. the plan with no unit (the trigger: non-finite, top-1 disagreement, or logits' relative error above
   the threshold) and the plan with every unit (if that fails, no set can rescue the run);
2. bisection over prefixes of the unit list for the smallest prefix that passes: its last unit is needed
   (the prefix one shorter failed); it joins the set, the units after it are dropped, and the set alone
   is tried; while it fails, bisect again over the remaining prefix. A set found this way is minimal:
   leaving out any one of its units fails. The list starts with the resid units, latest layer first, so a
   prefix keeps the stream in fp32 from as late a layer as it can;
3. an attn / mlp culprit computes in fp32 but hands its output back in the stream's dtype, which can
   overflow there; so when the set fails, the culprit's own layer's resid is tried once before bisecting;
4. the set, verified (the last rerun of the search), and its complement: every other unit, less the
   resid units of layers <= any resid layer in the set (those would keep that stream in fp32 anyway).

One culprit costs ceil(log2 units) + 5 reruns at most: none, every unit, the bisection, the set, the
companion resid, the complement.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .doctor import Injection
from .errors import InputError
from .generate import GenerationRun
from .model import Model
from .probe import HookContext, Probe
from .settings import RunSettings

AGREEMENT = 0.99
LOGIT_THRESHOLD = 0.05        # ||low - fp32|| / ||fp32|| of the logits over the run's positions
MAX_NEW_TOKENS = 8            # float16 matmuls on a CPU are slow: each rerun reads prompt + these tokens
UNWATCHED = ("attn.scores", "attn.pattern")   # -inf masks are not faults; hooking them forces slow attention
Progress = Callable[[float, str], None]


def precision_units(num_layers: int) -> list[str]:
    """The search order: resid units from the last layer down, then attn and mlp in forward order, then
    final_norm and logits."""
    return ([f"blocks.{i}.resid" for i in reversed(range(num_layers))]
            + [f"blocks.{i}.{part}" for i in range(num_layers) for part in ("attn", "mlp")]
            + ["final_norm", "logits"])


def unit_layer(unit: str) -> int | None:
    parts = unit.split(".")
    return int(parts[1]) if parts[0] == "blocks" else None


def forward_order(units) -> list[str]:
    """Units sorted as the forward meets them (layer, then attn, mlp, resid; final_norm, logits last)."""
    rank = {"attn": 0, "mlp": 1, "resid": 2}

    def key(u: str):
        layer = unit_layer(u)
        return (1, 0 if u == "final_norm" else 1) if layer is None else (0, layer, rank[u.split(".")[2]])
    return sorted(units, key=key)


def complement(units: list[str], chosen: list[str]) -> list[str]:
    """Every unit not chosen, less the resid units that would cover a chosen resid unit's layer."""
    top = max((unit_layer(u) for u in chosen if u.endswith(".resid")), default=-1)
    return [u for u in units if u not in chosen and not (u.endswith(".resid") and unit_layer(u) <= top)]


@dataclass
class Trial:
    units: list[str]
    label: str
    finite: bool
    first_nonfinite: str | None       # the first stage holding a NaN/Inf (None when finite)
    top1_agreement: float             # over the run's generated positions (0 when not finite)
    logit_rel_err: float | None

    def passes(self, agreement: float = AGREEMENT) -> bool:
        return self.finite and self.top1_agreement >= agreement

    def as_dict(self) -> dict:
        return {"label": self.label, "units": len(self.units), "finite": self.finite,
                "first_nonfinite": self.first_nonfinite, "top1_agreement": self.top1_agreement,
                "logit_rel_err": self.logit_rel_err}


@dataclass
class RescueReport:
    dtype: str
    injections: list[str]
    positions: int                    # prompt + generated tokens read by every rerun
    tokens: int                       # generated tokens whose top-1 is compared
    trigger: list[str]                # why the run needs rescuing: nonfinite, top1, logit_error (empty: it does not)
    fp32: list[str] | None            # the set (forward order); [] when none is needed; None when none works
    verified: bool                    # the set alone was rerun and passed
    finite: bool                      # ... that rerun's result
    top1_agreement: float
    complement: dict | None           # units, finite, top1_agreement, fixes (should be False)
    reruns: int
    bound: int                        # ceil(log2 units) + 5: the most one culprit may cost
    trials: list[Trial] = field(default_factory=list)
    note: str = ""

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["trials"] = [t.as_dict() for t in self.trials]
        return d


class _NonFinite(Exception):
    def __init__(self, stage: str) -> None:
        super().__init__(stage)
        self.stage = stage


def _watch(x: torch.Tensor, ctx: HookContext) -> None:
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        raise _NonFinite(ctx.name)          # ends the forward: the rest could only say the same


def fault_only_probe(model: Model, injections, norm_eps: float | None, *, watch: bool = False) -> Probe:
    """The faults (and the run-only epsilon) without statistics; with watch, a forward raises at the first
    non-finite stage."""
    probe = Probe()
    for inj in injections:
        (Injection.parse(inj) if isinstance(inj, str) else inj).apply(probe, model)
    probe.norm_eps = norm_eps
    if watch:
        names = [n for n in model.hook_names() if n not in ("tokenizer", "detokenizer")
                 and not n.startswith("sampler.") and not n.endswith(UNWATCHED)]
        probe.replace(names, _watch)
    return probe


class _Search:
    """Runs and records the trials; every rerun goes through `test`, so the count is the true one."""

    def __init__(self, ref: Model, low: Model, ids: list[int], n_prompt: int, injections, norm_eps,
                 bound: int, progress: Progress | None) -> None:
        self.ref, self.low, self.ids, self.injections, self.norm_eps = ref, low, ids, injections, norm_eps
        self.rows = slice(n_prompt - 1, len(ids) - 1)       # logits rows that chose the generated tokens
        self.ref_nonfinite: str | None = None      # judged as every plan is: every stage, every position
        try:
            ref_logits = ref.logits(ids, fault_only_probe(ref, injections, norm_eps, watch=True))[self.rows]
        except _NonFinite as e:
            self.ref_nonfinite, ref_logits = e.stage, torch.zeros(0, 1)
        self.ref_top, self.ref_logits = ref_logits.argmax(-1), ref_logits
        self.bound, self.progress, self.trials = bound, progress, []

    def test(self, units: list[str], label: str) -> Trial:
        if self.progress:
            self.progress(min(len(self.trials) / self.bound, 1.0), f"rerun {len(self.trials) + 1}: {label}")
        plan = self.low.with_fp32(units, source=self.ref) if units else self.low
        probe = fault_only_probe(plan, self.injections, self.norm_eps, watch=True)
        try:
            logits = plan.logits(self.ids, probe)[self.rows]
        except _NonFinite as e:
            trial = Trial(list(units), label, False, e.stage, 0.0, None)
        else:
            finite = bool(torch.isfinite(logits).all())
            agree = float((logits.argmax(-1) == self.ref_top).float().mean()) if finite else 0.0
            err = float((logits - self.ref_logits).norm() / self.ref_logits.norm().clamp(min=1e-30))
            trial = Trial(list(units), label, finite, None if finite else "logits", agree,
                          err if math.isfinite(err) else None)
        self.trials.append(trial)
        return trial


def _bisect(search: _Search, chosen: list[str], pool: list[str], agreement: float) -> int:
    """The smallest k with chosen + pool[:k] passing, knowing k = 0 fails and k = len(pool) passes."""
    lo, hi = 0, len(pool)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if search.test(chosen + pool[:mid], f"{len(chosen)} chosen + first {mid} of {len(pool)}").passes(agreement):
            hi = mid
        else:
            lo = mid
    return hi


def _minimal_set(search: _Search, units: list[str], agreement: float) -> tuple[list[str], Trial | None]:
    """Steps 2 and 3 of the module docstring. Returns the set and the rerun that verified it."""
    chosen, pool = [], list(units)
    while pool:
        k = _bisect(search, chosen, pool, agreement)
        culprit, pool = pool[k - 1], pool[:k - 1]
        chosen.append(culprit)
        t = search.test(chosen, "the set so far")
        if t.passes(agreement):
            return chosen, t
        companion = f"blocks.{unit_layer(culprit)}.resid"
        if not culprit.endswith(".resid") and companion in pool:
            t = search.test(chosen + [companion], f"the set + {companion}")
            if t.passes(agreement):
                return chosen + [companion], t
    return chosen, None                     # not monotone after all: no set found


def find_rescue(ref: Model, low: Model, settings: RunSettings, *, injections=(), norm_eps: float | None = None,
                max_new_tokens: int | None = None, agreement: float = AGREEMENT,
                logit_threshold: float = LOGIT_THRESHOLD, on_progress: Progress | None = None) -> RescueReport:
    """ref: the fp32 model; low: the same weights in float16 / bfloat16 (engine.doctor.cast_model). The run
    is settings' prompt and sampling with min(settings.max_new_tokens, MAX_NEW_TOKENS) new tokens."""
    specs = [i if isinstance(i, str) else i.spec for i in injections]
    n_new = max_new_tokens or min(settings.max_new_tokens, MAX_NEW_TOKENS)
    try:        # EOS does not end the reference: every rerun reads the same number of positions
        run = GenerationRun(ref, settings.prompt, params=settings.params, max_new_tokens=n_new, seed=settings.seed,
                            chat=settings.chat, system=settings.system, allow_special=settings.allow_special,
                            ignore_eos=True, probe=fault_only_probe(ref, specs, norm_eps)).run()
    except InputError as e:
        if "not a valid distribution" not in str(e):
            raise
        raise InputError(f"the fp32 run with these faults samples from NaN/Inf logits ({e}); no precision plan "
                         "can fix that") from None
    units = precision_units(low.config.num_layers)
    search = _Search(ref, low, run.all_ids, len(run.prompt_ids), specs, norm_eps,
                     math.ceil(math.log2(len(units))) + 5, on_progress)
    report = RescueReport(str(low.dtype).removeprefix("torch."), specs, len(run.all_ids), len(run.token_ids),
                          [], None, False, False, 0.0, None, 0, search.bound)
    if search.ref_nonfinite:
        return _finish(report, search, note=f"the fp32 run itself is not finite (first at {search.ref_nonfinite}): "
                                            "no precision plan can fix it")
    base = search.test([], "no unit in fp32")
    report.trigger = [why for why, hit in (("nonfinite", not base.finite), ("top1", base.top1_agreement < agreement),
                                           ("logit_error", base.finite and (base.logit_rel_err or 0) > logit_threshold))
                      if hit]
    if base.passes(agreement):
        report.fp32, report.verified, report.finite, report.top1_agreement = [], True, True, base.top1_agreement
        return _finish(report, search, note="finite and agreeing with fp32 as it is: no unit needs fp32")
    if not search.test(units, "every unit in fp32").passes(agreement):
        return _finish(report, search, note="even every unit in fp32 fails (the embedding and the KV cache stay "
                                            "in the low dtype): no set rescues this run")
    chosen, verified = _minimal_set(search, units, agreement)
    if verified is None:
        return _finish(report, search, note="the search found no passing set (more fp32 did not always help)")
    report.fp32, report.verified = forward_order(chosen), True
    report.finite, report.top1_agreement = verified.finite, verified.top1_agreement
    rest = complement(units, chosen)
    c = search.test(rest, "the complement")
    report.complement = {"units": len(rest), "finite": c.finite, "first_nonfinite": c.first_nonfinite,
                         "top1_agreement": c.top1_agreement, "fixes": c.passes(agreement)}
    return _finish(report, search)


def _finish(report: RescueReport, search: _Search, note: str = "") -> RescueReport:
    report.trials, report.reruns, report.note = list(search.trials), len(search.trials), note
    if search.progress:
        search.progress(1.0, f"done: {report.reruns} reruns")
    return report
