"""A GGUF file as stored against its dequantised self: the same file loaded twice (engine.loader.load_model with
quant="stored", its matrices kept in the file's blocks and multiplied by them, and quant="dequantized", every tensor
imported as float32), the same prompt and settings, compared stage by stage and step by step.

Both sides compute with the file's own values: the stored one decodes each block inside its products (engine.
quant_matrix), the dequantised one multiplies by those values written out as float32. What can differ is only the
order of the float32 sums in the products (and the native decode step's kernels where each side generates on its
own), so the differences are rounding: TOLERANCE (relative L2 1e-4, about 800 float32 unit roundoffs) is the
stated bound a stage must keep; a stage above it means the two paths do not compute the same thing.

The comparison: the dequantised model (the reference) generates from the prompt with the settings (EOS does not end
it); then each model reads those tokens in one PyTorch forward (token-aligned), every stage captured (the attention
maps left out: they would change the reference's attention kernel). Per stage: max |Δ| and relative L2
||stored - ref|| / ||ref|| over all positions, and the same two at each generated step's position (the position
whose logits chose that step's token). Per step: KL(p_ref || p_stored) of the next-token distributions (engine.
tools.quant.step_figures, float64), whether the top tokens agree, and the logits' max |Δ|. Beside that, the stored
model generates on its own (its native decode step where built): whether it writes the same tokens.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from engine.errors import InputError
from engine.generate import GenerationRun
from engine.inspection.interventions import HookContext
from engine.inspection.plans import split_name
from engine.inspection.probe import Probe
from engine.inspection.stages import forward_stages
from engine.loader import load_model
from engine.model import Model
from engine.progress import OnProgress, tell_units
from engine.settings import RunSettings
from engine.tools.quant import log_probs, step_figures

TOLERANCE = 1e-4


@dataclass
class StoredReport:
    stored: str                       # the model kept as stored (its name)
    dequantized: str                  # the same file dequantised to float32, the reference
    stored_bytes: dict                # weight bytes by format / dtype, the stored model
    dequantized_bytes: dict           # the same, the dequantised model
    positions: int
    steps: int
    tolerance: float
    text: str                         # the reference's continuation both read
    own_text: str                     # the stored model's own continuation (it generated on its own)
    own_first_divergence: int | None  # the first step where its own tokens differ from the reference's
    per_stage: list[dict] = field(default_factory=list)   # forward order: stage, layer, stage_in_layer, max_abs,
    #                                                       rel_l2, over, max_abs_steps, rel_l2_steps
    per_step: list[dict] = field(default_factory=list)    # step, kl, same_top, logits_max_abs
    first_stage_over: str | None = None
    kl_mean: float = 0.0
    kl_max: float = 0.0
    same_top: float = 1.0
    logits_max_abs: float = 0.0
    logits_rel_l2: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else float("inf")


def _figures(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """max |a - b| and ||a - b|| / ||b|| (b the reference), float64."""
    d = (a.double() - b.double())
    return _finite(float(d.abs().max())), _finite(float(d.norm() / b.double().norm().clamp(min=1e-300)))


def check_pair(stored: Model, dequant: Model) -> None:
    """The two sides are one GGUF file both ways: the stored one keeps matrices in blocks, the other none, in
    float32, with the same configuration."""
    if not stored.weights.quantized():
        raise InputError(f"{stored.name}: no matrix is kept quantised; load the GGUF file with quant='stored'")
    if dequant.weights.quantized() or dequant.dtype != torch.float32:
        raise InputError(f"{dequant.name}: the reference must be the file dequantised to float32 "
                         f"(got {str(dequant.dtype).removeprefix('torch.')}"
                         + (", matrices kept quantised" if dequant.weights.quantized() else "") + ")")
    if stored.config != dequant.config:
        raise InputError(f"{stored.name} and {dequant.name} have different configurations: not one file")


def compare_stored(stored: Model, dequant: Model, ids: list[int], n_prompt: int, *, tolerance: float = TOLERANCE,
                   text: str = "", own: list[int] | None = None, own_text: str = "",
                   on_progress: OnProgress | None = None) -> StoredReport:
    """Stored against dequantised over the same ids; the generated steps are logits rows n_prompt-1 ..
    len(ids)-2. own: the stored model's own generated tokens (compared with ids[n_prompt:]; None: taken as ids').
    on_progress hears units 2-4 of stored_report's four (the two forwards, the end)."""
    check_pair(stored, dequant)
    ids = [int(i) for i in ids]
    if not 0 < n_prompt < len(ids):
        raise InputError(f"need at least one generated token after {n_prompt} prompt tokens, got {len(ids)} ids")
    if not (math.isfinite(tolerance) and tolerance > 0):
        raise InputError(f"tolerance must be a positive number, got {tolerance!r}")
    tell_units(on_progress, 2, 4, "the dequantised forward, every stage captured")
    names = forward_stages(dequant.config, maps=False)
    cap = Probe().capture(names)
    ref_logits = dequant.logits(ids, cap)                                   # (T, V)
    ref = {c.name: c.value.float() for c in cap.recording.captures}
    del cap
    T, steps = len(ids), list(range(n_prompt - 1, len(ids) - 1))
    rows = []

    def compare(x: torch.Tensor, ctx: HookContext) -> None:              # reads, never replaces
        a, b = x.detach().float().cpu(), ref[ctx.name]
        max_abs, rel = _figures(a, b)
        per_pos = a.shape[0] == T and b.shape[0] == T                   # positions first (every non-map stage)
        at = [_figures(a[p], b[p]) for p in steps] if per_pos else []
        rows.append({"stage": ctx.name, "layer": ctx.layer, "stage_in_layer": split_name(ctx.name)[1],
                     "max_abs": max_abs, "rel_l2": rel, "over": not rel <= tolerance,
                     "max_abs_steps": [m for m, _ in at], "rel_l2_steps": [r for _, r in at]})
    tell_units(on_progress, 3, 4, "the stored forward, each stage compared as it passes")
    logits = stored.logits(ids, Probe().replace(list(ref), compare))
    ref_lp, st_lp = log_probs(ref_logits[steps]), log_probs(logits[steps])
    kld, match = step_figures(ref_lp, st_lp)
    per_step = [{"step": k, "kl": float(kld[k]), "same_top": bool(match[k]),
                 "logits_max_abs": _figures(logits[p], ref_logits[p])[0]} for k, p in enumerate(steps)]
    want = ids[n_prompt:]
    own = list(want if own is None else own)
    diverge = next((k for k, (x, y) in enumerate(zip(own, want)) if x != y),
                   None if len(own) == len(want) else min(len(own), len(want)))
    l_max, l_rel = _figures(logits[steps], ref_logits[steps])
    tell_units(on_progress, 4, 4, "done")
    return StoredReport(stored.name, dequant.name, _bytes(stored), _bytes(dequant), T, len(steps), tolerance, text,
                        own_text, diverge, rows, per_step,
                        next((r["stage"] for r in rows if r["over"]), None), float(kld.mean()), float(kld.max()),
                        float(match.double().mean()), l_max, l_rel)


def _bytes(model: Model) -> dict:
    return {str(k).removeprefix("torch."): int(v) for k, v in model.weights.nbytes_by_dtype().items()}


def stored_report(stored: Model, dequant: Model, settings: RunSettings, *, tolerance: float = TOLERANCE,
                  on_progress: OnProgress | None = None) -> StoredReport:
    """The one entry point: the dequantised model generates settings.max_new_tokens tokens (settings' prompt,
    sampler and seed; EOS does not end it), the stored one generates on its own with the same settings, then
    compare_stored over the reference's tokens. on_progress (engine.progress) hears each of the four units before
    it starts; a STOP answer raises engine.progress.Stopped before the next one."""
    check_pair(stored, dequant)

    def generate(model: Model):
        return GenerationRun(model, settings.prompt, params=settings.params, max_new_tokens=settings.max_new_tokens,
                             seed=settings.seed, chat=settings.chat, system=settings.system,
                             allow_special=settings.allow_special, ignore_eos=True).run()
    tell_units(on_progress, 0, 4, "the dequantised model generates")
    run = generate(dequant)
    tell_units(on_progress, 1, 4, "the stored model generates on its own")
    mine = generate(stored)
    return compare_stored(stored, dequant, run.all_ids, len(run.prompt_ids), tolerance=tolerance, text=run.text,
                          own=list(mine.token_ids), own_text=mine.text, on_progress=on_progress)


def load_pair(source, progress=None) -> tuple[Model, Model]:
    """One GGUF file both ways (the CLI's two loads): as stored, and dequantised to float32 on the CPU."""
    return (load_model(source, quant="stored", progress=progress),
            load_model(source, device="cpu", dtype="float32", progress=progress))
