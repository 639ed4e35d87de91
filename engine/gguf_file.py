"""A GGUF file's metadata and tensor table, read in one pass: open_gguf(path) -> GGUFFile.

gguf-py's GGUFReader builds a numpy view for every element of every metadata array: for the bundled model's
tokenizer (49,152 tokens and 48,900 merges) about 440,000 views, 3-4 s before anything can be read. The engine reads
what it needs of a GGUF file (engine.gguf_import, engine.gguf_tokenizer) through the part of GGUFReader's interface
kept here: `fields[key].contents()`, `key in fields`, and `tensors` with each tensor's name, tensor_type, shape,
n_elements, n_bytes, data_offset and data (a read-only view of the mapped file, shaped as GGUFReader shapes it: the
element type for float and integer tensors, bytes per row for quantised ones). Strings and arrays are decoded at
once to Python values (an array of arrays as nested lists, where GGUFReader flattens it); tensor data stays in the
file until it is read.

Every length and count is checked against the file's size before it is used, so a truncated or crafted file is
refused with a message naming what is wrong (GGUFError) instead of reading past its end or allocating what it claims.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
MAX_DEPTH = 8                 # arrays of arrays: no file llama.cpp writes nests them at all
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
NUMPY = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8", 11: "i8", 12: "f8"}
# Tensor types stored as plain elements (GGUFReader shapes these by element; every other type by bytes per row).
PLAIN = {"F16": "f2", "F32": "f4", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}


class GGUFError(ValueError):
    """The file is not a GGUF file this reader can read (the message names what is wrong)."""


@dataclass(frozen=True)
class Field:
    """One metadata pair's value: a str, int, float, bool, or a list of them."""
    name: str
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: Any              # gguf.GGMLQuantizationType
    shape: np.ndarray             # the file's dimensions, innermost first (as GGUFReader.shape)
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class _Cursor:
    def __init__(self, buf, order: str) -> None:
        self.buf, self.order, self.at, self.size = buf, order, 0, len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.at + n > self.size:
            raise GGUFError(f"the file ends inside {what} (at byte {self.at:,} of {self.size:,})")

    def scalar(self, code: str, what: str):
        n = struct.calcsize(code)
        self.need(n, what)
        value = struct.unpack_from(self.order + code, self.buf, self.at)[0]
        self.at += n
        return value

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.at:self.at + n])
        self.at += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{what} is not UTF-8 text") from None

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        if kind in SCALARS:
            return self.scalar(SCALARS[kind], what)
        if kind == STRING:
            return self.string(what)
        if kind == ARRAY:
            item, count = self.scalar("I", what), self.scalar("Q", what)
            if item in NUMPY:
                dtype = np.dtype(NUMPY[item]).newbyteorder(self.order)
                self.need(count * dtype.itemsize, what)
                out = np.frombuffer(self.buf, dtype, count, self.at).tolist()
                self.at += count * dtype.itemsize
                return out
            if item in (STRING, ARRAY):
                if depth >= MAX_DEPTH:
                    raise GGUFError(f"{what}: arrays nested more than {MAX_DEPTH} deep")
                self.need(count * 8, what)            # each item takes at least its 8-byte length or header
                return [self.value(item, what, depth + 1) for _ in range(count)]
            raise GGUFError(f"{what}: unknown array item type {item}")
        raise GGUFError(f"{what}: unknown value type {kind}")


class GGUFFile:
    """The metadata (`fields`, in the file's order) and tensor table (`tensors`) of one GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.data = np.memmap(self.path, mode="r") if self.path.stat().st_size else np.zeros(0, np.uint8)
        head = bytes(self.data[:8])
        if len(head) < 8 or head[:4] != MAGIC:
            raise GGUFError("not a GGUF file (it does not start with the bytes 'GGUF' and a version)")
        order = "<" if struct.unpack("<I", head[4:8])[0] & 0xFFFF else ">"    # GGUFReader's test of byte order
        cur = _Cursor(self.data, order)
        cur.at = 4
        version = cur.scalar("I", "the version")
        if version not in VERSIONS:
            raise GGUFError(f"GGUF version {version} is not supported (versions {', '.join(map(str, VERSIONS))})")
        n_tensors, n_fields = cur.scalar("Q", "the tensor count"), cur.scalar("Q", "the metadata count")
        cur.need(n_fields * 13 + n_tensors * 24, "the metadata and tensor table")      # their smallest sizes
        self.fields: dict[str, Field] = {}
        for _ in range(n_fields):
            key = cur.string("a metadata key")
            if key in self.fields:
                raise GGUFError(f"the metadata key {key!r} appears twice")
            self.fields[key] = Field(key, cur.value(cur.scalar("I", key), key))
        self.tensors = self._tensors(cur, n_tensors, order)

    def _tensors(self, cur: _Cursor, n_tensors: int, order: str) -> list[Tensor]:
        """The tensor table (read at cur), each tensor's data a view of the mapped file."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        infos = []
        for _ in range(n_tensors):
            name = cur.string("a tensor name")
            n_dims = cur.scalar("I", name)
            cur.need(n_dims * 8, name)
            dims = [cur.scalar("Q", name) for _ in range(n_dims)]
            infos.append((name, dims, cur.scalar("I", name), cur.scalar("Q", name)))
        align = self.fields["general.alignment"].value if "general.alignment" in self.fields else DEFAULT_ALIGNMENT
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise GGUFError(f"general.alignment {align!r} is not a power of two")
        start = -(-cur.at // align) * align
        tensors: list[Tensor] = []
        seen: set[str] = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise GGUFError(f"the tensor {name!r} appears twice")
            seen.add(name)
            try:
                kind = GGMLQuantizationType(raw_type)
            except ValueError:
                raise GGUFError(f"tensor {name}: unknown type {raw_type}") from None
            n = int(np.prod(dims, dtype=object)) if dims else 1
            block, size = GGML_QUANT_SIZES[kind]
            n_bytes = n * size // block
            at = start + offset
            if at + n_bytes > cur.size:
                raise GGUFError(f"tensor {name}: its {n_bytes:,} bytes at {at:,} lie past the file's end "
                                f"({cur.size:,} bytes)")
            shape = tuple(reversed(dims))
            if kind.name in PLAIN:
                view = self.data[at:at + n_bytes].view(np.dtype(PLAIN[kind.name]).newbyteorder(order)).reshape(shape)
            else:
                view = self.data[at:at + n_bytes].reshape(quant_shape_to_byte_shape(shape, kind))
            tensors.append(Tensor(name, kind, np.array(dims, np.uint64), n, n_bytes, at, view))
        return tensors


def open_gguf(path: str | Path) -> GGUFFile:
    """The GGUF file at `path`, its metadata decoded and its tensors mapped (GGUFError if it cannot be read)."""
    return GGUFFile(path)
