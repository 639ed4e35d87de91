"""fp32 rescue: the smallest set of units that must run in fp32 for a float16 / bfloat16 run to be finite
and agree with fp32.

The reruns (the fp32 reference, a plan replayed and judged against it, and what passes) are
engine.tools.rescue_runs.

Units (engine.variants.precision_plan): blocks.{i}.attn, blocks.{i}.mlp, blocks.{i}.resid (the residual
stream in fp32 from layer i on), final_norm, logits. Search, assuming more fp32 never hurts:

1. the plan with no unit (the trigger: non-finite, top-1 disagreement, or logits' relative error above
   the threshold);
2. when that rerun met its first NaN/Inf in layer L, every plan whose units all lie after layer L computes
   layers 0..L exactly as it did (the tokens fed are the reference's, a later unit changes nothing before
   it, and an fp32 cache hands the low layers back their own values), so it fails too: those prefixes of
   the unit list are known to fail without a rerun. When that stage is one the stream holds (attn_out,
   resid_mid, mlp_out, resid_post: the overflow may be the stream's own), the next prefix (the stream in fp32
   from layer L on) is tried first: when it passes, that resid unit is the set;
3. otherwise the plan with every unit (if that fails, no set can rescue the run), then bisection over the
   prefixes of the unit list for the smallest prefix that passes: its last unit is needed (the prefix one
   shorter failed); it joins the set, the units after it are dropped, and the set alone is tried; while it
   fails, bisect again over the remaining prefix. A set found this way is minimal: leaving out any one of
   its units fails. The list starts with the resid units, latest layer first, so a prefix keeps the stream
   in fp32 from as late a layer as it can;
4. an attn / mlp culprit computes in fp32 but hands its output back in the stream's dtype, which can
   overflow there; so when the set fails, the culprit's own layer's resid is tried once before bisecting;
5. the set, verified, and its complement: every other unit, less the resid units of layers <= any resid
   layer in the set (those would keep that stream in fp32 anyway).

Two unit lists that make the same plan (resid units nest: resid 29..15 is resid 15) are one rerun: the
search reruns a plan once and reuses its trial. One culprit costs ceil(log2 units) + 6 reruns at most:
none, the first non-finite layer's resid, every unit, the bisection, the set, the companion resid, the
complement; an overflow the stream in fp32 fixes costs three (none, that resid, the complement). Progress
counts reruns against a total that is the reruns done plus the most the round under way can still take;
another culprit adds a round, and at the end the total is the reruns done.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from engine.model import Model
from engine.progress import OnProgress, tell_units
from engine.settings import RunSettings
from engine.tools.rescue_runs import AGREEMENT, MAX_NEW_TOKENS, TIE_ULPS, Reference, Trial, fp32_reference, judge
from engine.variants import precision_plan

LOGIT_THRESHOLD = 0.05        # ||low - fp32|| / ||fp32|| of the logits over the run's steps
# the stages held in the stream's dtype: a NaN/Inf first met there may be the stream's own overflow
STREAM_STAGES = (".attn_out", ".resid_mid", ".mlp_out", ".resid_post")


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


def canonical(units) -> list[str]:
    """The shortest unit list making the same plan: resid units nest (the stream is fp32 from the earliest one
    on), so only the earliest is kept."""
    resid = min((unit_layer(u) for u in units if u.endswith(".resid")), default=None)
    return [u for u in units if not u.endswith(".resid") or unit_layer(u) == resid]


def known_failing(units: list[str], base: Trial) -> int | None:
    """When the plan with no unit met its first NaN/Inf in layer L: how many leading units lie after layer L
    (every prefix of them computes layers 0..L as that plan did, so it fails; module docstring, step 2). None
    when the first non-finite stage is not in a layer."""
    stage = base.first_nonfinite or ""
    if base.finite or not stage.startswith("blocks."):
        return None
    layer = unit_layer(stage)
    k = 0
    while k < len(units) and (unit_layer(units[k]) is None or unit_layer(units[k]) > layer):
        k += 1
    return k


class _Search:
    """Runs and records the trials; every rerun goes through `test`, so the count is the true one, and a plan
    already rerun (the same canonical units) is not rerun: its trial is reused. `ahead` is the most reruns the
    round under way can still take (set by the search as it goes), so the progress total (done + ahead) is an
    upper bound until another culprit starts a round, and equals the reruns at the end."""

    def __init__(self, reference: Reference, ref: Model, low: Model, ahead: int,
                 on_progress: OnProgress | None) -> None:
        self.reference, self.ref, self.low = reference, ref, low
        self.ahead, self.on_progress, self.trials = ahead, on_progress, []
        self.seen: dict[frozenset, Trial] = {}

    def test(self, units: list[str], label: str) -> Trial:
        self.ahead = max(self.ahead - 1, 0)
        units = canonical(units)
        key = frozenset(units)
        if key in self.seen:
            return self.seen[key]
        done = len(self.trials)
        total = done + 1 + self.ahead
        tell_units(self.on_progress, done, total, f"rerun {done + 1} of {total}: {label}")
        plan = precision_plan(self.low, units, source=self.ref) if units else self.low
        trial = judge(self.reference, plan, label)
        self.trials.append(trial)
        self.seen[key] = trial
        return trial


def _steps(n: int) -> int:
    """Bisection tests for a range of n candidates: ceil(log2 n)."""
    return math.ceil(math.log2(n)) if n > 1 else 0


def _bisect(search: _Search, chosen: list[str], pool: list[str], agreement: float, after: int,
            lo: int = 0, hi: int | None = None) -> int:
    """The smallest k in (lo, hi] with chosen + pool[:k] passing, knowing k = lo fails and k = hi (default
    len(pool)) passes; after: the most reruns the round takes once the bisection is done."""
    hi = len(pool) if hi is None else hi
    while hi - lo > 1:
        search.ahead = _steps(hi - lo) + after
        mid = (lo + hi) // 2
        if search.test(chosen + pool[:mid], f"{len(chosen)} chosen + first {mid} of {len(pool)}").passes(agreement):
            hi = mid
        else:
            lo = mid
    return hi


def _minimal_set(search: _Search, units: list[str], agreement: float, lo: int,
                 hi: int) -> tuple[list[str], Trial | None]:
    """Steps 3 and 4 of the module docstring; the first round bisects (lo, hi]. Returns the set and the rerun
    that verified it."""
    chosen, pool = [], list(units)
    while pool:
        k = _bisect(search, chosen, pool, agreement, 3, lo, hi)       # the set, its companion, the complement
        lo, hi = 0, None
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
    bound = _steps(len(units)) + 6
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
    lo, hi = known_failing(units, base), None
    if lo is not None and lo < len(units) and base.first_nonfinite.endswith(STREAM_STAGES):
        label = f"{units[lo]}: the stream in fp32 from the first non-finite layer"
        if search.test(units[:lo + 1], label).passes(agreement):
            hi = lo + 1
        else:
            lo += 1
    if hi is None:
        if not search.test(units, "every unit in fp32").passes(agreement):
            return _finish(report, search, note="even every unit in fp32 fails (the embedding and the KV cache "
                                                "stay in the low dtype): no set rescues this run")
        hi = len(units)
    chosen, verified = _minimal_set(search, units, agreement, lo or 0, hi)
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
