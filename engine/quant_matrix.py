"""A GGUF weight matrix kept in its quantised blocks: QuantMatrix holds the file's own block bytes (uint8), its
format and its logical shape (N, K) (N rows of K values, as GGUF stores a matrix: out rows of in values), and
multiplies by them without ever holding the matrix in float32, as llama.cpp does: `matmul(x)` is x @ W in the
engine's (in, out) sense, each block decoded inside the native kernel (engine/native/quant.c) where the library is
built, else the whole matrix dequantised (gguf.quants.dequantize) and multiplied. The run then computes with the
file's own weights, not a float copy rounded some other way.

Formats: the 32-value blocks Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the 256-value K-quants Q4_K, Q5_K, Q6_K. Any other type
(Q2_K, Q3_K, the IQ formats, and F16/F32, which are plain tensors to the engine) is refused naming the tensor and
its type; so are block bytes that are not exactly a whole number of blocks for the shape.

Arithmetic (`arithmetic`, engine.quant_int8.ARITHMETICS): "float" multiplies the file's exact weights with x in
float32; "int8" is llama.cpp's product (x rounded to 8 bits once a product, integer dot products: engine.quant_int8,
engine/native/quant_int8.h), for the formats engine.quant_int8.FORMATS. The PyTorch forward (matmul) and the native
decode step read the same field, so both run the same kernel.
tests/unit/test_quant_matrix.py holds every format's kernel to gguf.quants.dequantize and an fp32 product."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.accelerator import quantized_product
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.quant_int8 import ARITHMETICS, FORMATS as INT8_FORMATS, product as int8_product

# Values and bytes of one block per format (gguf.GGML_QUANT_SIZES), the formats quant.c decodes.
BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


def gguf_blocks(tensor, ndim: int, what: str) -> tuple[str, tuple[int, ...], torch.Tensor]:
    """(format, shape outermost first, its block bytes copied out of the mapped file as one uint8 tensor) of one of
    engine.gguf_file's tensors in a format kept quantised (BLOCKS), with ndim dimensions; refused naming the tensor
    otherwise. what: the thing it must be, for the message."""
    fmt = getattr(tensor.tensor_type, "name", str(tensor.tensor_type))
    dims = [int(d) for d in tensor.shape]
    if len(dims) != ndim:
        raise ModelLoadError(f"tensor {tensor.name}: {len(dims)} dimensions {dims}; {what} has {ndim}")
    if fmt not in BLOCKS:
        raise UnsupportedModelError(f"tensor {tensor.name}: quantization type {fmt} is not one the engine keeps "
                                    f"quantised ({', '.join(BLOCKS)})")
    raw = np.asarray(tensor.data)
    if raw.dtype != np.uint8:
        raise ModelLoadError(f"tensor {tensor.name}: its data is {raw.dtype}, not the uint8 block bytes of {fmt}")
    return fmt, tuple(reversed(dims)), torch.from_numpy(np.array(raw, np.uint8).reshape(-1))


@dataclass(frozen=True, eq=False)
class QuantMatrix:
    name: str                  # the tensor's name in the file (every error names it)
    format: str                # a key of BLOCKS
    shape: tuple[int, int]     # (N, K): N rows of K values, as the file stores the matrix
    blocks: torch.Tensor       # uint8 (N, K / block * bytes per block) on the CPU: the file's bytes, row after row
    arithmetic: str = "float"  # how its products are computed (the module's docstring)

    def __post_init__(self) -> None:
        if self.format not in BLOCKS:
            raise UnsupportedModelError(f"tensor {self.name}: quantization type {self.format} is not one the engine "
                                        f"keeps quantised ({', '.join(BLOCKS)})")
        if self.arithmetic not in ARITHMETICS or (
                self.arithmetic == "int8" and self.format not in INT8_FORMATS):
            raise UnsupportedModelError(f"tensor {self.name}: no {self.arithmetic!r} product for {self.format} "
                                        f"(arithmetics {', '.join(ARITHMETICS)}; int8 for "
                                        f"{', '.join(INT8_FORMATS)})")
        N, K = self.shape
        values, size = BLOCKS[self.format]
        if N <= 0 or K <= 0 or K % values:
            raise ModelLoadError(f"tensor {self.name}: shape (N, K) = ({N}, {K}) is not whole {self.format} blocks "
                                 f"(each row must hold a multiple of {values} values)")
        want = N * (K // values) * size
        if self.blocks.dtype != torch.uint8 or self.blocks.numel() != want:
            raise ModelLoadError(f"tensor {self.name}: {self.blocks.numel():,} bytes of {self.format} blocks "
                                 f"({self.blocks.dtype}); ({N}, {K}) takes {want:,} ({N * K // values:,} blocks of "
                                 f"{size} bytes)" + (": truncated" if self.blocks.numel() < want else ""))
        if self.blocks.device.type != "cpu":
            raise ValueError(f"tensor {self.name}: its blocks are on {self.blocks.device}; they are kept on the CPU")
        if self.blocks.shape != (N, want // N) or not self.blocks.is_contiguous():
            object.__setattr__(self, "blocks", self.blocks.contiguous().view(N, want // N))

    @classmethod
    def from_gguf(cls, tensor) -> QuantMatrix:
        """The matrix of one of engine.gguf_file's tensors (GGUFFile.tensors), its bytes copied out of the mapped
        file (so nothing keeps the map alive): a 2-D tensor whose dims, innermost first, are (K, N)."""
        fmt, (N, K), raw = gguf_blocks(tensor, 2, "a quantised matrix")
        return cls(tensor.name, fmt, (N, K), raw)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype its values decode to and its products are computed in (engine.model casts x to a weight's
        dtype before the product)."""
        return torch.float32

    @classmethod
    def cat(cls, name: str, parts: list[QuantMatrix]) -> QuantMatrix:
        """The parts' rows one after another (q, k, v or gate, up fused into one product): rows are whole blocks,
        so the block rows are concatenated as they are. The parts must share a format and a row length."""
        fmts, ks = {p.format for p in parts}, {p.shape[1] for p in parts}
        if len(fmts) != 1 or len(ks) != 1:
            raise ModelLoadError(f"tensor {name}: its parts ({', '.join(p.name for p in parts)}) are "
                                 f"{sorted(fmts)} with row lengths {sorted(ks)}; fused rows need one format and length")
        if len({p.arithmetic for p in parts}) != 1:
            raise ModelLoadError(f"tensor {name}: its parts are multiplied in {sorted({p.arithmetic for p in parts})} "
                                 "arithmetic; fused rows need one")
        return cls(name, parts[0].format, (sum(p.shape[0] for p in parts), parts[0].shape[1]),
                   torch.cat([p.blocks for p in parts]), parts[0].arithmetic)

    def with_arithmetic(self, arithmetic: str) -> QuantMatrix:
        """The same blocks multiplied in `arithmetic` (UnsupportedModelError where the format has no such kernel)."""
        return QuantMatrix(self.name, self.format, self.shape, self.blocks, arithmetic)

    def permute_rows(self, order: torch.Tensor) -> QuantMatrix:
        """The matrix whose row i is this one's row order[i] (llama.cpp's q/k permutation undone: each row is
        whole blocks, so its block bytes move as a unit)."""
        return QuantMatrix(self.name, self.format, self.shape, self.blocks[order].contiguous(), self.arithmetic)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` (any shape of row numbers) dequantised: (*ids.shape, K), gguf.quants.dequantize's values; only
        those rows' blocks are decoded (a token embedding's lookup)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        N, K = self.shape
        flat = ids.reshape(-1).to(torch.long).cpu()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= N):
            raise IndexError(f"tensor {self.name}: row ids must lie in [0, {N}); got "
                             f"{int(flat.min())}..{int(flat.max())}")
        got = dequantize(self.blocks[flat].numpy(), GGMLQuantizationType[self.format])        # (n, K)
        return torch.from_numpy(np.ascontiguousarray(got)).to(dtype).reshape(*ids.shape, K).to(ids.device)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(K, N) in the engine's (in, out) layout, contiguous: gguf.quants.dequantize's values exactly (then dtype)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        rows = dequantize(self.blocks.numpy(), GGMLQuantizationType[self.format])        # (N, K) float32
        return torch.from_numpy(np.ascontiguousarray(rows.T)).to(dtype)

    def matmul(self, x: torch.Tensor, *, native: bool = True) -> torch.Tensor:
        """x (..., K) @ the matrix (K, N) -> (..., N) in x's dtype, summed in float32, in the matrix's arithmetic.
        native: the native kernel on the CPU where the library is built; native=False (or no library, or another
        device) the reference the kernel is tested against: "float" dequantises the whole matrix and multiplies,
        "int8" is engine.quant_int8.product (llama.cpp's integers, summed in float64)."""
        N, K = self.shape
        if x.shape[-1] != K or not x.is_floating_point():
            raise ValueError(f"tensor {self.name}: x {x.dtype} {tuple(x.shape)} cannot multiply a ({K}, {N}) matrix "
                             f"(its last dimension must be {K})")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, K).to(torch.float32)                                       # (B, K)
        product = quantized_product() if native and x.device.type == "cpu" else None
        if product is not None:
            y = product(self.format, self.blocks, N, K, x2, self.arithmetic)            # (B, N)
        elif self.arithmetic == "int8":
            ref = int8_product(self.format, self.blocks.numpy(), N, K, x2.detach().cpu().numpy())[0]
            y = torch.from_numpy(ref.astype(np.float32)).to(x.device)
        else:
            y = x2 @ self.dequantize().to(x.device)
        return y.to(x.dtype).reshape(*lead, N)
