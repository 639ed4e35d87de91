"""engine.rope.apply_rope writes rotate_half(x)*sin into one buffer: the same numbers as the formula
x*cos + rotate_half(x)*sin computed the plain way (transformers' apply_rotary_pos_emb), bit for bit, in every
dtype and for strided views of a fused qkv; and a tensor that requires grad still gets its gradient."""
from __future__ import annotations

import pytest
import torch

from engine.rope import apply_rope


def formula(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_same_numbers_as_the_formula_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(37, 15, 64, generator=g) * 3).to(dtype)
    qkv[0, 0, :4] = torch.tensor([0.0, -0.0, float("inf"), 1e-8])
    x = qkv[:, :12]                                               # the strided view the forward rotates
    cos, sin = torch.randn(37, 1, 64, generator=g).to(dtype), torch.randn(37, 1, 64, generator=g).to(dtype)
    got, want = apply_rope(x, cos, sin), formula(x, cos, sin)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0.0 stays -0.0
    assert torch.equal(qkv[:, :12], x)                             # the input is not written


def test_a_tensor_that_requires_grad_gets_the_formulas_gradient():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 8, generator=g, requires_grad=True)
    cos, sin = torch.randn(5, 1, 8, generator=g), torch.randn(5, 1, 8, generator=g)
    apply_rope(x, cos, sin).pow(2).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    formula(x2, cos, sin).pow(2).sum().backward()
    assert torch.equal(x.grad, x2.grad)
