"""Quantization damage per stage: the model's weights re-quantized with the `gguf` package's quantizers
(Q8_0, Q5_0, Q5_1, Q4_0, Q4_1, ...), dequantized, and run token-aligned against the model itself. The five
formats named above round-trip in torch (engine.tools.gguf_blocks: the gguf package's numbers, bit for bit, on
every core); any other goes through the gguf package.

What is quantized: the block matrices (q/k/v, o, gate/up, down), as the bundled GGUF quantizes them; norms
stay float32 (GGUF keeps them F32), and the token embedding (tied lm_head) stays as loaded unless
embed=True (the bundled file stores it in Q8_0, apart from the Q4_1 block matrices). GGUF quantizes each
row of an (out, in) matrix in blocks of 32 along the input dimension; the engine stores matrices
transposed, (in, out), so they are transposed back for the round trip. llama.cpp's q/k row permutation
does not matter here: it moves whole rows, and blocks never cross a row.

The comparison: the reference (this model, float32) generates from the prompt; each quantized copy reads
the same tokens in one forward (token-aligned). Per stage: ||q - ref|| / ||ref|| over all positions. Per
generated step: KL(p_ref || p_q) of the next-token distributions and whether the top tokens agree. The
first layer "over" is the first whose residual stream (blocks.{i}.resid_post) has a relative error above
the threshold.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.errors import InputError
from engine.family.slots import MATRICES as SLOT_MATRICES
from engine.family.slots import SLOTS
from engine.generate import GenerationRun
from engine.inspection.interventions import HookContext
from engine.inspection.plans import split_name
from engine.inspection.probe import Probe
from engine.inspection.stages import forward_stages
from engine.memory import COPY_ADVICE, check_work_fits
from engine.model import Model
from engine.progress import OnProgress, tell_units
from engine.settings import RunSettings
from engine.tools import gguf_blocks
from engine.variants import derive

FORMATS = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")
MATRICES = SLOT_MATRICES + tuple(s.field for s in SLOTS if s.kind == "experts")   # every product's weights
THRESHOLD = 0.05


def _qtype(fmt: str):
    from gguf import GGMLQuantizationType
    try:
        return GGMLQuantizationType[fmt.strip().upper()]
    except KeyError:
        raise InputError(f"unknown GGUF format {fmt!r}; try {', '.join(FORMATS)}") from None


def check_formats(formats) -> list[str]:
    """Format names, upper-cased; an unknown one is an InputError before any model work."""
    fmts = [f.strip().upper() for f in formats if f.strip()]
    if not fmts:
        raise InputError(f"no format given; try {', '.join(FORMATS)}")
    for f in fmts:
        _qtype(f)
    return fmts


def requantize(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """A matrix stored (in, out) through fmt's quantizer and back: float32, same shape and layout. The formats of
    engine.tools.gguf_blocks run there (torch, every core, bit for bit the gguf package's numbers); the others, and
    a matrix with a NaN or an Inf (or a sum beyond float32's range), through the gguf package itself."""
    if w.dim() == 3:      # experts (E, in, out): each expert's matrix on its own, as GGUF stores them
        return torch.stack([requantize(x, fmt) for x in w])
    qt, w32 = _qtype(fmt), w.detach().float().cpu()
    # a finite sum: every value finite (numpy's sum, one pass; torch's isfinite over two threads costs ~10x more here)
    if qt.name in gguf_blocks.FORMATS and w32.shape[0] % gguf_blocks.BLOCK == 0 \
            and math.isfinite(float(w32.numpy().sum())):
        return gguf_blocks.round_trip(w32, qt.name).contiguous().to(w.device)
    rows = w32.t().contiguous()                                        # (out, in): GGUF's row layout
    from gguf.quants import QuantError, dequantize, quantize
    try:
        back = dequantize(quantize(rows.numpy(), qt), qt)
    except NotImplementedError as e:
        raise InputError(f"the gguf package cannot quantize {fmt}: {e}") from None
    except (QuantError, ValueError) as e:                              # a row not a whole number of blocks
        raise InputError(f"{fmt} cannot quantize a matrix of shape {tuple(rows.shape)}: {e}") from None
    out = torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32)).reshape(rows.shape)
    return out.t().contiguous().to(w.device)                          # (in, out) again


def quantized_model(model: Model, fmt: str, *, embed: bool = False) -> Model:
    """A new Model sharing config and tokenizer, with every block matrix (and the embedding with embed=True)
    replaced by its fmt round trip. Vectors (norms, biases) are shared with the model, never copied. A model kept
    quantised is round-tripped from its dequantised values (Weights.floats)."""
    # the dequantised values, and each matrix's float32 round trip beside them (at most one per value)
    check_work_fits(model.weights.dequantized_nbytes() + 4 * model.weights.values(), f"a {fmt} copy of {model.name}",
                    "its copy of the weights", COPY_ADVICE)
    w = model.weights.floats()
    layers = [dataclasses.replace(lw, **{f: requantize(getattr(lw, f), fmt) for f in MATRICES
                                                if getattr(lw, f) is not None})
              for lw in w.layers]
    emb, head = w.embed, w.lm_head
    if embed:
        emb = requantize(w.embed.t(), fmt).t().contiguous()             # (V, d): rows are token vectors
        if w.tied():            # one matrix read both ways, as loaded (engine.weights)
            head = emb.t().contiguous()
            emb = head.t()
        else:
            head = requantize(w.lm_head, fmt)
    return derive(model, dataclasses.replace(w, embed=emb, layers=layers, lm_head=head), dtype=torch.float32,
                  name=f"{model.name} [{fmt.upper()}]")


@dataclass
class FormatResult:
    format: str
    kld: list[float]                  # per generated step, nats: KL(p_ref || p_quant)
    top_match: list[bool]             # per generated step: the same top token
    kld_mean: float
    same_top: float                   # fraction of steps with the same top token
    first_layer_over: int | None      # first layer whose resid_post relative error > threshold
    per_stage: list[dict]             # stage, layer, stage_in_layer, rel_err (forward order)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class QuantReport:
    reference: str                    # the model compared against
    positions: int
    steps: int
    threshold: float
    embed: bool
    text: str                         # the reference's continuation every format reads
    formats: list[FormatResult] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "formats"}
        d["formats"] = {r.format: r.as_dict() for r in self.formats}
        return d

    def result(self, fmt: str) -> FormatResult:
        return next(r for r in self.formats if r.format == fmt.upper())

    def with_threshold(self, threshold: float) -> "QuantReport":
        """The same measurements judged against another threshold (no model work)."""
        return dataclasses.replace(self, threshold=threshold, formats=[
            dataclasses.replace(r, first_layer_over=first_layer_over(r.per_stage, threshold)) for r in self.formats])


def _compare(ref_stages: dict[str, torch.Tensor], quant: Model, ids: list[int]) -> tuple[list[dict], torch.Tensor]:
    """One forward of quant over ids, each stage compared with the reference's as it passes (then dropped).
    Returns the per-stage rows and quant's logits (T, V) float32."""
    rows = []

    def compare(x: torch.Tensor, ctx: HookContext) -> None:          # reads, never replaces
        a, b = x.detach().float().cpu(), ref_stages[ctx.name]
        rel = float((a - b).norm() / b.norm().clamp(min=1e-30))
        rows.append({"stage": ctx.name, "layer": ctx.layer, "stage_in_layer": split_name(ctx.name)[1],
                     "rel_err": rel if math.isfinite(rel) else float("inf")})
    logits = quant.logits(ids, Probe().replace(list(ref_stages), compare))
    return rows, logits


def first_layer_over(rows: list[dict], threshold: float) -> int | None:
    """The first layer whose residual stream (resid_post) has a relative error above threshold."""
    return next((r["layer"] for r in rows if r["stage_in_layer"] == "resid_post" and not r["rel_err"] <= threshold),
                None)


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Rows of logits (steps, V) as float64 log-probabilities: the precision every per-step figure is taken in
    (a float32 softmax loses the small KL divergences of Q8_0 to rounding)."""
    return torch.log_softmax(logits.double(), -1)


def step_figures(ref_lp: torch.Tensor, q_lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of two (steps, V) log-probability tensors (log_probs): KL(p_ref || p_q) in nats, (steps,) float64,
    clamped at 0 (two near-equal distributions can round to a tiny negative sum), and whether the two top tokens
    agree, (steps,) bool. The one definition of both figures: the page's per-step ones and the scoreboard's."""
    kld = (ref_lp.exp() * (ref_lp - q_lp)).sum(-1).clamp(min=0.0)
    return kld, q_lp.argmax(-1) == ref_lp.argmax(-1)


def compare_formats(model: Model, ids: list[int], n_prompt: int, formats, *, threshold: float = THRESHOLD,
                    embed: bool = False, text: str = "", on_progress: OnProgress | None = None) -> QuantReport:
    """Each format's quantized copy against model over the same ids (built, compared and freed one at a
    time). The generated steps are the logits rows n_prompt-1 .. len(ids)-2 (each chose the next token).
    on_progress (engine.progress) hears the reference forward and each format's two units (quantizing, running)
    before they start, and the end; a STOP answer raises engine.progress.Stopped before the next one (no report)."""
    if model.dtype != torch.float32:
        raise InputError(f"quantization is compared against float32 weights; this model is {model.dtype}")
    ids = [int(i) for i in ids]
    if not 0 < n_prompt < len(ids):
        raise InputError(f"need at least one generated token after {n_prompt} prompt tokens, got {len(ids)} ids")
    fmts = check_formats(formats)
    total = 1 + 2 * len(fmts)
    tell_units(on_progress, 0, total, "the float32 reference forward")
    names = forward_stages(model.config, maps=False)   # the maps would change the reference's attention kernel
    cap = Probe().capture(names)
    ref_logits = model.logits(ids, cap)
    ref_stages = {c.name: c.value.float() for c in cap.recording.captures}
    del cap
    steps = slice(n_prompt - 1, len(ids) - 1)
    ref_lp = log_probs(ref_logits[steps])                                      # (steps, V)
    report = QuantReport(f"{model.name} ({str(model.dtype).removeprefix('torch.')})", len(ids),
                         len(ids) - n_prompt, threshold, embed, text)
    for k, fmt in enumerate(fmts):
        tell_units(on_progress, 1 + 2 * k, total, f"quantizing to {fmt}")
        quant = quantized_model(model, fmt, embed=embed)
        tell_units(on_progress, 2 + 2 * k, total, f"running {fmt}")
        rows, logits = _compare(ref_stages, quant, ids)
        del quant                                             # one extra model at a time
        kld, match = step_figures(ref_lp, log_probs(logits[steps]))
        report.formats.append(FormatResult(fmt, [float(x) for x in kld], [bool(x) for x in match],
                                           float(kld.mean()), float(match.double().mean()),
                                           first_layer_over(rows, threshold), rows))
    tell_units(on_progress, total, total, "done")
    return report


def quant_report(model: Model, settings: RunSettings, formats=("Q8_0", "Q4_0"), *, threshold: float = THRESHOLD,
                 embed: bool = False, on_progress: OnProgress | None = None) -> QuantReport:
    """The reference generates settings.max_new_tokens tokens (settings' prompt, sampler and seed; EOS does
    not end it, so every format reads the same number of steps); then compare_formats over those tokens."""
    run = GenerationRun(model, settings.prompt, params=settings.params, max_new_tokens=settings.max_new_tokens,
                        seed=settings.seed, chat=settings.chat, system=settings.system,
                        allow_special=settings.allow_special, ignore_eos=True).run()
    return compare_formats(model, run.all_ids, len(run.prompt_ids), formats, threshold=threshold, embed=embed,
                           text=run.text, on_progress=on_progress)
