"""engine.quant_matrix.QuantMatrix: every format's product against the gguf package's own dequantisation and a
float64 product of those weights (the known answer), for the native kernel (engine/native/quant.c) and the
dequantise-and-multiply path; its dequantize() bit for bit gguf.quants.dequantize's; a truncated blob and a type it
does not keep quantised refused naming the tensor; and a GGUF file written by the gguf package read back through
engine.gguf_file into QuantMatrix with the same bytes and values.

Blocks: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 are made by gguf.quants.quantize from random rows. gguf-py cannot quantise the
K-quants, so their blocks are random bytes (every code, and every packed 6-bit sub-block scale and min, at random)
with the fp16 super-block scales (d, and dmin for Q4_K/Q5_K) overwritten by small finite values.

The bound: each weight the kernel multiplies is exact in fp32 (quant.c's header: at most 24 significant bits), so
the only error is the fp32 dot product's: whatever the order of its K products and sums (lanes, FMA, MKL's
blocking), |fl(x.w) - x.w| <= gamma_K sum_k |x_k w_k|, gamma_K = K u / (1 - K u), u = 2^-24 (Higham, Accuracy and
Stability of Numerical Algorithms, 3.1). The reference is summed in float64 (its own error, K 2^-53 of the same sum,
is added)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.accelerator import quantized_product
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.gguf_file import open_gguf
from engine.quant_matrix import BLOCKS, QuantMatrix

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

pytestmark = pytest.mark.unit

SIMPLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")       # gguf.quants.quantize makes these
K_QUANTS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}   # byte offsets of each super-block's fp16 scales
FORMATS = SIMPLE + tuple(K_QUANTS)
N_ROWS = 13


def blocks_of(fmt: str, n: int, seed: int) -> tuple[np.ndarray, int]:
    """(uint8 (n, bytes a row), K): n rows of several blocks each in `fmt`'s file layout."""
    rng = np.random.default_rng(seed)
    qt = GGMLQuantizationType[fmt]
    per, size = GGML_QUANT_SIZES[qt]
    if fmt in SIMPLE:
        K = 7 * per
        rows = rng.standard_normal((n, K)).astype(np.float32) * rng.uniform(0.01, 3.0, (n, 1)).astype(np.float32)
        rows[0, :per] = 0.0                                     # an all-zero block: d = 0
        return np.ascontiguousarray(quantize(rows, qt)), K
    K = 3 * per
    raw = rng.integers(0, 256, (n, K // per, size), dtype=np.uint8)
    for at in K_QUANTS[fmt]:
        scales = rng.uniform(-2.0 ** -5, 2.0 ** -5, (n, K // per)).astype(np.float16)
        raw[..., at:at + 2] = scales[..., None].view(np.uint8)
    return raw.reshape(n, -1), K


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """gamma_K sum_k |x_k w_k| for each (b, n), plus the float64 reference's own error: x (B, K), w (K, N)."""
    K = x.shape[1]
    gamma = K * 2.0 ** -24 / (1 - K * 2.0 ** -24) + K * 2.0 ** -53
    return gamma * (x.double().abs() @ w.double().abs())


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    assert y.dtype == torch.float32 and y.shape == (x.shape[0], w.shape[1])
    err = (y.double() - x.double() @ w.double()).abs()
    limit = bound(x, w)
    worst = (err - limit).max().item()
    assert worst <= 0, f"error over the fp32 bound by {worst:.3g} (largest error {err.max().item():.3g})"


def reference_weights(raw: np.ndarray, fmt: str) -> torch.Tensor:
    """(K, N): the gguf package's dequantisation of the rows, transposed to (in, out)."""
    return torch.from_numpy(np.ascontiguousarray(dequantize(raw, GGMLQuantizationType[fmt]).T))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("B", [1, 3, 5, 8])
def test_native_kernel_is_the_product_of_gguf_dequantised_weights(fmt, B):
    if quantized_product() is None:
        pytest.skip("the native library is not built on this machine")
    raw, K = blocks_of(fmt, N_ROWS, seed=B)
    m = QuantMatrix("blk.0.ffn_up.weight", fmt, (N_ROWS, K), torch.from_numpy(raw))
    w = reference_weights(raw, fmt)
    assert w.abs().max() > 0 and torch.isfinite(w).all()
    x = torch.randn(B, K, generator=torch.Generator().manual_seed(B))
    check(m.matmul(x), x, w)


@pytest.mark.parametrize("fmt", FORMATS)
def test_native_kernel_multiplies_exactly_gguf_dequantised_weights(fmt):
    """x = the identity: each output is one weight times 1 plus zeros, no rounding at all, so the product is the
    matrix the kernel decoded, which must be gguf's exactly (every tile of four rows of x and the remainder)."""
    if quantized_product() is None:
        pytest.skip("the native library is not built on this machine")
    raw, K = blocks_of(fmt, N_ROWS, seed=9)
    m = QuantMatrix("blk.3.attn_k.weight", fmt, (N_ROWS, K), torch.from_numpy(raw))
    assert torch.equal(m.matmul(torch.eye(K)), reference_weights(raw, fmt))


@pytest.mark.parametrize("fmt", ["Q4_0", "Q6_K"])
def test_native_kernel_gives_the_same_bits_on_any_thread_count(fmt):
    """Each row's dot product is one thread's, in one order, however the rows are shared out."""
    if quantized_product() is None:
        pytest.skip("the native library is not built on this machine")
    raw, K = blocks_of(fmt, N_ROWS, seed=10)
    m = QuantMatrix("blk.4.ffn_gate.weight", fmt, (N_ROWS, K), torch.from_numpy(raw))
    x = torch.randn(6, K, generator=torch.Generator().manual_seed(10))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = m.matmul(x)
        torch.set_num_threads(3)
        three = m.matmul(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, three)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantise_and_multiply_path_is_the_same_product(fmt):
    raw, K = blocks_of(fmt, N_ROWS, seed=11)
    m = QuantMatrix("blk.0.attn_q.weight", fmt, (N_ROWS, K), torch.from_numpy(raw))
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(5))
    check(m.matmul(x, native=False), x, reference_weights(raw, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_is_gguf_bit_for_bit_in_the_engines_layout(fmt):
    raw, K = blocks_of(fmt, N_ROWS, seed=3)
    m = QuantMatrix("output.weight", fmt, (N_ROWS, K), torch.from_numpy(raw))
    w = m.dequantize()
    assert w.shape == (K, N_ROWS) and w.is_contiguous() and w.dtype == torch.float32
    rows = dequantize(raw, GGMLQuantizationType[fmt])                 # (N, K)
    assert np.array_equal(w.numpy().T.view(np.uint32), rows.view(np.uint32))
    assert m.nbytes == raw.nbytes == N_ROWS * K // BLOCKS[fmt][0] * BLOCKS[fmt][1]
    assert torch.equal(m.dequantize(torch.bfloat16), w.to(torch.bfloat16))


def test_leading_dimensions_and_dtype_of_x_are_kept():
    raw, K = blocks_of("Q4_K", N_ROWS, seed=4)
    m = QuantMatrix("blk.1.ffn_down.weight", "Q4_K", (N_ROWS, K), torch.from_numpy(raw))
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(4))
    y = m.matmul(x)
    assert y.shape == (2, 3, N_ROWS)
    assert torch.equal(y, m.matmul(x.reshape(6, K)).reshape(2, 3, N_ROWS))
    yb = m.matmul(x.to(torch.bfloat16))
    assert yb.dtype == torch.bfloat16 and yb.shape == (2, 3, N_ROWS)
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_down\.weight.*must be 768"):
        m.matmul(torch.randn(1, K - 1))


@pytest.mark.parametrize("fmt", ["Q8_0", "Q6_K"])
def test_truncated_blocks_are_refused_naming_the_tensor(fmt):
    raw, K = blocks_of(fmt, N_ROWS, seed=6)
    short = torch.from_numpy(raw.reshape(-1)[:-1].copy())
    with pytest.raises(ModelLoadError, match=rf"tensor blk\.7\.attn_v\.weight: .*{fmt}.*truncated"):
        QuantMatrix("blk.7.attn_v.weight", fmt, (N_ROWS, K), short)
    with pytest.raises(ModelLoadError, match=r"tensor blk\.7\.attn_v\.weight: shape .* not whole"):
        QuantMatrix("blk.7.attn_v.weight", fmt, (N_ROWS, K + 16), torch.from_numpy(raw))


def test_a_type_it_does_not_keep_quantised_is_refused_naming_the_tensor_and_type():
    with pytest.raises(UnsupportedModelError, match=r"tensor blk\.2\.ffn_gate\.weight: quantization type Q2_K"):
        QuantMatrix("blk.2.ffn_gate.weight", "Q2_K", (4, 256), torch.zeros(4 * 84, dtype=torch.uint8))


def test_a_gguf_written_by_the_gguf_package_reads_back_with_the_same_values(tmp_path):
    path = tmp_path / "quantised.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    written = {}
    for i, fmt in enumerate(FORMATS):
        raw, K = blocks_of(fmt, N_ROWS, seed=20 + i)
        written[f"blk.{i}.ffn_up.weight"] = (fmt, raw, K)
        writer.add_tensor(f"blk.{i}.ffn_up.weight", raw, raw_dtype=GGMLQuantizationType[fmt])
    writer.add_tensor("blk.9.ffn_up.weight", np.zeros((4, 512), np.float16))
    stacked, _ = blocks_of("Q8_0", 2 * N_ROWS, seed=30)
    writer.add_tensor("blk.9.ffn_up_exps.weight", stacked.reshape(2, N_ROWS, -1), raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    tensors = {t.name: t for t in open_gguf(path).tensors}
    x = torch.randn(2, 768, generator=torch.Generator().manual_seed(0))
    for name, (fmt, raw, K) in written.items():
        m = QuantMatrix.from_gguf(tensors[name])
        assert (m.name, m.format, m.shape) == (name, fmt, (N_ROWS, K))
        assert np.array_equal(m.blocks.numpy().reshape(-1), raw.reshape(-1))
        w = reference_weights(raw, fmt)
        assert torch.equal(m.dequantize(), w)
        check(m.matmul(x[:, :K].contiguous()), x[:, :K], w)
    with pytest.raises(UnsupportedModelError, match=r"tensor blk\.9\.ffn_up\.weight: quantization type F16"):
        QuantMatrix.from_gguf(tensors["blk.9.ffn_up.weight"])
    with pytest.raises(ModelLoadError, match=r"tensor blk\.9\.ffn_up_exps\.weight: 3 dimensions"):
        QuantMatrix.from_gguf(tensors["blk.9.ffn_up_exps.weight"])
