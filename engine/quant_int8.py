"""llama.cpp's arithmetic for a GGUF matrix kept in its blocks, in numpy: the reference engine/native/quant_int8.h is
held to, and QuantMatrix.matmul's product in that arithmetic where the native library is not built.

llama.cpp's CPU backend rounds x to 8 bits once a product (ggml-cpu's quantize_row_q8_K for the K-quants,
quantize_row_q8_0 / quantize_row_q8_1 (x86) for the 32-value formats), multiplies each weight block with its x block in
integers, and scales each integer by the two blocks' scales in float32 (ggml_vec_dot_q4_K_q8_K, _q8_0_q8_0,
_q4_1_q8_1). Here the integers are exact (int64) and the scaled terms are summed in float64: `product` gives that sum
and the sum of the terms' magnitudes, from which a float32 kernel's error is bounded (tests/unit/test_quant_int8.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# How a matrix kept in its blocks is multiplied (QuantMatrix.arithmetic): "float", x kept in float32 and every block
# decoded to the file's exact weights (engine/native/quant_ops.h); "int8", llama.cpp's arithmetic (this module).
ARITHMETICS = ("float", "int8")
FORMATS = ("Q4_K", "Q8_0", "Q4_1")         # the weight formats with an int8 product (quant_int8.h's q8_has)
X_FORMAT = {"Q4_K": "Q8_K", "Q8_0": "Q8_0", "Q4_1": "Q8_1"}     # how x is rounded for each
VALUES = {"Q4_K": 256, "Q8_0": 32, "Q4_1": 32}
F32 = np.float32


@dataclass(frozen=True)
class RoundedX:
    """x (B, K) rounded to 8 bits as llama.cpp rounds it for one weight format: q (B, K) int8 and each block's d
    (B, nb) float32 (x ~ d q); Q8_1's s = fp16(d sum q) (B, nb), Q8_K's bsums (B, nb, 16), each 16 q's sum."""
    q: np.ndarray
    d: np.ndarray
    s: np.ndarray | None = None
    bsums: np.ndarray | None = None


def nearest_int(v: np.ndarray) -> np.ndarray:
    """llama.cpp's nearest_int: the float32 v + 1.5 * 2^23, whose low mantissa bits are round(v), ties to even."""
    bits = (np.asarray(v, F32) + F32(12582912.0)).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def _fp16(v) -> np.ndarray:
    return np.asarray(v, F32).astype(np.float16).astype(F32)


def round_x(fmt: str, x: np.ndarray) -> RoundedX:
    """x (B, K) float32 rounded as llama.cpp's product with a `fmt` matrix rounds it."""
    x = np.ascontiguousarray(x, F32)
    B, K = x.shape
    qk = 256 if fmt == "Q4_K" else 32
    xb = x.reshape(B, K // qk, qk)
    if fmt == "Q4_K":        # quantize_row_q8_K_ref
        at = np.abs(xb).argmax(-1)                                   # the first value of largest magnitude
        mx = np.take_along_axis(xb, at[..., None], -1)[..., 0]       # signed
        zero = mx == 0
        with np.errstate(divide="ignore"):
            iscale = np.where(zero, F32(0), F32(-127.0) / np.where(zero, F32(1), mx)).astype(F32)
        q = np.minimum(127, nearest_int(iscale[..., None] * xb)).astype(np.int8)
        q[zero] = 0
        d = np.where(zero, F32(0), F32(1.0) / np.where(zero, F32(1), iscale)).astype(F32)
        bsums = q.astype(np.int64).reshape(B, K // 256, 16, 16).sum(-1)
        return RoundedX(q.reshape(B, K), d, bsums=bsums)
    amax = np.abs(xb).max(-1)                                        # x86's quantize_row_q8_0 / _q8_1
    dd = (amax / F32(127.0)).astype(F32)
    with np.errstate(divide="ignore"):
        iden = np.where(amax != 0, F32(127.0) / np.where(amax != 0, amax, F32(1)), F32(0)).astype(F32)
    q = np.clip(np.rint((xb * iden[..., None]).astype(F32)), -128, 127).astype(np.int8)
    s = _fp16(dd * q.astype(np.int64).sum(-1).astype(F32)) if fmt == "Q4_1" else None
    return RoundedX(q.reshape(B, K), _fp16(dd), s=s)


def _halves(raw: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0].astype(F32)


def weight_parts(fmt: str, blocks: np.ndarray, N: int, K: int) -> dict[str, np.ndarray]:
    """A matrix's blocks (N rows of K / block values, the file's bytes) as their integers and fp16 scales: q
    (N, nb, values) and d (N, nb); Q4_1 m (N, nb); Q4_K dmin (N, nb), sc and m (N, nb, 8)."""
    size = {"Q4_K": 144, "Q8_0": 34, "Q4_1": 20}[fmt]
    raw = np.asarray(blocks, np.uint8).reshape(N, K // VALUES[fmt], size)
    if fmt == "Q8_0":
        return {"d": _halves(raw, 0), "q": raw[..., 2:].view(np.int8).astype(np.int64)}
    if fmt == "Q4_1":
        qs = raw[..., 4:].astype(np.int64)
        return {"d": _halves(raw, 0), "m": _halves(raw, 2), "q": np.concatenate([qs & 15, qs >> 4], -1)}
    s = raw[..., 4:16].astype(np.int64)           # get_scale_min_k4: sub-block j's 6-bit scale and min
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = raw[..., 16:].astype(np.int64).reshape(N, -1, 4, 32)      # chunk c: sub-blocks 2c (low), 2c + 1 (high)
    q = np.stack([qs & 15, qs >> 4], 3).reshape(N, -1, 256)
    return {"d": _halves(raw, 0), "dmin": _halves(raw, 2), "sc": sc, "m": m, "q": q}


def product(fmt: str, blocks: np.ndarray, N: int, K: int, x: np.ndarray, chunk: int = 2048
            ) -> tuple[np.ndarray, np.ndarray]:
    """x (B, K) @ W^T in llama.cpp's arithmetic: (y, scale), both (B, N) float64. y: the sum of each block's
    integer dot times its float32 scale (fl(d_w d_x); Q4_K -fl(d_x dmin) m_s bsum_s a sub-block, Q4_1 m_w s_x beside),
    added exactly (float64 of exact terms); scale: the sum of the terms' magnitudes, with each integer dot replaced by
    the sum of |w q_x| (what a float32 sum of partial integer sums is bounded by)."""
    if fmt not in FORMATS:
        raise ValueError(f"{fmt} has no int8 product here ({', '.join(FORMATS)})")
    rx = round_x(fmt, x)
    B = rx.q.shape[0]
    qx = rx.q.astype(np.float64).reshape(B, K // VALUES[fmt], VALUES[fmt])           # (B, nb, values)
    y, scale = np.zeros((B, N)), np.zeros((B, N))
    for n0 in range(0, N, chunk):
        n1 = min(N, n0 + chunk)
        w = weight_parts(fmt, np.asarray(blocks).reshape(N, -1)[n0:n1], n1 - n0, K)
        d = (rx.d[:, None, :] * w["d"][None]).astype(F32).astype(np.float64)        # fl(d_x d_w): (B, n, nb)
        if fmt == "Q4_K":
            qw = (w["q"].reshape(n1 - n0, -1, 8, 32) * w["sc"][..., None]).reshape(w["q"].shape)
            dmin = (-rx.d[:, None, :] * w["dmin"][None]).astype(F32).astype(np.float64)
            bs = rx.bsums.reshape(B, -1, 8, 2).sum(-1).astype(np.float64)              # (B, nb, 8)
            mins = np.einsum("bus,nus->bnu", bs, w["m"].astype(np.float64))
            extra = dmin * mins          # a term a sub-block (the kernel's lanes), bounded by their magnitudes:
            extra_abs = np.abs(dmin) * np.einsum("bus,nus->bnu", np.abs(bs), w["m"].astype(np.float64))
        else:
            qw = w["q"]
            if fmt == "Q4_1":
                extra = (w["m"][None].astype(np.float64) * rx.s[:, None, :].astype(np.float64))
                extra_abs = np.abs(extra)
            else:
                extra = extra_abs = 0.0
        qw = qw.astype(np.float64)
        dots = np.einsum("bul,nul->bnu", qx, qw)                                     # exact integers
        mags = np.einsum("bul,nul->bnu", np.abs(qx), np.abs(qw))
        y[:, n0:n1] = (d * dots + extra).sum(-1)
        scale[:, n0:n1] = (np.abs(d) * mags + extra_abs).sum(-1)
    return y, scale
