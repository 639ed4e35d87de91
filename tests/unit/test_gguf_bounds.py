"""engine.gguf_file bounds what a GGUF file's metadata and tensor table may hold, and refuses a file that claims more
before decoding any of it, naming the key and what is wrong: one array of 5x10^8 bytes (a 4 GB list once decoded)
and 8x10^6 empty arrays (26 s of decoding) cost next to no memory, their bodies never read. The tokenizer's lists
may still be as long as a vocabulary. (Files as gguf-py reads them: tests/reference/test_gguf_file.py.)"""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import ModelLoadError
from engine.gguf_file import (MAX_ITEMS, MAX_KEYS, MAX_NAMES, MAX_TENSORS, MAX_TEXT, MAX_VALUES, MAX_VOCAB,
                              MAX_VOCAB_TEXT, GGUFError, open_gguf)
from engine.gguf_import import import_gguf

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
U8, I32, F32, STRING, ARRAY = 0, 5, 6, 8, 9


def crafted(*parts: bytes) -> bytes:
    return b"GGUF" + struct.pack("<I", 3) + b"".join(parts)


def kv(key: bytes, kind: int, value: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key + struct.pack("<I", kind) + value


def array(item: int, count: int) -> bytes:
    """An array's header: its item type and count (its items follow)."""
    return struct.pack("<IQ", item, count)


def text(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def sparse(path: Path, head: bytes, size: int) -> Path:
    """A file of `size` bytes: `head`, then zeros the file system keeps as a hole (neither written nor held). Zeros
    read as empty uint8 arrays, as strings of NULs, or as numbers 0, whatever the head says follows."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return path


def tensor_info(name: bytes, dims: tuple[int, ...]) -> bytes:
    return text(name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims) + struct.pack("<IQ", 0, 0)   # F32 at 0


# Measured in a process of its own: its peak memory (ru_maxrss, the file's mapped pages included) before and after
# open_gguf, under a data limit of 1.5x the file's size over what it already holds, so a reader that decodes what
# the file claims fails at once with MemoryError instead of taking gigabytes of the shared machine.
_MEASURE = r"""
import json, resource, sys, time
import gguf                                     # the tensor table's import: the process's cost, not the file's
from engine.gguf_file import GGUFError, open_gguf
path, size = sys.argv[1], int(sys.argv[2])
held = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmData:"))
hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
soft = held + size * 3 // 2
resource.setrlimit(resource.RLIMIT_DATA, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
before, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
try:
    open_gguf(path)
    error = None
except GGUFError as e:
    error = str(e)
except MemoryError:
    error = "MemoryError"
seconds = time.perf_counter() - t0
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
print(json.dumps({"error": error, "grew": grew, "seconds": seconds}))
"""


@pytest.mark.parametrize(("key", "item", "count", "size_of_each"), [
    ("test.blob", U8, 5 * 10**8, 1),              # one array of 5x10^8 bytes: a 500 MB file
    ("test.nest", ARRAY, 8 * 10**6, 12),          # 8x10^6 empty arrays (each an item type and a count): 96 MB
])
def test_a_huge_array_is_refused_naming_its_key_without_reading_it(tmp_path, key, item, count, size_of_each):
    head = crafted(struct.pack("<QQ", 0, 1), kv(key.encode(), ARRAY, array(item, count)))
    size = len(head) + count * size_of_each
    path = sparse(tmp_path / "huge.gguf", head, size)
    r = subprocess.run([sys.executable, "-c", _MEASURE, str(path), str(size)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert got["error"] is not None and key in got["error"] and f"{count:,} entries" in got["error"], got
    # The bound is 1.5x the file (750 and 144 MB); refused before decoding, the process grows by next to
    # nothing: not even the file's body is paged in (decoding 8x10^6 arrays would read all 96 MB of it).
    assert got["grew"] < 16 * 2**20 < size * 3 // 2, got
    with pytest.raises(ModelLoadError, match=f"not a readable GGUF file: {key}: an array of {count:,} entries"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def many_keys(n: int) -> bytes:
    return crafted(struct.pack("<QQ", 0, n), *(kv(b"k%d" % i, U8, b"\0") for i in range(n)))


def many_tensors(n: int) -> bytes:
    return crafted(struct.pack("<QQ", n, 0), *(tensor_info(b"t%d" % i, (1,)) for i in range(n)))


def arrays_in_all(n_full: int) -> bytes:
    """n_full keys each with an array as long as allowed, then one more entry in a key of its own."""
    full = (kv(b"test.k%d" % i, ARRAY, array(U8, MAX_ITEMS) + bytes(MAX_ITEMS)) for i in range(n_full))
    return crafted(struct.pack("<QQ", 0, n_full + 1), *full, kv(b"test.last", ARRAY, array(U8, 1) + b"\0"))


# name: (the file's head, the size the file is made up to with zeros, what the refusal says)
CASES = {
    "too many keys": (many_keys(MAX_KEYS + 1), 0, f"{MAX_KEYS + 1:,} metadata keys; at most {MAX_KEYS:,}"),
    "too many tensors": (many_tensors(MAX_TENSORS + 1), 64,
                         f"{MAX_TENSORS + 1:,} tensors; at most {MAX_TENSORS:,}"),
    "too many dimensions": (crafted(struct.pack("<QQ", 1, 0), tensor_info(b"t5", (1,) * 5)), 64,
                            "tensor t5: 5 dimensions; GGML tensors have at most 4"),
    "a long array": (crafted(struct.pack("<QQ", 0, 1), kv(b"test.blob", ARRAY, array(U8, MAX_ITEMS + 1))),
                     MAX_ITEMS + 1, f"test.blob: an array of {MAX_ITEMS + 1:,} entries; metadata other than the "
                                    f"tokenizer's lists holds at most {MAX_ITEMS:,}"),
    "too many array entries in all": (arrays_in_all(MAX_VALUES // MAX_ITEMS), 0,
                                      f"test.last: metadata other than the tokenizer's lists holds more than "
                                      f"{MAX_VALUES:,} array entries in all"),
    "a nested array under a tokenizer key": (
        crafted(struct.pack("<QQ", 0, 1), kv(b"tokenizer.ggml.tokens", ARRAY, array(ARRAY, MAX_ITEMS + 1))),
        12 * (MAX_ITEMS + 1), f"tokenizer.ggml.tokens: an array of {MAX_ITEMS + 1:,} entries; metadata other"),
    "a tokenizer list longer than a vocabulary": (
        crafted(struct.pack("<QQ", 0, 1), kv(b"tokenizer.ggml.scores", ARRAY, array(F32, MAX_VOCAB + 1))),
        4 * (MAX_VOCAB + 1), f"tokenizer.ggml.scores: an array of {MAX_VOCAB + 1:,} entries; a tokenizer list "
                             f"holds at most {MAX_VOCAB:,}"),
    "a long text": (crafted(struct.pack("<QQ", 0, 1), kv(b"tokenizer.chat_template", STRING,
                                                         struct.pack("<Q", MAX_TEXT + 1))),
                    MAX_TEXT + 1, f"tokenizer.chat_template: metadata other than the tokenizer's lists holds more "
                                  f"than {MAX_TEXT:,} bytes of text"),
    "a long token": (crafted(struct.pack("<QQ", 0, 1), kv(b"tokenizer.ggml.tokens", ARRAY, array(STRING, 2)
                                                          + text(b"ok") + struct.pack("<Q", MAX_VOCAB_TEXT))),
                     MAX_VOCAB_TEXT, f"tokenizer.ggml.tokens: a tokenizer list holds more than {MAX_VOCAB_TEXT:,} "
                                     f"bytes of text"),
    "a long tensor name": (crafted(struct.pack("<QQ", 1, 0), struct.pack("<Q", MAX_NAMES + 1)), MAX_NAMES + 1,
                           f"a tensor name: the tensor table holds more than {MAX_NAMES:,} bytes"),
    "a token that is not UTF-8": (crafted(struct.pack("<QQ", 0, 1), kv(b"tokenizer.ggml.tokens", ARRAY,
                                                                       array(STRING, 2) + text(b"a") + text(b"\xff"))),
                                  0, "tokenizer.ggml.tokens is not UTF-8"),
    "a token past the file's end": (crafted(struct.pack("<QQ", 0, 1), kv(b"tokenizer.ggml.tokens", ARRAY,
                                                                         array(STRING, 2) + text(b"a")
                                                                         + struct.pack("<Q", 99) + b"b")),
                                    0, "the file ends inside tokenizer.ggml.tokens"),
}


@pytest.mark.parametrize("name", CASES)
def test_a_file_that_claims_too_much_is_refused_naming_what(tmp_path, name):
    head, size, message = CASES[name]
    path = sparse(tmp_path / "crafted.gguf", head, len(head) + size)
    with pytest.raises(GGUFError) as e:
        open_gguf(path)
    assert message in str(e.value)


def test_the_tokenizer_lists_may_be_as_long_as_a_vocabulary(tmp_path):
    n = 2 * MAX_ITEMS                                     # longer than any other key may be
    tokens = [f"t{i}é" for i in range(n)]
    raw = b"".join(text(t.encode()) for t in tokens)
    types = struct.pack(f"<{n}i", *(i % 7 for i in range(n)))
    head = crafted(struct.pack("<QQ", 0, 4),
                   kv(b"tokenizer.ggml.tokens", ARRAY, array(STRING, n) + raw),
                   kv(b"tokenizer.ggml.token_type", ARRAY, array(I32, n) + types),
                   kv(b"test.bytes", ARRAY, array(U8, MAX_ITEMS) + bytes(range(256)) * (MAX_ITEMS // 256)),
                   kv(b"test.words", ARRAY, array(STRING, 3) + text(b"") + text(b"a b") + text("ß".encode())))
    f = open_gguf(sparse(tmp_path / "vocab.gguf", head, len(head) + 64))
    assert f.fields["tokenizer.ggml.tokens"].contents() == tokens
    assert f.fields["tokenizer.ggml.token_type"].contents() == [i % 7 for i in range(n)]
    assert f.fields["test.bytes"].contents() == list(range(256)) * (MAX_ITEMS // 256)    # exactly the bound
    assert f.fields["test.words"].contents() == ["", "a b", "ß"]
