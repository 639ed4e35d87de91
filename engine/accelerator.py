"""The accelerator, chosen once per model when it is built (as gpt-fast chooses its decode step once in main):
the model's decode step (one token in one native call, or None: the PyTorch forward) and its statistics
backend (engine.inspection.row_stats). Nothing else asks whether the native library is there.

LLM_INSPECTOR_NATIVE=0 (read when the library is first looked for) turns the native path off for models built
after; `Model.with_accelerator(PLAIN)` is the same model (shared weights) without it, the public switch tests
use to hold the two paths to each other."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.inspection.row_stats import PYTORCH, StatsBackend, chain
from engine.native import build
from engine.native import quant as native_quant
from engine.native.inspect import NATIVE
from engine.native.step import NativeDecoder, refusal


@dataclass(frozen=True)
class Accelerator:
    decode: NativeDecoder | None      # one decode token in one native call; None: every step is the PyTorch forward
    stats: StatsBackend
    why_not: str = ""                 # why the native decode step is off ("" when on)


NATIVE_STATS = chain(NATIVE, PYTORCH)   # native passes; the PyTorch backend for what they have no kernel for

PLAIN = Accelerator(None, PYTORCH, "the PyTorch forward only (Model.with_accelerator(PLAIN))")


def stats_backend(device: torch.device) -> StatsBackend:
    """The statistics backend of a model on this device (engine.inspection.row_stats): native on the CPU where
    the library is built (engine/native/inspect.c: float32 tensors), then PyTorch for the rest; elsewhere
    PyTorch. What either declines gets the reference statistics (the rule of engine.inspection.row_stats)."""
    return NATIVE_STATS if device.type == "cpu" and build.load()[0] is not None else PYTORCH


def quantized_product():
    """The native product of a matrix kept in GGUF blocks (engine/native/quant.c: `rows(fmt, blocks, N, K, x)`,
    x (B, K) float32 -> (B, N)) where the library is built, else None: engine.quant_matrix then dequantises and
    multiplies."""
    return native_quant.rows if build.load()[0] is not None else None


def float_product():
    """quant.c's fp32 dot-product kernel (`f32_rows(w, x)`: x (B, K) @ w^T for a float32 w (N, K)), the memory floor
    engine.bench.quant_kernels measures the quantised products against; None where the library is not built."""
    return native_quant.f32_rows if build.load()[0] is not None else None


def choose(model, decode: bool) -> Accelerator:
    """The accelerator of a model just built. decode: whether this model may have its own native decode step
    (engine.loader's models; variants made from another model, such as precision plans and quantised or cast
    copies, do not: engine.variants sets their attributes after they are built; engine.variants.without_heads keeps
    its model's step through NativeDecoder.sharing, which reads the variant's weights: its changed wo, every other
    one shared)."""
    stats = stats_backend(model.device)
    if not decode:
        return Accelerator(None, stats, "a model made from another one (engine.variants: no native step of its own)")
    lib, why = build.load()
    if lib is None:
        return Accelerator(None, stats, why)
    why = refusal(model)
    if why is not None:
        return Accelerator(None, stats, f"the native step does not implement this model: {why}")
    return Accelerator(NativeDecoder(model, lib), stats, "")
