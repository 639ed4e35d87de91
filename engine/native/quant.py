"""The native products of GGUF matrices kept in their quantised blocks (quant.c), for engine.quant_matrix: y (B, N) =
x (B, K) @ W^T, W (N, K) the file's own block bytes, x and y float32 on the CPU; and the same product for a float32 W
(the memory floor engine/bench/quant_kernels.py measures the quantised kernels against)."""
from __future__ import annotations

import torch

from engine.native import build

# The GGML types quant.c decodes (their numbers in a GGUF file, gguf.GGMLQuantizationType).
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def _checked_x(x: torch.Tensor, K: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != K or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a float32 CPU matrix (B, {K}); it is {x.dtype} {tuple(x.shape)} on {x.device}")
    return x.contiguous()


def rows(fmt: str, blocks: torch.Tensor, N: int, K: int, x: torch.Tensor) -> torch.Tensor:
    """x (B, K) @ W^T -> (B, N), W's N rows of K values in `blocks` (uint8, contiguous, the file's bytes)."""
    lib = build.load()[0]
    if lib is None:
        raise RuntimeError(f"the native library is not built: {build.load()[1]}")
    if blocks.dtype != torch.uint8 or not blocks.is_contiguous() or blocks.device.type != "cpu":
        raise ValueError("the blocks must be a contiguous uint8 CPU tensor")
    x = _checked_x(x, K)
    y = torch.empty(x.shape[0], N)                   # (B, N)
    rc = lib.llmi_quant_rows(TYPES[fmt], blocks.data_ptr(), N, K, x.data_ptr(), x.shape[0], y.data_ptr(),
                             torch.get_num_threads())
    if rc:
        raise ValueError(f"quant.c refused {fmt} (N, K) = ({N}, {K}): "
                         + ("type not implemented" if rc == -1 else "K is not a whole number of blocks"))
    return y


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
