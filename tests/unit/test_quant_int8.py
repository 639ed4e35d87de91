"""llama.cpp's arithmetic for matrices kept in their blocks (QuantMatrix arithmetic "int8": engine/native/quant_int8.h)
held to the numpy reference engine.quant_int8, and through it to llama.cpp's own rules, and to the float32 product of
the dequantised matrix.

- x rounded: the native bytes equal the reference's (q, bsums exactly; d, s bit for bit), and both equal hand-made
  answers of llama.cpp's rules (Q8_K: iscale = -127 / max, max the signed value of largest magnitude, ties to even;
  Q8_0: d = fp16(amax / 127), q = round(x 127 / amax), ties to even).
- The integers exact: x of integers with |max| = 127 (then x rounds to itself, d = 1) and power-of-two weight scales
  make every float operation of the kernel exact, so the product must equal the reference's exact sum bit for bit.
- Random blocks: |kernel - reference| <= (2 nb + 8) u scale, u = 2^-24, scale = the sum over blocks of |fl(d_w d_x)|
  sum_i |w_i q_i| (+ the min / offset terms' magnitudes): the kernel adds nb block terms per lane (16 lanes, or one
  chain of 2 nb terms in the portable code, each at most one rounding of a product and one of a sum: the integers
  and their conversions are exact below 2^24), then 16 lanes (4 levels); a sum of depth D errs by at most
  gamma_D sum |terms| (Higham 3.1), D <= 2 nb + 8.
- Against the float32 product of the dequantised matrix: the 8-bit x errs by at most half a step and the fp16 of its
  scale: |x_i - d q_i| <= (0.5 + 127 2^-11 + 2^-16) amax_block / 127 (Q8_K: 0.5 + 2^-16; d = 1 / iscale is float32),
  so |y_int8 - x.w| <= sum_i |w_i| E_i (+ Q4_1: |m| (32 E + 2^-11 |s|) for its m s term) + the two float32 sums'
  own bounds."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import quant_int8
from engine.accelerator import quantized_product
from engine.errors import UnsupportedModelError
from engine.native import quant as native_quant
from engine.quant_matrix import QuantMatrix

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

pytestmark = pytest.mark.unit

U = 2.0 ** -24
FORMATS = quant_int8.FORMATS
SIZE = {"Q4_K": 144, "Q8_0": 34, "Q4_1": 20}
# values a row: several blocks, an odd count of 32-value blocks past a chunk of sixteen (the kernels' tails)
KS = {"Q4_K": 256 * 5, "Q8_0": 32 * 37, "Q4_1": 32 * 21}


def native():
    if quantized_product() is None:
        pytest.skip("the native library is not built on this machine")


def random_blocks(fmt: str, n: int, K: int, seed: int, scale_bits: tuple[float, float] | None = None) -> np.ndarray:
    """n rows of random valid blocks: every code at random, fp16 scales small and finite (or the given ones)."""
    rng = np.random.default_rng(seed)
    if fmt != "Q4_K" and scale_bits is None:
        rows = rng.standard_normal((n, K)).astype(np.float32) * rng.uniform(0.01, 3.0, (n, 1)).astype(np.float32)
        return np.ascontiguousarray(quantize(rows, GGMLQuantizationType[fmt])).reshape(n, -1)
    raw = rng.integers(0, 256, (n, K // quant_int8.VALUES[fmt], SIZE[fmt]), dtype=np.uint8)
    for at, s in zip((0, 2), scale_bits or (None, None)):
        if fmt == "Q8_0" and at == 2:
            break
        v = (np.full(raw.shape[:2], s) if s is not None else
             rng.uniform(-2.0 ** -5, 2.0 ** -5, raw.shape[:2])).astype(np.float16)
        raw[..., at:at + 2] = v[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def native_rounding(fmt: str, x: np.ndarray) -> dict[str, np.ndarray]:
    """quant_int8.h's rounded x of one row, taken apart by its layout."""
    raw, K = native_quant.rounded_x(fmt, x), x.size
    if fmt == "Q4_K":
        nb = K // 256
        q = raw[36 * nb:36 * nb + K].view(np.int8).reshape(nb, 8, 32)[:, [0, 2, 1, 3, 4, 6, 5, 7]]    # its slots
        return {"d": raw[:4 * nb].view(np.float32), "bsums": raw[4 * nb:36 * nb].view(np.int16).reshape(nb, 16),
                "q": q.reshape(K)}
    nb = K // 32
    f = raw[:8 * (nb + 16)].view(np.float32)
    return {"d": f[:nb], "s": f[nb + 16:2 * nb + 16], "q": raw[8 * (nb + 16):8 * (nb + 16) + K].view(np.int8),
            "pad": np.concatenate([f[nb:nb + 16], f[2 * nb + 16:], raw[8 * (nb + 16) + K:].view(np.float32)])}


def test_each_format_has_an_int8_kernel_exactly_where_the_reference_has_one():
    native()
    for fmt, t in native_quant.TYPES.items():
        has = fmt in FORMATS
        assert (native_quant.build.load()[0].llmi_quant_x_bytes(t, 256) >= 0) == has, fmt
        if not has:
            with pytest.raises(ValueError, match="no int8 kernel"):
                native_quant.code(fmt, "int8")
    assert native_quant.code("Q4_K", "int8") != native_quant.code("Q4_K", "float") == 12


def test_x_is_rounded_to_q8_k_as_llama_cpp_rounds_it_by_hand():
    """max = -127 / 64 (the largest magnitude, negative): iscale = -127 / max = 64 exactly, so max -> -127, 2^-7 ->
    0.5 -> 0 and 3 2^-7 -> 1.5 -> 2 (ties to even), -0.25 -> -16, 2^-12 -> 0; d = 1 / 64. A block of zeros: d 0."""
    x = np.zeros(512, np.float32)
    x[:5] = [2.0 ** -7, -127 / 64, 3 * 2.0 ** -7, -0.25, 2.0 ** -12]
    x[20] = 127 / 64                         # as large as the max, later: the first of them sets iscale's sign
    ref = quant_int8.round_x("Q4_K", x[None])
    assert ref.q[0, :5].tolist() == [0, -127, 2, -16, 0] and ref.q[0, 20] == 127
    assert ref.d[0].tolist() == [1 / 64, 0.0] and not ref.q[0, 256:].any()
    assert ref.bsums[0, 0].tolist() == [-141, 127] + [0] * 14 and not ref.bsums[0, 1].any()
    native()
    got = native_rounding("Q4_K", x)
    assert np.array_equal(got["q"], ref.q[0]) and np.array_equal(got["bsums"], ref.bsums[0])
    assert np.array_equal(got["d"].view(np.uint32), ref.d[0].view(np.uint32))


def test_x_is_rounded_to_q8_0_and_q8_1_as_llama_cpp_rounds_it_by_hand():
    """amax = 127 / 64: 127 / amax = 64 exactly, so x 2^-7 -> 0.5 -> 0 and 3 2^-7 -> 1.5 -> 2 (ties to even),
    -x -> -x 64; d = fp16(amax / 127) = 2^-6; Q8_1's s = fp16(d sum q)."""
    x = np.zeros(64, np.float32)
    x[:5] = [127 / 64, 2.0 ** -7, 3 * 2.0 ** -7, -0.25, -127 / 64]
    for fmt in ("Q8_0", "Q4_1"):
        ref = quant_int8.round_x(fmt, x[None])
        assert ref.q[0, :5].tolist() == [127, 0, 2, -16, -127] and not ref.q[0, 5:].any()
        assert ref.d[0].tolist() == [2.0 ** -6, 0.0]
        if fmt == "Q4_1":
            assert ref.s[0].tolist() == [np.float32(np.float16((127 / 64 / 127) * (127 + 2 - 16 - 127))), 0.0]
        native()
        got = native_rounding(fmt, x)
        assert np.array_equal(got["q"], ref.q[0]) and np.array_equal(got["d"], ref.d[0]) and not got["pad"].any()
        if fmt == "Q4_1":
            assert np.array_equal(got["s"], ref.s[0])


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_x_is_rounded_bit_for_bit_as_the_reference_rounds_it(fmt):
    native()
    rng = np.random.default_rng(1)
    K = KS[fmt]
    for scale in (1e-3, 1.0, 300.0):
        x = (rng.standard_normal(K) * scale).astype(np.float32)
        x[:32] = 0.0                                       # a block of zeros
        ref, got = quant_int8.round_x(fmt, x[None]), native_rounding(fmt, x)
        assert np.array_equal(got["q"], ref.q[0])
        assert np.array_equal(got["d"].view(np.uint32), ref.d[0].view(np.uint32))
        if ref.bsums is not None:
            assert np.array_equal(got["bsums"], ref.bsums[0])
        if ref.s is not None:
            assert np.array_equal(got["s"].view(np.uint32), ref.s[0].view(np.uint32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernels_integers_are_exact(fmt):
    """x of small integers with one -127 a block (x rounds to itself, d = 1), weight scales 2^-4 and 2^-6: every
    partial sum is a multiple of 2^-6 below 2^18, so the kernel's floats are exact and must give the exact sum."""
    native()
    rng = np.random.default_rng(2)
    K, N, B = KS[fmt], 11, 3
    raw = random_blocks(fmt, N, K, seed=3, scale_bits=(2.0 ** -4, 2.0 ** -6))
    x = rng.integers(-3, 4, (B, K)).astype(np.float32)
    x[:, ::quant_int8.VALUES[fmt]] = -127.0
    want, _ = quant_int8.product(fmt, raw, N, K, x)
    assert np.array_equal(quant_int8.round_x(fmt, x).q, x.astype(np.int8))
    m = QuantMatrix("blk.0.ffn_up.weight", fmt, (N, K), torch.from_numpy(raw), "int8")
    got = m.matmul(torch.from_numpy(x)).double().numpy()
    assert np.array_equal(got, want), np.abs(got - want).max()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("B", [1, 5])
def test_the_int8_product_is_llama_cpps_within_its_float_sum(fmt, B):
    native()
    K, N = KS[fmt], 13
    raw = random_blocks(fmt, N, K, seed=B)
    x = np.random.default_rng(B).standard_normal((B, K)).astype(np.float32)
    m = QuantMatrix("blk.0.attn_q.weight", fmt, (N, K), torch.from_numpy(raw), "int8")
    got = m.matmul(torch.from_numpy(x)).double().numpy()
    want, scale = quant_int8.product(fmt, raw, N, K, x)
    nb = K // quant_int8.VALUES[fmt]
    assert (scale > 0).all()
    assert (np.abs(got - want) <= (2 * nb + 8) * U * scale).all(), (np.abs(got - want) / scale).max()
    # each row of x alone gives the same bits (a row's result depends on that row only: the step's product)
    assert np.array_equal(m.matmul(torch.from_numpy(x[-1:])).double().numpy(), got[-1:])
    # the reference path of matmul (no native kernel) is the same arithmetic
    ref = m.matmul(torch.from_numpy(x), native=False).double().numpy()
    assert (np.abs(ref - want) <= U * np.abs(want)).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_int8_product_is_the_dequantised_product_within_the_error_of_8_bit_x(fmt):
    native()
    K, N, B = KS[fmt], 13, 4
    raw = random_blocks(fmt, N, K, seed=7)
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((B, K)) * rng.uniform(0.1, 10.0, (B, 1))).astype(np.float32)
    w = dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float64)                      # (N, K)
    qk = quant_int8.VALUES[fmt]
    amax = np.abs(x.reshape(B, K // qk, qk)).max(-1) / 127.0                               # (B, nb)
    e = np.repeat(amax * (0.5 + 2.0 ** -16 if fmt == "Q4_K" else 0.5 + 127 * 2.0 ** -11 + 2.0 ** -16), qk, -1)
    if fmt == "Q4_1":      # w = d q + m: the bound of the d q part, and m's times x's block sum (s, fp16)
        parts = quant_int8.weight_parts(fmt, raw, N, K)
        dq = np.repeat(parts["d"], qk, -1) * parts["q"].reshape(N, K)
        limit = e @ np.abs(dq).T + (32 * amax * (0.5 + 127 * 2.0 ** -11 + 2.0 ** -16) + 2.0 ** -11 * 32 * amax * 127
                                    ) @ np.abs(parts["m"]).T
    else:
        limit = e @ np.abs(w).T
    exact = x.astype(np.float64) @ w.T
    m = QuantMatrix("blk.0.ffn_down.weight", fmt, (N, K), torch.from_numpy(raw), "int8")
    got = m.matmul(torch.from_numpy(x)).double().numpy()
    _, scale = quant_int8.product(fmt, raw, N, K, x)
    limit = limit + (2 * K // qk + 8) * U * scale
    assert (np.abs(got - exact) <= limit).all(), (np.abs(got - exact) / limit).max()
    # and the bound is not vacuous: the 8-bit x moves the product by more than float32's own rounding would
    floatm = QuantMatrix("blk.0.ffn_down.weight", fmt, (N, K), torch.from_numpy(raw)).matmul(torch.from_numpy(x))
    assert np.abs(got - exact).max() > 10 * np.abs(floatm.double().numpy() - exact).max()


def test_a_format_without_an_int8_kernel_is_refused_naming_the_tensor():
    raw = random_blocks("Q8_0", 2, 64, seed=0)
    m = QuantMatrix("blk.1.ffn_up.weight", "Q8_0", (2, 64), torch.from_numpy(raw))
    assert m.with_arithmetic("int8").arithmetic == "int8" and m.arithmetic == "float"
    q40 = np.ascontiguousarray(quantize(np.ones((2, 64), np.float32), GGMLQuantizationType.Q4_0))
    with pytest.raises(UnsupportedModelError, match=r"blk\.2\.attn_v\.weight.*'int8'.*Q4_0"):
        QuantMatrix("blk.2.attn_v.weight", "Q4_0", (2, 64), torch.from_numpy(q40), "int8")
    with pytest.raises(UnsupportedModelError, match="arithmetics float, int8"):
        m.with_arithmetic("int4")


PORTABLE = r"""
#include "quant_int8.h"
float portable_dot(int type, const uint8_t *w, long n, long nb, const uint8_t *xq) { return q8_dot(type, w, n, nb, xq); }
void portable_round(int type, const float *x, long K, uint8_t *out) { q8_round(type, x, K, out); }
"""


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_portable_kernels_without_avx512_vnni_are_the_same_arithmetic(fmt, tmp_path):
    """quant_int8.h compiled without AVX-512 VNNI (its portable block-by-block loops, which CPUs without it run) held
    to the reference as the vector kernels are: x rounded to the same bytes, the product within (2 nb + 8) u scale."""
    import ctypes
    import shutil
    import subprocess

    from engine.native.build import HEADERS

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    (tmp_path / "p.c").write_text(PORTABLE)
    lib = tmp_path / "p.so"
    r = subprocess.run([cc, "-O3", "-march=native", "-mno-avx512vnni", "-shared", "-fPIC", "-I",
                        str(HEADERS[0].parent), "-o", str(lib), str(tmp_path / "p.c"), "-lm"], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"cannot build the portable kernels here: {r.stderr[-200:]}")
    so = ctypes.CDLL(str(lib))
    so.portable_dot.restype = ctypes.c_float
    so.portable_dot.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
    so.portable_round.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    K, N, t = KS[fmt], 9, native_quant.TYPES[fmt]
    raw = random_blocks(fmt, N, K, seed=4)
    x = np.random.default_rng(4).standard_normal(K).astype(np.float32)
    xq = np.zeros(36 * (K // 256) + K if fmt == "Q4_K" else 8 * (K // 32 + 16) + K + 64, np.uint8)
    so.portable_round(t, x.ctypes.data, K, xq.ctypes.data)
    ref = quant_int8.round_x(fmt, x[None])
    if fmt == "Q4_K":
        q = xq[36 * (K // 256):].view(np.int8).reshape(-1, 8, 32)[:, [0, 2, 1, 3, 4, 6, 5, 7]].reshape(K)
    else:
        q = xq[8 * (K // 32 + 16):8 * (K // 32 + 16) + K].view(np.int8)
    assert np.array_equal(q, ref.q[0])
    nb = K // quant_int8.VALUES[fmt]
    got = np.array([so.portable_dot(t, raw.ctypes.data, n, nb, xq.ctypes.data) for n in range(N)], np.float64)
    want, scale = quant_int8.product(fmt, raw, N, K, x[None])
    assert (np.abs(got - want[0]) <= (2 * nb + 8) * U * scale[0]).all(), (np.abs(got - want[0]) / scale[0]).max()
