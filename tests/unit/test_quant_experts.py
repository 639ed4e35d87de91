"""engine.quant_experts.QuantExperts: a stack of experts kept in GGUF blocks. Its dequantised value is the gguf
package's own dequantisation of the stack, expert by expert, in the engine's (E, in, out) layout; each expert's
matrix is a QuantMatrix on that expert's bytes (no copy) whose product meets test_quant_matrix.py's fp32 bound
against a float64 product of those weights; gate | up fuse per expert; a truncated stack and a stack used as one
product are refused naming the tensor. engine.moe.experts_mlp on the kept stacks equals it on their dequantised
floats within the same bound (every expert's rows through engine.matmul.mm)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.errors import ModelLoadError
from engine.moe import experts_mlp, route
from engine.quant_experts import QuantExperts
from tests.unit.test_quant_matrix import blocks_of, bound

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

pytestmark = pytest.mark.unit
E, N = 4, 13


def stack(fmt: str, seed: int, n: int = N) -> tuple[QuantExperts, int, np.ndarray]:
    """(the stack, K, its bytes (E, n, bytes a row)) of E experts' n rows in fmt, each expert's blocks its own."""
    parts = [blocks_of(fmt, n, seed + e) for e in range(E)]
    K = parts[0][1]
    raw = np.stack([p[0] for p in parts])
    return QuantExperts("blk.0.ffn_up_exps.weight", fmt, (E, n, K), torch.from_numpy(raw.reshape(-1).copy())), K, raw


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_each_expert_is_the_gguf_dequantisation_of_its_bytes_and_multiplies_within_the_fp32_bound(fmt):
    experts, K, raw = stack(fmt, 3)
    want = np.stack([dequantize(raw[e], GGMLQuantizationType[fmt]).T for e in range(E)])    # (E, K, N)
    got = experts.dequantize()
    assert got.shape == (E, K, N) and torch.equal(got, torch.from_numpy(np.ascontiguousarray(want)))
    assert len(experts) == E and experts.nbytes == raw.size
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    for e in range(E):
        m = experts[e]
        assert m.shape == (N, K) and m.blocks.data_ptr() == experts.blocks[e].data_ptr()     # a view, no copy
        w = got[e].double()
        err = (m.matmul(x).double() - x.double() @ w).abs()
        assert bool((err <= bound(x, got[e])).all()), (fmt, e, float(err.max()))


def test_gate_and_up_fuse_expert_by_expert():
    gate, K, g_raw = stack("Q8_0", 10)
    up, _, u_raw = stack("Q8_0", 20)
    fused = QuantExperts.fuse("model.layers.0.experts_gate_up", [gate, up])
    assert fused.shape == (E, 2 * N, K)
    for e in range(E):
        assert torch.equal(fused[e].dequantize(), torch.cat([gate[e].dequantize(), up[e].dequantize()], dim=1))
    with pytest.raises(ModelLoadError, match="differ in format"):
        QuantExperts.fuse("x", [gate, stack("Q4_0", 1)[0]])


def test_a_truncated_stack_and_a_stack_as_one_product_are_refused_by_name():
    experts, K, raw = stack("Q4_0", 5)
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_up_exps\.weight.*truncated"):
        QuantExperts("blk.0.ffn_up_exps.weight", "Q4_0", (E, N, K), experts.blocks.reshape(-1)[:-1].clone())
    with pytest.raises(TypeError, match="no one product"):
        experts.matmul(torch.zeros(1, K))


def test_the_experts_mlp_on_kept_stacks_equals_it_on_their_floats():
    fe = 32                                               # Q8_0 rows of down: whole blocks of 32 values
    gate_up, d, _ = stack("Q8_0", 30, n=2 * fe)           # E experts' 2Fe rows of d values
    rng = np.random.default_rng(2)
    down_f = rng.standard_normal((E, d, fe)).astype(np.float32)     # E experts' d rows of Fe values
    down = QuantExperts("blk.0.ffn_down_exps.weight", "Q8_0", (E, d, fe),
                        torch.from_numpy(quantize(down_f, GGMLQuantizationType.Q8_0).reshape(-1).copy()))
    h = torch.randn(6, d, generator=torch.Generator().manual_seed(4))
    gates = route(torch.randn(6, E, generator=torch.Generator().manual_seed(5)), 2, True)
    kept = experts_mlp(h, gates, gate_up, down, F.silu)
    floats = experts_mlp(h, gates, gate_up.dequantize(), down.dequantize(), F.silu)
    # both multiply the same fp32 weights; only the fp32 sums' order differs (bound above, per product), relative
    # to the output's scale: 1e-5 is about 8 times gamma_K for K = 224 and the two products in turn
    scale = float(floats.abs().max())
    assert float((kept - floats).abs().max()) <= 1e-5 * scale, float((kept - floats).abs().max()) / scale
