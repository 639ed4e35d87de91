"""engine.bench.quant_kernels --stream: each kernel's products read their rows from memory, not the caches: every
format (and the fp32 floor) multiplies distinct copies of its matrix, together at least the asked size and no more
copies than that takes, and the copies are the matrix's own bytes (each copy's product is the matrix's, bit for
bit: the same rows, the same sums). The formats with llama.cpp's arithmetic are measured in it too ("Q4_K int8"), on
the same copies."""
from __future__ import annotations

import math

import pytest
import torch

from engine.accelerator import quantized_product
from engine.bench.quant_kernels import _copies, random_matrix, stream
from engine.quant_int8 import FORMATS as INT8_FORMATS
from engine.quant_matrix import BLOCKS, QuantMatrix

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def native():
    if quantized_product() is None:
        pytest.skip("the native library is not built")


def test_stream_covers_the_asked_bytes_in_the_fewest_copies():
    N, K, mb = 64, 512, 1
    r = stream(N, K, megabytes=mb, rounds=1)
    assert set(r["kernels"]) == {"fp32 (floor)", *BLOCKS, *(f"{f} int8" for f in INT8_FORMATS)}
    for name, k in r["kernels"].items():
        fmt = name.removesuffix(" int8")
        per, size = BLOCKS[fmt] if fmt in BLOCKS else (1, 4)
        assert k["bytes"] == N * K // per * size, name          # one matrix's stored bytes, hand computed
        assert k["copies"] == math.ceil(mb * 10**6 / k["bytes"]), name
        assert k["ms"] > 0 and k["Gvalues/s"] > 0, name


def test_copies_are_distinct_memory_with_the_matrix_bytes():
    m = random_matrix("Q4_K", 16, 512)
    copies = _copies(m.blocks, 3 * m.nbytes)
    assert len(copies) == 3
    assert len({c.data_ptr() for c in copies} | {m.blocks.data_ptr()}) == 4
    x = torch.randn(1, 512)
    want = m.matmul(x)
    for c in copies:
        assert torch.equal(QuantMatrix(m.name, "Q4_K", m.shape, c).matmul(x), want)
