"""quant_ops.h's row dot product (q_dot: the one-row product of QuantMatrix.matmul and of decode.c's native step)
for every format on rows long enough to take each path its AVX-512 kernels have: the 32-value formats' chunks of
sixteen blocks (their fp16 scales gathered at once) whole, with a tail of 1-15 blocks after them, and alone; the
K-quants over one, five and 21 super-blocks (their scales too are unpacked sixteen super-blocks at a time).
test_quant_matrix.py's rows are 7 blocks (a tail only) or 3 super-blocks, and its identity products are four rows of
x at a time (quant.c's tiles, never the row dot).

The blocks are random bytes (every code, every fifth or top bit, every packed 6-bit K-quant scale and min) with each
block's fp16 scales (and minimum) overwritten by a different small finite value, so a scale taken from the wrong
block or the wrong lane of a chunk changes the product. Known answer: gguf.quants.dequantize's weights and a float64
product.

Tolerances, two:
- x = rows of the identity, one to three at a time (the row dot, never a tile): each output is one weight times 1
  plus products with 0. Every decoded weight is exact in fp32 (quant.c's header), its product with 1 is exact, Q8_0's
  d (q . e_k) = d q is exact, and adding zeros is exact, so the result must equal gguf's weights bit for bit.
- x random: each weight exact, the only error is the fp32 dot product's over K terms, whatever its order:
  |fl(x.w) - x.w| <= gamma_K sum_k |x_k w_k|, gamma_K = K u / (1 - K u), u = 2^-24 (Higham 3.1), plus the float64
  reference's own K 2^-53 (test_quant_matrix.bound)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.accelerator import quantized_product
from engine.quant_matrix import QuantMatrix
from tests.unit.test_quant_matrix import check, reference_weights

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

pytestmark = pytest.mark.unit

# byte offsets of each block's fp16 scale (and minimum)
SCALES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
          "Q6_K": (208,)}
# blocks a row: one chunk of sixteen whole; a chunk and a tail of 5; two chunks and a tail of 15; a tail alone (1)
# (the K-quants' scales are unpacked sixteen super-blocks at a time as well)
ROW_BLOCKS = {fmt: (16, 21, 47, 1) for fmt in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")}
ROW_BLOCKS |= {fmt: (1, 5, 21) for fmt in ("Q4_K", "Q5_K", "Q6_K")}     # K-quants: 16 at a time too
CASES = [(fmt, nb) for fmt, nbs in ROW_BLOCKS.items() for nb in nbs]
N_ROWS = 6


def random_rows(fmt: str, nb: int, seed: int) -> tuple[QuantMatrix, torch.Tensor]:
    """The matrix (N_ROWS rows of nb blocks) and gguf's dequantisation of it, (K, N)."""
    rng = np.random.default_rng(seed)
    per, size = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    raw = rng.integers(0, 256, (N_ROWS, nb, size), dtype=np.uint8)
    for at in SCALES[fmt]:
        scales = rng.uniform(-2.0 ** -4, 2.0 ** -4, (N_ROWS, nb)).astype(np.float16)
        raw[..., at:at + 2] = scales[..., None].view(np.uint8)
    raw = raw.reshape(N_ROWS, -1)
    m = QuantMatrix("blk.1.ffn_down.weight", fmt, (N_ROWS, nb * per), torch.from_numpy(raw))
    return m, reference_weights(raw, fmt)


def native():
    if quantized_product() is None:
        pytest.skip("the native library is not built on this machine")


@pytest.mark.parametrize("fmt,nb", CASES)
def test_row_dot_multiplies_exactly_gguf_dequantised_weights(fmt, nb):
    native()
    m, w = random_rows(fmt, nb, seed=nb)
    assert torch.isfinite(w).all() and w.abs().max() > 0
    K = m.shape[1]
    parts = []
    for k in range(0, K, 3):                                      # B = 3 rows of the identity (the last: 1 to 3)
        eye = torch.zeros(min(3, K - k), K)
        eye[torch.arange(eye.shape[0]), torch.arange(k, k + eye.shape[0])] = 1.0
        parts.append(m.matmul(eye))
    got = torch.cat(parts)
    assert torch.equal(got, w), f"{(got != w).sum().item()} of {w.numel()} weights differ from gguf's"


@pytest.mark.parametrize("fmt,nb", CASES)
@pytest.mark.parametrize("B", [1, 2])
def test_row_dot_is_the_product_of_gguf_dequantised_weights(fmt, nb, B):
    native()
    m, w = random_rows(fmt, nb, seed=100 + nb)
    x = torch.randn(B, m.shape[1], generator=torch.Generator().manual_seed(nb + B))
    check(m.matmul(x), x, w)
