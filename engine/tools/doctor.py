"""NaN/Inf doctor: fault injection, the first non-finite value of a run, and fp32 vs fp16/bf16 comparison.

Injections are written KIND@TARGET[:N] (the CLI's --inject):

    KIND    nan | inf | zero | scale=F
    TARGET  a stage (hook name, e.g. blocks.17.mlp.act) or a weight (e.g. blocks.3.mlp.w_down, embed.weight)
    N       stage: the absolute position to change (omitted: every position)
            weight: the flat element index for nan / inf / zero (omitted: element 0 for nan / inf, the whole
            weight for zero); scale=F always scales the whole weight

On a stage, nan / inf set one element of the position's row (feature `index`, 0 by default), zero clears
the whole row, scale=F multiplies the row. Weights are changed for the run only (Probe.override_weight).
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch

from engine.errors import EngineError, InputError
from engine.generate import GenerationRun, nonfinite_stop
from engine.inspection.interventions import HookContext
from engine.inspection.nonfinite import FirstNonFinite, lead_up, locate_nonfinite
from engine.inspection.plans import split_name
from engine.inspection.probe import GLOBAL_WEIGHTS, WEIGHT_SLOTS, Probe
from engine.inspection.stages import ATTENTION_MAPS, forward_stages
from engine.inspection.stat_columns import nonfinite
from engine.model import Model
from engine.progress import OnProgress, tell_units
from engine.results import GenerationResult

KINDS = ("nan", "inf", "zero", "scale")
FP16_MAX = 65504.0
_SPEC = re.compile(r"(nan|inf|zero|scale=([^@]+))@([A-Za-z0-9_.]+)(?::(\d+))?")


@dataclass(frozen=True)
class Preset:
    description: str
    injections: tuple[str, ...]
    dtype: str | None = None
    norm_eps: float | None = None


PRESETS = {
    # The ×4 activation itself still fits float16 (|x| max ~11,300 at the first token); its down projection,
    # mlp_out (~90,000 in fp32), is what passes 65,504: the text names the stage the run finds (issue 21, item 8).
    "fp16-overflow": Preset("float16 run with layer 11's MLP activation ×4: the activation still fits float16, but "
                            "the MLP's output (its down projection, ~90,000 at the first token in fp32) passes "
                            "float16's largest value, 65,504", ("scale=4@blocks.11.mlp.act",), dtype="float16"),
    "nan-activation": Preset("a NaN planted in layer 17's MLP activation at position 3", ("nan@blocks.17.mlp.act:3",)),
    "inf-activation": Preset("an Inf planted in layer 5's rotated queries at position 2",
                             ("inf@blocks.5.attn.q_rot:2",)),
    "nan-weight": Preset("a NaN in one element of layer 3's MLP down projection", ("nan@blocks.3.mlp.w_down",)),
    "rmsnorm-eps0": Preset("RMSNorm epsilon 0 and an all-zero embedding at position 2: 0 / sqrt(0) = NaN",
                           ("zero@embed:2",), norm_eps=0.0),
}


def is_weight(name: str) -> bool:
    return name in GLOBAL_WEIGHTS or split_name(name)[1] in WEIGHT_SLOTS


@dataclass(frozen=True)
class Injection:
    kind: str                     # nan | inf | zero | scale
    target: str                   # hook name or weight name
    position: int | None = None   # stage: absolute position (None = all); weight: flat element index
    factor: float = 1.0           # scale only
    index: int = 0                # stage nan / inf: flat feature index within the position's row

    @classmethod
    def parse(cls, spec: str) -> "Injection":
        m = _SPEC.fullmatch(spec.strip())
        if m is None:
            raise InputError(f"bad injection {spec!r}: write KIND@STAGE[:POSITION] with KIND nan, inf, zero or "
                             "scale=F, e.g. nan@blocks.17.mlp.act:5 or scale=4@blocks.11.mlp.act")
        try:
            factor = 1.0 if m.group(2) is None else float(m.group(2))
        except ValueError:
            raise InputError(f"bad scale factor in {spec!r}") from None
        pos = None if m.group(4) is None else int(m.group(4))
        return cls("scale" if m.group(2) is not None else m.group(1), m.group(3), pos, factor)

    @property
    def spec(self) -> str:
        kind = f"scale={self.factor:g}" if self.kind == "scale" else self.kind
        return f"{kind}@{self.target}" + ("" if self.position is None else f":{self.position}")

    def apply(self, probe: Probe, model: Model) -> None:
        """Add this fault to a probe (checked against the model's stages and weights)."""
        if self.kind not in KINDS:
            raise InputError(f"unknown injection kind {self.kind!r}; use one of {', '.join(KINDS)}")
        if is_weight(self.target):
            layer = split_name(self.target)[0]
            if layer is not None and not 0 <= layer < model.config.num_layers:
                raise InputError(f"{self.target}: the model has layers 0..{model.config.num_layers - 1}")
            probe.override_weight(self.target, self._weight_fn())
            return
        if self.target not in model.hook_names() or self.target in ("tokenizer", "detokenizer"):
            raise InputError(f"unknown stage {self.target!r} (see `python -m engine hooks`); weights are "
                             f"{', '.join(GLOBAL_WEIGHTS)} and blocks.N.{{{', '.join(WEIGHT_SLOTS)}}}")
        probe.replace(self.target, self._stage_fn())

    def _weight_fn(self):
        def fn(w: torch.Tensor) -> torch.Tensor:
            flat = w.view(-1)
            if self.kind == "scale":
                return w * self.factor
            if self.kind == "zero" and self.position is None:
                return torch.zeros_like(w)
            i = self.position or 0
            if not 0 <= i < flat.numel():
                raise InputError(f"{self.spec}: element {i} is outside the weight's {flat.numel()} elements")
            flat[i] = {"nan": float("nan"), "inf": float("inf"), "zero": 0.0}[self.kind]
            return w
        return fn

    def _stage_fn(self):
        def fn(x: torch.Tensor, ctx: HookContext) -> torch.Tensor | None:
            heads_first = ctx.name.endswith(ATTENTION_MAPS)
            y = x.transpose(0, 1) if heads_first else x                 # positions first
            if y.dim() == 1:                                             # sampler stages: one position
                y = y.unsqueeze(0)
            if self.position is not None and not ctx.pos0 <= self.position < ctx.pos0 + y.shape[0]:
                return None
            rows = slice(None) if self.position is None else self.position - ctx.pos0
            out = y.clone(memory_format=torch.contiguous_format)
            flat = out.view(out.shape[0], -1)
            if self.kind == "scale":
                flat[rows] = flat[rows] * self.factor
            elif self.kind == "zero":
                flat[rows] = 0
            else:
                flat[rows, self.index] = float("nan") if self.kind == "nan" else float("inf")
            out = out.reshape(x.shape) if x.dim() == 1 else out
            return out.transpose(0, 1) if heads_first else out
        return fn


def fault_probe(model: Model, injections=(), norm_eps: float | None = None, *, stats: str = "*",
                timing: bool = False) -> Probe:
    """A probe recording statistics of every stage, with the faults applied."""
    probe = Probe(timing=timing).record_stats(stats)
    for inj in injections:
        (Injection.parse(inj) if isinstance(inj, str) else inj).apply(probe, model)
    probe.norm_eps = norm_eps
    return probe


# ---- a doctor run -------------------------------------------------------------------------------
@dataclass
class DoctorReport:
    result: GenerationResult
    probe: Probe
    injections: list[str]
    norm_eps: float | None
    dtype: str
    first_nonfinite: FirstNonFinite | None
    lead_up: list[dict] = field(default_factory=list)
    error: str | None = None
    notes: list[str] = field(default_factory=list)    # the probe's: an override that worked on dequantised blocks

    def as_dict(self) -> dict:
        from engine.inspection.loops import find_loops
        r = self.result
        return {"model_dtype": self.dtype, "injections": self.injections, "norm_eps": self.norm_eps,
                "prompt_tokens": len(r.prompt_ids), "generated_tokens": len(r.token_ids), "token_ids": r.token_ids,
                "text": r.text, "stop_reason": r.stop_reason, "error": self.error,
                "nonfinite_logits": nonfinite_stop(r),
                "first_nonfinite": None if self.first_nonfinite is None else self.first_nonfinite.as_dict(),
                "lead_up": self.lead_up, "loops": [lp.as_dict() for lp in find_loops(r.token_ids)],
                "notes": self.notes}


def run_doctor(model: Model, prompt, *, injections=(), norm_eps: float | None = None, probe: Probe | None = None,
               stop_at_nonfinite: bool = True, lead_up_k: int = 10, **gen) -> DoctorReport:
    """Generate with statistics of every stage (and the faults); stop at the first step that produced a NaN/Inf.

    Stop reasons beyond the engine's: a step whose logits hold NaN/Inf ends the run with "non-finite logits"
    (the engine draws nothing from them; engine.generate.nonfinite_stop names the step); with stop_at_nonfinite, a
    step whose stages held a NaN/Inf while its logits stayed finite ends it with "nonfinite"; a sampler stage
    that cannot be drawn from (a fault planted after the logits) ends it with "error" (report.error)."""
    specs = [i if isinstance(i, str) else i.spec for i in injections]
    if probe is None:
        probe = fault_probe(model, injections, norm_eps)
    run = GenerationRun(model, prompt, probe=probe, **gen)
    error, seen, stop = None, 0, None
    while not run.done:
        try:
            run.step()
        except (RuntimeError, EngineError) as e:    # no valid distribution to draw from, and the like
            if probe.recording.first_nonfinite() is None:
                raise
            error, stop = f"{type(e).__name__}: {e}", "error"
            break
        new, seen = probe.recording.stats[seen:], len(probe.recording.stats)
        if stop_at_nonfinite and not run.done and any(bool(nonfinite(b.values).any()) for b in new):
            stop = "nonfinite"
            break
    result = run.result()
    if stop is not None:
        result = dataclasses.replace(result, stop_reason=stop)
    nf = locate_nonfinite(probe.recording)
    return DoctorReport(result, probe, specs, norm_eps, str(model.dtype).removeprefix("torch."), nf,
                        [] if nf is None else lead_up(probe.recording, nf, lead_up_k), error, probe.notes())


# ---- precision comparison -----------------------------------------------------------------------
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}
DEFAULT_STAGES = ("embed", "blocks.*", "final_norm", "logits")


@dataclass
class PrecisionReport:
    dtype: str
    threshold: float
    rows: list[dict]                 # stage, layer, stage_in_layer, rel_err, max_abs_err, ref_absmax
    divergence: dict | None          # the first row with rel_err > threshold
    top1_agreement: float            # fraction of positions where both models' logits have the same argmax

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def precision_compare(ref: Model, low: Model, ids, *, threshold: float | None = None,
                      stages=DEFAULT_STAGES, on_progress: OnProgress | None = None) -> PrecisionReport:
    """Both models' forward over ids; per stage, ||low - ref|| / ||ref|| over all positions (Frobenius).

    Each model runs on its own activations, so the error shown is the accumulated one. Divergence begins
    at the first stage whose relative error exceeds `threshold` (default 8 × the low dtype's unit roundoff,
    i.e. about three bits lost beyond one rounding: 0.0039 for float16, 0.031 for bfloat16).
    on_progress (engine.progress): Progress.units(done, 2 × num_layers, what) just before each block of either
    forward, then done == total; a STOP answer raises engine.progress.Stopped there (the forward's on_layer is
    the one place inside it that hears the answer), and no report is made."""
    ids = [int(i) for i in ids]
    threshold = 8 * UNIT_ROUNDOFF.get(low.dtype, 2.0 ** -11) if threshold is None else threshold
    pats = [stages] if isinstance(stages, str) else list(stages)
    names = [n for n in forward_stages(ref.config, maps=False) if any(fnmatchcase(n, p) for p in pats)]
    layers = ref.config.num_layers

    def logits(model: Model, probe: Probe, k: int) -> torch.Tensor:                 # k: forwards before this one
        name = str(model.dtype).removeprefix("torch.")

        def on_layer(i: int) -> None:
            tell_units(on_progress, k * layers + i, 2 * layers,
                       f"{name} forward over {len(ids)} positions: layer {i + 1} of {layers}")
        return model.forward(torch.as_tensor(ids, dtype=torch.long), model.new_cache(max(1, len(ids))), probe,
                             on_layer=on_layer if on_progress is not None else None).float().cpu()
    ref_logits = logits(ref, cap := Probe().capture(names), 0)
    want = {c.name: c.value for c in cap.recording.captures}
    rows: list[dict] = []

    def compare(x: torch.Tensor, ctx: HookContext) -> None:              # reads, never replaces
        a, b = x.detach().float().cpu(), want[ctx.name].float()
        rel = float((a - b).norm() / b.norm().clamp(min=1e-30))
        rows.append({"stage": ctx.name, "layer": ctx.layer, "stage_in_layer": split_name(ctx.name)[1],
                     "rel_err": rel if math.isfinite(rel) else float("inf"),
                     "max_abs_err": float((a - b).abs().max()), "ref_absmax": float(b.abs().max())})
    low_logits = logits(low, Probe().replace(names, compare), 1)
    tell_units(on_progress, 2 * layers, 2 * layers, "done")
    agree = float((low_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
    div = next((r for r in rows if not r["rel_err"] <= threshold), None)
    return PrecisionReport(str(low.dtype).removeprefix("torch."), threshold, rows, div, agree)
