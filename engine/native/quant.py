"""The native products of GGUF matrices kept in their quantised blocks (quant.c), for engine.quant_matrix: y (B, N) =
x (B, K) @ W^T, W (N, K) the file's own block bytes, x and y float32 on the CPU, in either arithmetic (ARITHMETICS:
"float", x kept in float32 and each block decoded to its exact values, quant_ops.h; "int8", llama.cpp's: x rounded
to 8 bits, integer dot products, quant_int8.h); and the same product for a float32 W (the memory floor
engine/bench/quant_kernels.py measures the quantised kernels against).

`code` is the one place a matrix's format and arithmetic become the number the C kernels take: quant.c's product
(here) and decode.c's step (engine.native.step) both use it, so both run the same kernel on a given matrix."""
from __future__ import annotations

import numpy as np
import torch

from engine.native import build
from engine.quant_int8 import ARITHMETICS
from engine.quant_int8 import FORMATS as INT8_FORMATS

# The GGML types quant.c decodes (their numbers in a GGUF file, gguf.GGMLQuantizationType).
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
INT8 = 0x100            # quant_int8.h's Q_INT8, or-ed into a type


def code(fmt: str, arithmetic: str = "float") -> int:
    """The kernels' number of a matrix in `fmt` multiplied in `arithmetic` (ValueError for a pair they lack)."""
    if fmt not in TYPES or arithmetic not in ARITHMETICS:
        raise ValueError(f"no kernel for {fmt} in {arithmetic!r} arithmetic (formats {', '.join(TYPES)}; "
                         f"arithmetics {', '.join(ARITHMETICS)})")
    if arithmetic == "int8" and fmt not in INT8_FORMATS:
        raise ValueError(f"{fmt} has no int8 kernel (those with one: {', '.join(INT8_FORMATS)})")
    return TYPES[fmt] | (INT8 if arithmetic == "int8" else 0)


def _checked_x(x: torch.Tensor, K: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != K or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a float32 CPU matrix (B, {K}); it is {x.dtype} {tuple(x.shape)} on {x.device}")
    return x.contiguous()


def rows(fmt: str, blocks: torch.Tensor, N: int, K: int, x: torch.Tensor, arithmetic: str = "float") -> torch.Tensor:
    """x (B, K) @ W^T -> (B, N), W's N rows of K values in `blocks` (uint8, contiguous, the file's bytes), in
    `arithmetic` (ARITHMETICS)."""
    kernel = code(fmt, arithmetic)
    lib = build.load()[0]
    if lib is None:
        raise RuntimeError(f"the native library is not built: {build.load()[1]}")
    if blocks.dtype != torch.uint8 or not blocks.is_contiguous() or blocks.device.type != "cpu":
        raise ValueError("the blocks must be a contiguous uint8 CPU tensor")
    x = _checked_x(x, K)
    y = torch.empty(x.shape[0], N)                   # (B, N)
    rc = lib.llmi_quant_rows(kernel, blocks.data_ptr(), N, K, x.data_ptr(), x.shape[0], y.data_ptr(),
                             torch.get_num_threads())
    if rc:
        raise ValueError(f"quant.c refused {fmt} ({arithmetic}) (N, K) = ({N}, {K}): "
                         + {-1: "type not implemented", -2: "K is not a whole number of blocks"}.get(rc, "no memory"))
    return y


def rounded_x(fmt: str, x: np.ndarray) -> np.ndarray:
    """x (K values) rounded to 8 bits as quant_int8.h rounds it for a `fmt` matrix: its bytes (quant_int8.h's
    layout), for the tests' comparison with engine.quant_int8.round_x."""
    lib = build.load()[0]
    if lib is None:
        raise RuntimeError(f"the native library is not built: {build.load()[1]}")
    x = np.ascontiguousarray(x, np.float32)
    n = lib.llmi_quant_x_bytes(TYPES[fmt], x.size)
    if n < 0 or lib.llmi_quant_x(TYPES[fmt], x.ctypes.data, x.size, (out := np.zeros(n, np.uint8)).ctypes.data):
        raise ValueError(f"{fmt}: no int8 rounding of {x.size} values (formats {', '.join(INT8_FORMATS)})")
    return out


def f32_rows(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x (B, K) @ w^T -> (B, N) for a contiguous float32 w (N, K), by quant.c's fp32 dot-product kernel."""
    lib = build.load()[0]
    if lib is None:
        raise RuntimeError(f"the native library is not built: {build.load()[1]}")
    if w.dtype != torch.float32 or w.dim() != 2 or not w.is_contiguous():
        raise ValueError("w must be a contiguous float32 matrix (N, K)")
    N, K = w.shape
    x = _checked_x(x, K)
    y = torch.empty(x.shape[0], N)
    lib.llmi_f32_rows(w.data_ptr(), N, K, x.data_ptr(), x.shape[0], y.data_ptr(), torch.get_num_threads())
    return y
