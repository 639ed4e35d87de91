"""A GGUF file's metadata and tensor table, read in one pass: open_gguf(path) -> GGUFFile.

gguf-py's GGUFReader builds a numpy view for every element of every metadata array: for the bundled model's
tokenizer (49,152 tokens and 48,900 merges) about 440,000 views, 3-4 s before anything can be read. The engine reads
what it needs of a GGUF file (engine.gguf_import, engine.gguf_tokenizer) through the part of GGUFReader's interface
kept here: `fields[key].contents()`, `key in fields`, and `tensors` with each tensor's name, tensor_type, shape,
n_elements, n_bytes, data_offset and data (a read-only view of the mapped file, shaped as GGUFReader shapes it: the
element type for float and integer tensors, bytes per row for quantised ones). Strings and arrays of them are decoded
at once to Python values (an array of arrays as nested lists, where GGUFReader flattens it); an array of numbers stays
a view of the mapped file until contents() lists it, and tensor data stays in the file until it is read.

Every length and count is checked against the file's size before it is used, so a truncated or crafted file is
refused with a message naming what is wrong (GGUFError) instead of reading past its end or allocating what it claims.
Within the file's size, what the metadata may hold is bounded too (the MAX_* below), before anything is decoded: a
value decoded costs a Python object of 8 to 60 bytes however few bytes it takes in the file, so one array of 5x10^8
bytes would become a 4 GB list and 8x10^6 empty arrays 26 s of decoding. Only the tokenizer's lists may be as long
as a vocabulary; such a file is refused in milliseconds, naming the key, without its body ever being read.
"""
from __future__ import annotations

import mmap
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
# The bounds on what a file's metadata and tensor table may hold (see the module's docstring). The tokenizer's lists
# are as long as its vocabulary (the largest llama.cpp meets, Gemma 3's, has 262,144 tokens); precompiled_charsmap is
# a sentencepiece normaliser's table of bytes (T5's: 237,539). No other key llama.cpp writes holds more than a few
# hundred values (per-layer lists, tags, languages), nor more text than a chat template (kilobytes) or an embedded
# tokenizer.huggingface.json (megabytes).
VOCAB_LISTS = frozenset(f"tokenizer.ggml.{k}" for k in ("tokens", "scores", "token_type", "merges",
                                                         "precompiled_charsmap"))
MAX_VOCAB = 1 << 22           # entries in one tokenizer list of strings or numbers
MAX_VOCAB_TEXT = 1 << 27      # bytes of text in the tokenizer lists together
MAX_ITEMS = 1 << 16           # entries in any other array (at each level of nesting)
MAX_VALUES = 1 << 20          # array entries in all other metadata together, nested ones included
MAX_TEXT = 1 << 26            # bytes of text in all other metadata together, its keys included
MAX_KEYS = 1 << 16            # metadata keys: llama.cpp writes about 40
MAX_TENSORS = 1 << 16         # llama.cpp stacks a layer's experts in one tensor: the largest models have ~2,000
MAX_DIMS = 4                  # GGML_MAX_DIMS: llama.cpp's own reader refuses more
MAX_NAMES = MAX_TENSORS * 64  # bytes of tensor names in all (GGML_MAX_NAME: a name holds at most 63)
# Tensor types stored as plain elements (GGUFReader shapes these by element; every other type by bytes per row).
PLAIN = {"F16": "f2", "F32": "f4", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}


class GGUFError(ValueError):
    """The file is not a GGUF file this reader can read (the message names what is wrong)."""


@dataclass(frozen=True)
class Field:
    """One metadata pair's value: a str, int, float, bool, or a list of them. An array of numbers stays a read-only
    view of the mapped file until contents() makes it a list (as GGUFReader gives it): the engine reads a few such
    keys, and a vocabulary's scores as Python floats are 8 times their bytes."""
    name: str
    value: Any

    def contents(self) -> Any:
        return self.value.tolist() if isinstance(self.value, np.ndarray) else self.value


class _Budget:
    """What one kind of metadata may still hold: each array's entries, the entries and the bytes of text in all."""

    def __init__(self, kind: str, per_array: int, values: int, text: int) -> None:
        self.kind, self.per_array, self.values, self.text = kind, per_array, values, text
        self.values_left, self.text_left = values, text

    def entries(self, count: int, what: str) -> None:
        if count > self.per_array:
            raise GGUFError(f"{what}: an array of {count:,} entries; {self.kind} holds at most {self.per_array:,}")
        self.values_left -= count
        if self.values_left < 0:
            raise GGUFError(f"{what}: {self.kind} holds more than {self.values:,} array entries in all")

    def text_bytes(self, n: int, what: str) -> None:
        self.text_left -= n
        if self.text_left < 0:
            raise GGUFError(f"{what}: {self.kind} holds more than {self.text:,} bytes of text in all")


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
    """Reads the file's header at `at`, every read checked against the bytes left and the metadata's budgets."""

    def __init__(self, buf: np.ndarray, order: str) -> None:
        self.buf, self.order, self.at, self.size = buf, order, 0, len(buf)
        self.bytes = memoryview(buf)          # a string from a memoryview's slice: 0.17 us; from a memmap's: 1.3 us
        self.u64 = struct.Struct(order + "Q").unpack_from
        # each tokenizer list is bounded by itself: together they hold no more than each at its bound
        self.vocab = _Budget("a tokenizer list", MAX_VOCAB, MAX_VOCAB * len(VOCAB_LISTS), MAX_VOCAB_TEXT)
        self.other = _Budget("metadata other than the tokenizer's lists", MAX_ITEMS, MAX_VALUES, MAX_TEXT)
        self.names = _Budget("the tensor table", 0, 0, MAX_NAMES)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.at + n > self.size:
            raise GGUFError(f"the file ends inside {what} (at byte {self.at:,} of {self.size:,})")

    def scalar(self, code: str, what: str):
        n = struct.calcsize(code)
        self.need(n, what)
        value = struct.unpack_from(self.order + code, self.buf, self.at)[0]
        self.at += n
        return value

    def string(self, what: str, budget: _Budget) -> str:
        n = self.scalar("Q", what)
        self.need(n, what)
        budget.text_bytes(n, what)
        try:
            text = str(self.bytes[self.at:self.at + n], "utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{what} is not UTF-8 text") from None
        self.at += n
        return text

    def strings(self, count: int, what: str, budget: _Budget) -> list[str]:
        """An array's `count` strings: string() in one loop (a vocabulary holds hundreds of thousands)."""
        out, view, u64, size, at, left = [], self.bytes, self.u64, self.size, self.at, budget.text_left
        try:
            for _ in range(count):
                n = u64(view, at)[0] if at + 8 <= size else -1
                if not 0 <= n <= min(size - at - 8, left):
                    break
                out.append(str(view[at + 8:at + 8 + n], "utf-8"))
                at, left = at + 8 + n, left - n
        except UnicodeDecodeError:
            raise GGUFError(f"{what} is not UTF-8 text") from None
        self.at, budget.text_left = at, left
        if len(out) < count:
            self.string(what, budget)                 # the string that overruns the file or the budget: raises
        return out

    def value(self, kind: int, what: str, budget: _Budget, depth: int = 0) -> Any:
        """One value of type `kind`; an array's length charged to `budget` before any of it is decoded."""
        if kind in SCALARS:
            return self.scalar(SCALARS[kind], what)
        if kind == STRING:
            return self.string(what, budget)
        if kind == ARRAY:
            item, count = self.scalar("I", what), self.scalar("Q", what)
            if item in NUMPY:
                dtype = np.dtype(NUMPY[item]).newbyteorder(self.order)
                self.need(count * dtype.itemsize, what)
                budget.entries(count, what)
                out = self.buf[self.at:self.at + count * dtype.itemsize].view(dtype)
                self.at += count * dtype.itemsize
                return out if depth == 0 else out.tolist()      # nested: GGUFReader-shaped lists of lists
            if item in (STRING, ARRAY):
                if depth >= MAX_DEPTH:
                    raise GGUFError(f"{what}: arrays nested more than {MAX_DEPTH} deep")
                self.need(count * 8, what)            # each item takes at least its 8-byte length or header
                if item == STRING:
                    budget.entries(count, what)
                    return self.strings(count, what, budget)
                self.other.entries(count, what)       # only a flat list may be as long as a vocabulary
                return [self.value(item, what, self.other, depth + 1) for _ in range(count)]
            raise GGUFError(f"{what}: unknown array item type {item}")
        raise GGUFError(f"{what}: unknown value type {kind}")


class GGUFFile:
    """The metadata (`fields`, in the file's order) and tensor table (`tensors`) of one GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = None
        if self.path.stat().st_size:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.zeros(0, np.uint8) if self._map is None else np.frombuffer(self._map, np.uint8)
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
        if n_fields > MAX_KEYS:
            raise GGUFError(f"the file says it holds {n_fields:,} metadata keys; at most {MAX_KEYS:,} are read")
        if n_tensors > MAX_TENSORS:
            raise GGUFError(f"the file says it holds {n_tensors:,} tensors; at most {MAX_TENSORS:,} are read")
        self.fields: dict[str, Field] = {}
        for _ in range(n_fields):
            key = cur.string("a metadata key", cur.other)
            if key in self.fields:
                raise GGUFError(f"the metadata key {key!r} appears twice")
            kind = cur.scalar("I", key)
            self.fields[key] = Field(key, cur.value(kind, key, cur.vocab if key in VOCAB_LISTS else cur.other))
        self.tensors = self._tensors(cur, n_tensors, order)

    def release(self, tensor: "Tensor") -> None:
        """Drop the pages of tensor's bytes from this process's memory once they have been copied out (they stay in
        the kernel's page cache, and a later read of the view maps them again): a loader that copies every tensor
        otherwise holds the whole file mapped beside its copies until the end, twice the weights' size at its peak
        (the 8B-shaped Q4_K file: 8.6 GB for 4.5 GB of blocks)."""
        if self._map is None or tensor.n_bytes == 0:
            return
        page = mmap.PAGESIZE
        start = tensor.data_offset // page * page
        self._map.madvise(mmap.MADV_DONTNEED, start, tensor.data_offset + tensor.n_bytes - start)

    def _tensors(self, cur: _Cursor, n_tensors: int, order: str) -> list[Tensor]:
        """The tensor table (read at cur), each tensor's data a view of the mapped file."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        infos = []
        for _ in range(n_tensors):
            name = cur.string("a tensor name", cur.names)
            n_dims = cur.scalar("I", name)
            cur.need(n_dims * 8, name)
            if n_dims > MAX_DIMS:
                raise GGUFError(f"tensor {name}: {n_dims:,} dimensions; GGML tensors have at most {MAX_DIMS}")
            dims = [cur.scalar("Q", name) for _ in range(n_dims)]
            infos.append((name, dims, cur.scalar("I", name), cur.scalar("Q", name)))
        align = self.fields["general.alignment"].contents() if "general.alignment" in self.fields else DEFAULT_ALIGNMENT
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
