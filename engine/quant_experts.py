"""A mixture-of-experts slot kept in a GGUF file's quantised blocks: QuantExperts holds E experts' matrices of one
slot (Mixtral's and Qwen3-MoE's ffn_gate_exps / ffn_up_exps / ffn_down_exps, stacked by llama.cpp's converters into
one tensor each) as one uint8 tensor (E, N, bytes of a row), expert after expert, in the file's own bytes.

It is a QuantMatrix to everything that handles a matrix kept in its blocks (its name, format, block bytes and byte
count, its dequantised value, a weight override on it), but it is no single product: `experts[e]` is expert e's
QuantMatrix (N rows of K values, a view of the stack's bytes, no copy), which engine.moe multiplies through
engine.matmul.mm like any other kept matrix, for the experts a token chose only. `dequantize()` is the stack in the
engine's float layout (E, K, N), what a float model holds in the slot (engine.weights: experts_gate_up (E, d, 2Fe),
experts_down (E, Fe, d)). tests/unit/test_quant_experts.py holds it to gguf.quants.dequantize."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.quant_matrix import BLOCKS, QuantMatrix, gguf_blocks


@dataclass(frozen=True, eq=False)
class QuantExperts(QuantMatrix):
    """shape: (E, N, K), E experts of N rows of K values; blocks: uint8 (E, N, K / block * bytes per block)."""

    def __post_init__(self) -> None:
        if self.format not in BLOCKS:
            raise UnsupportedModelError(f"tensor {self.name}: quantization type {self.format} is not one the engine "
                                        f"keeps quantised ({', '.join(BLOCKS)})")
        if len(self.shape) != 3:
            raise ModelLoadError(f"tensor {self.name}: a stack of experts has 3 dimensions (E, N, K), not "
                                 f"{tuple(self.shape)}")
        E, N, K = self.shape
        values, size = BLOCKS[self.format]
        if E <= 0 or N <= 0 or K <= 0 or K % values:
            raise ModelLoadError(f"tensor {self.name}: shape (E, N, K) = ({E}, {N}, {K}) is not whole {self.format} "
                                 f"blocks (each row must hold a multiple of {values} values)")
        row = K // values * size
        if self.blocks.dtype != torch.uint8 or self.blocks.numel() != E * N * row:
            raise ModelLoadError(f"tensor {self.name}: {self.blocks.numel():,} bytes of {self.format} blocks "
                                 f"({self.blocks.dtype}); ({E}, {N}, {K}) takes {E * N * row:,}"
                                 + (": truncated" if self.blocks.numel() < E * N * row else ""))
        if self.blocks.device.type != "cpu":
            raise ValueError(f"tensor {self.name}: its blocks are on {self.blocks.device}; they are kept on the CPU")
        blocks = self.blocks.contiguous().view(E, N, row)
        object.__setattr__(self, "blocks", blocks)
        # each expert's matrix: a view of its rows of the stack (validated once, here)
        object.__setattr__(self, "_experts", tuple(QuantMatrix(f"{self.name} expert {e}", self.format, (N, K),
                                                               blocks[e], self.arithmetic) for e in range(E)))

    def __getitem__(self, e: int) -> QuantMatrix:
        return self._experts[e]

    def __len__(self) -> int:
        return self.shape[0]

    @classmethod
    def from_gguf(cls, tensor) -> QuantExperts:
        """A stacked-experts tensor of engine.gguf_file (dims innermost first (K, N, E)), its bytes copied out of
        the mapped file."""
        fmt, (E, N, K), raw = gguf_blocks(tensor, 3, "a stack of experts")
        return cls(tensor.name, fmt, (E, N, K), raw)

    @classmethod
    def fuse(cls, name: str, parts: list[QuantExperts]) -> QuantExperts:
        """Each expert's rows of the parts one after another (gate | up fused into one product per expert, as a
        float model's experts_gate_up): the parts must share a format, an expert count and a row length."""
        keys = {(p.format, p.shape[0], p.shape[2]) for p in parts}
        if len(keys) != 1:
            raise ModelLoadError(f"tensor {name}: its parts ({', '.join(p.name for p in parts)}) differ in format, "
                                 "expert count or row length; fused experts need one of each")
        fmt, E, K = keys.pop()
        if len({p.arithmetic for p in parts}) != 1:
            raise ModelLoadError(f"tensor {name}: its parts are multiplied in {sorted({p.arithmetic for p in parts})} "
                                 "arithmetic; fused experts need one")
        return cls(name, fmt, (E, sum(p.shape[1] for p in parts), K), torch.cat([p.blocks for p in parts], dim=1),
                   parts[0].arithmetic)

    def with_arithmetic(self, arithmetic: str) -> QuantExperts:
        """The same stack, each expert multiplied in `arithmetic` (QuantMatrix checks the format has that kernel)."""
        return QuantExperts(self.name, self.format, self.shape, self.blocks, arithmetic)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(E, K, N) in the engine's (in, out) layout per expert: gguf.quants.dequantize's values (then dtype)."""
        return torch.stack([m.dequantize(dtype) for m in self._experts])

    def matmul(self, x: torch.Tensor, *, native: bool = True) -> torch.Tensor:
        raise TypeError(f"tensor {self.name}: a stack of experts is no one product; multiply one expert's matrix "
                        "(experts[e], engine.moe)")

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise TypeError(f"tensor {self.name}: a stack of experts has no embedding rows")

    def permute_rows(self, order: torch.Tensor) -> QuantMatrix:
        raise TypeError(f"tensor {self.name}: a stack of experts' rows are not permuted (no q/k rows)")
