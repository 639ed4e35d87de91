"""fp32 rescue: the smallest set of units that must run in fp32 for a float16 / bfloat16 run to be finite
and agree with fp32.

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

Units (engine.variants.precision_plan): blocks.{i}.attn, blocks.{i}.mlp, blocks.{i}.resid (the residual
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
companion resid, the complement. Progress counts reruns against a total that is the reruns done plus the
most the round under way can still take; another culprit adds a round, and at the end the total is the
reruns done.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from engine.errors import InputError
from engine.generate import PREFILL_CHUNK, GenerationRun
from engine.inspection.probe import HookContext, Probe
from engine.model import Model
from engine.progress import OnProgress, tell_units
from engine.settings import RunSettings
from engine.tools.doctor import Injection
from engine.variants import precision_plan

AGREEMENT = 0.99
LOGIT_THRESHOLD = 0.05        # ||low - fp32|| / ||fp32|| of the logits over the run's steps
MAX_NEW_TOKENS = 8            # float16 matmuls on a CPU are slow: each rerun runs prompt + these tokens
# A tie margin of 4 spacings of the low dtype at the top logit's size (float16, logits of 16-32: 4 x 2^-6 =
# 0.0625; bfloat16: 0.5). On the bundled model, 64 steps over 4 prompts, a float16 run moved fp32's top-2 gap
# by at most 2.8 such spacings (0.044 logits) and a bfloat16 run by at most 3.4 (0.42).
TIE_ULPS = 4
UNWATCHED = ("attn.scores", "attn.pattern")   # -inf masks are not faults; hooking them forces slow attention


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


@dataclass
class RescueReport:
    dtype: str
    injections: list[str]
    positions: int                    # positions every rerun puts through the model (prompt + tokens fed)
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
    norm_eps: float | None = None     # the run-only RMSNorm epsilon of the faults (None: the model's)
    tie_ulps: int = TIE_ULPS
    near_ties: list[dict] = field(default_factory=list)   # {step, gap, margin}: fp32's top two within the margin
    ties: list[int] = field(default_factory=list)         # steps where the verified plan's top-1 was a tie

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["trials"] = [t.as_dict() for t in self.trials]
        return d


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
        names = [n for n in model.hook_names() if n not in ("tokenizer", "detokenizer")
                 and not n.startswith("sampler.") and not n.endswith(UNWATCHED)]
        probe.replace(names, watch)
    return probe


def replay(model: Model, prompt_ids: list[int], fed: list[int], probe: Probe | None = None,
           watch: Watch | None = None) -> torch.Tensor | None:
    """Logits (1 + len(fed), V), float32 on the CPU, as a generation computes them: the prompt prefilled into
    a KV cache (PREFILL_CHUNK positions at a time, last row kept), then each token of fed, one at a time. None
    as soon as the watch (reading the probe's stages) has seen a NaN or Inf: the rest could only say the same."""
    cache = model.new_cache(len(prompt_ids) + len(fed))
    size = min(len(prompt_ids), PREFILL_CHUNK)
    for a in range(0, len(prompt_ids), size):
        last = model.forward(torch.tensor(prompt_ids[a:a + size]), cache, probe, last_only=True)
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
    logits = torch.cat([c.value.reshape(1, -1) for c in probe.captures if c.name == "logits"]).float().cpu()
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


class _Search:
    """Runs and records the trials; every rerun goes through `test`, so the count is the true one. `ahead` is
    the most reruns the round under way can still take (set by the search as it goes), so the progress total
    (done + ahead) is an upper bound until another culprit starts a round, and equals the reruns at the end."""

    def __init__(self, reference: Reference, ref: Model, low: Model, ahead: int,
                 on_progress: OnProgress | None) -> None:
        self.reference, self.ref, self.low = reference, ref, low
        self.ahead, self.on_progress, self.trials = ahead, on_progress, []

    def test(self, units: list[str], label: str) -> Trial:
        done = len(self.trials)
        total = done + max(self.ahead, 1)
        tell_units(self.on_progress, done, total, f"rerun {done + 1} of {total}: {label}")
        plan = precision_plan(self.low, units, source=self.ref) if units else self.low
        trial = judge(self.reference, plan, label)
        self.trials.append(trial)
        self.ahead = max(self.ahead - 1, 0)
        return trial


def _steps(n: int) -> int:
    """Bisection tests for a range of n candidates: ceil(log2 n)."""
    return math.ceil(math.log2(n)) if n > 1 else 0


def _bisect(search: _Search, chosen: list[str], pool: list[str], agreement: float, after: int) -> int:
    """The smallest k with chosen + pool[:k] passing, knowing k = 0 fails and k = len(pool) passes; after:
    the most reruns the round takes once the bisection is done."""
    lo, hi = 0, len(pool)
    while hi - lo > 1:
        search.ahead = _steps(hi - lo) + after
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
        k = _bisect(search, chosen, pool, agreement, after=3)        # the set, its companion, the complement
        culprit, pool = pool[k - 1], pool[:k - 1]
        chosen.append(culprit)
        companion = f"blocks.{unit_layer(culprit)}.resid"
        paired = not culprit.endswith(".resid") and companion in pool
        search.ahead = 3 if paired else 2
        t = search.test(chosen, "the set so far")
        if t.passes(agreement):
            search.ahead = 1
            return chosen, t
        if paired:
            t = search.test(chosen + [companion], f"the set + {companion}")
            if t.passes(agreement):
                search.ahead = 1
                return chosen + [companion], t
    search.ahead = 0
    return chosen, None                     # not monotone after all: no set found


def find_rescue(ref: Model, low: Model, settings: RunSettings, *, injections=(), norm_eps: float | None = None,
                max_new_tokens: int | None = None, agreement: float = AGREEMENT,
                logit_threshold: float = LOGIT_THRESHOLD, on_progress: OnProgress | None = None) -> RescueReport:
    """ref: the fp32 model; low: the same weights in float16 / bfloat16 (engine.variants.cast_model). The run
    is settings' prompt and sampling with min(settings.max_new_tokens, MAX_NEW_TOKENS) new tokens. on_progress
    (engine.progress) hears each rerun before it runs and the end (done == total == reruns); a STOP answer
    raises engine.progress.Stopped before the next rerun."""
    specs = [i if isinstance(i, str) else i.spec for i in injections]
    n_new = max_new_tokens or min(settings.max_new_tokens, MAX_NEW_TOKENS)
    units = precision_units(low.config.num_layers)
    bound = _steps(len(units)) + 5
    reference = fp32_reference(ref, low.dtype, settings, n_new, injections=specs, norm_eps=norm_eps)
    search = _Search(reference, ref, low, bound, on_progress)
    report = RescueReport(str(low.dtype).removeprefix("torch."), specs,
                          len(reference.prompt_ids) + len(reference.fed), len(reference.tokens), [], None, False,
                          False, 0.0, None, 0, bound, norm_eps=norm_eps, near_ties=reference.near_ties)
    if reference.nonfinite:
        return _finish(report, search, note=f"the fp32 run itself is not finite (first at {reference.nonfinite}): "
                                            "no precision plan can fix it")
    base = search.test([], "no unit in fp32")
    report.trigger = [why for why, hit in (("nonfinite", not base.finite), ("top1", base.top1_agreement < agreement),
                                           ("logit_error", base.finite and (base.logit_rel_err or 0) > logit_threshold))
                      if hit]
    if base.passes(agreement):
        report.fp32, report.verified, report.finite, report.top1_agreement = [], True, True, base.top1_agreement
        report.ties = base.ties
        return _finish(report, search, note="finite and agreeing with fp32 as it is: no unit needs fp32")
    if not search.test(units, "every unit in fp32").passes(agreement):
        return _finish(report, search, note="even every unit in fp32 fails (the embedding and the KV cache stay "
                                            "in the low dtype): no set rescues this run")
    chosen, verified = _minimal_set(search, units, agreement)
    if verified is None:
        return _finish(report, search, note="the search found no passing set (more fp32 did not always help)")
    report.fp32, report.verified = forward_order(chosen), True
    report.finite, report.top1_agreement, report.ties = verified.finite, verified.top1_agreement, verified.ties
    rest = complement(units, chosen)
    c = search.test(rest, "the complement")
    report.complement = {"units": len(rest), "finite": c.finite, "first_nonfinite": c.first_nonfinite,
                         "top1_agreement": c.top1_agreement, "fixes": c.passes(agreement)}
    return _finish(report, search)


def _finish(report: RescueReport, search: _Search, note: str = "") -> RescueReport:
    report.trials, report.reruns, report.note = list(search.trials), len(search.trials), note
    tell_units(search.on_progress, report.reruns, report.reruns, f"done: {report.reruns} of {report.reruns} reruns")
    return report
