"""engine.tools.gguf_blocks against the gguf package's own quantize -> dequantize (the reference), element for
element (bit patterns, so -0.0 and 0.0 differ): every format it serves, random matrices with the blocks that
decide signs and scales (all zeros, +m and -m in either order, tiny and huge values), in the engine's (in, out)
layout and as a transposed view; and engine.tools.quant.requantize gives the same whichever path it takes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.tools import gguf_blocks
from engine.tools.quant import requantize

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402


def reference(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the gguf package gives for w (in, out): its rows are w's columns."""
    qt = GGMLQuantizationType[fmt]
    rows = w.t().contiguous().numpy()
    return torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(gguf_quants.quantize(rows, qt), qt))).t()


def matrix(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(128, 40, generator=g)
    w[:32, 0] = 0.0                                                    # a zero block
    w[:32, 1] = -0.0
    w[:16, 2], w[16:32, 2] = -3.0, 3.0                                # -m first
    w[:16, 3], w[16:32, 3] = 3.0, -3.0                                # +m first
    w[32:64, 4] *= 1e-30                                              # float16 scales underflow
    w[32:64, 5] *= 1e4
    w[64:96, 6] = torch.tensor([0.5, -0.5] * 16)                      # exact halves for the rounding
    w[96:128, 7] = torch.linspace(-1, 1, 32)
    return w


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("fmt", gguf_blocks.FORMATS)
def test_the_round_trip_is_the_gguf_packages_bit_for_bit(fmt):
    for seed in range(3):
        w = matrix(seed)
        assert torch.equal(bits(gguf_blocks.round_trip(w, fmt)), bits(reference(w, fmt)))
        view = w.t().contiguous().t()                                  # a transposed view: blocks along its rows
        got = gguf_blocks.round_trip(view, fmt)
        assert got.shape == w.shape and torch.equal(bits(got), bits(reference(w, fmt)))


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")   # gguf casting the NaN
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
def test_requantize_is_the_same_on_either_path(fmt):
    w = matrix(5)
    fast = requantize(w, fmt)
    slow = w.clone()
    slow[0, 9] = float("nan")                                         # a NaN sends the matrix through gguf itself
    back = requantize(slow, fmt)
    assert torch.equal(bits(fast), bits(reference(w, fmt)))
    assert torch.equal(bits(back[:, 10:]), bits(fast[:, 10:]))        # the other columns' blocks are untouched
