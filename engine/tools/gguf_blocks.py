"""GGUF round trips (quantize, then dequantize), bit for bit what the `gguf` package's own numpy quantizers give
(gguf.quants: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), about twice as fast: the same float32 numpy operations in the same
order on each block of 32 values, the block's scale (and minimum) rounded to float16 as GGUF stores them, but no
bits packed and unpacked in between, and no transposed copies: the blocks are read where the engine's (in, out)
matrices hold them (down the columns), a few thousand values at a time so the temporaries stay in the cache.
(numpy, one thread: torch's elementwise ops split over threads cost more than they give on a busy machine.)
tests/unit/test_gguf_blocks.py holds the two to each other, element for element.

`round_trip(rows, fmt)` is used by engine.tools.quant for these formats (and finite weights); any other format,
or a matrix with a NaN or an Inf, goes through the gguf package itself.
"""
from __future__ import annotations

import numpy as np
import torch

BLOCK = 32
FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
CHUNK = 1 << 16       # values per piece


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d)


def _half(t: np.ndarray) -> np.ndarray:
    """A float32 value as GGUF stores it (float16) and reads it back."""
    return t.astype(np.float16).astype(np.float32)


def _q8_0(b: np.ndarray, axis: int) -> np.ndarray:
    d = np.abs(b).max(axis=axis, keepdims=True) / np.float32(127)
    n = b * _inverse(d)
    a = np.abs(n)
    floored = np.floor(a)
    codes = np.sign(n) * (floored + np.floor(2 * (a - floored)))         # gguf.quants.np_roundf
    codes += np.float32(0)                                                 # -0.0 is int8 0 in gguf
    return codes * _half(d)


def _symmetric(b: np.ndarray, axis: int, levels: int) -> np.ndarray:
    """Q4_0 (levels 16), Q5_0 (32): d = the block's first value of largest magnitude / -(levels / 2)."""
    half = levels // 2
    big = np.take_along_axis(b, np.abs(b).argmax(axis=axis, keepdims=True), axis=axis)
    d = big / np.float32(-half)
    codes = np.trunc(b * _inverse(d) + np.float32(half + 0.5), dtype=np.float32).clip(0, levels - 1)
    return _half(d) * (codes - np.float32(half))


def _affine(b: np.ndarray, axis: int, levels: int) -> np.ndarray:
    """Q4_1 (levels 16), Q5_1 (32): d = (max - min) / (levels - 1), back as d16 * code + min16."""
    hi, lo = b.max(axis=axis, keepdims=True), b.min(axis=axis, keepdims=True)
    d = (hi - lo) / np.float32(levels - 1)
    codes = np.trunc((b - lo) * _inverse(d) + np.float32(0.5), dtype=np.float32).clip(0, levels - 1)
    return (_half(d) * codes) + _half(lo)


_KERNELS = {"Q8_0": _q8_0, "Q4_0": lambda b, a: _symmetric(b, a, 16), "Q5_0": lambda b, a: _symmetric(b, a, 32),
            "Q4_1": lambda b, a: _affine(b, a, 16), "Q5_1": lambda b, a: _affine(b, a, 32)}


def round_trip(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """w (K, N) float32 on the CPU, stored as the engine stores matrices ((in, out): GGUF's rows are its
    columns, blocks of 32 run along K), K a multiple of 32, every value finite; fmt one of FORMATS -> what
    gguf.quants.dequantize(gguf.quants.quantize(w.t(), fmt), fmt).t() gives, float32 (K, N), contiguous like w
    (a transposed view gives a transposed view)."""
    K, N = w.shape
    if not w.is_contiguous() and w.t().is_contiguous():
        return _pieces(w.t().numpy().reshape(N, K // BLOCK, BLOCK), 2, fmt).view(N, K).t()
    return _pieces(w.contiguous().numpy().reshape(K // BLOCK, BLOCK, N), 1, fmt).view(K, N)


def _pieces(b: np.ndarray, axis: int, fmt: str) -> torch.Tensor:
    """The round trip of blocks b (A, ., .) whose axis (1 or 2) holds a block's 32 values, a few of the first
    axis's rows at a time."""
    out, kernel = np.empty_like(b), _KERNELS[fmt]
    rows = max(1, CHUNK // b[0].size)
    for a in range(0, b.shape[0], rows):
        out[a:a + rows] = kernel(b[a:a + rows], axis)
    return torch.from_numpy(out)
