"""engine.gguf_file reads a GGUF file as gguf-py's GGUFReader (llama.cpp's own Python reader) does: every metadata
value and every tensor (name, type, dimensions, sizes, offset, and the data view: dtype, shape, bytes), on the
bundled model and on a file holding every value type and several tensor types; and it refuses a truncated or
crafted file with a message naming what is wrong, before reading past the end or allocating what the file claims."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from engine.errors import ModelLoadError
from engine.gguf_file import GGUFError, open_gguf
from engine.gguf_import import import_gguf
from tests.unit.test_gguf_bounds import crafted, kv

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.reference
PSEUDO = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")       # GGUFReader's own entries, not the file's


def assert_same(ours, ref) -> None:
    assert list(ours.fields) == [k for k in ref.fields if k not in PSEUDO]
    for key, field in ours.fields.items():
        assert field.contents() == ref.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
            (b.tensor_type, b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.shape.tolist() == b.shape.tolist(), a.name
        assert (a.data.dtype, a.data.shape) == (b.data.dtype, b.data.shape), a.name
        assert a.data.tobytes() == b.data.tobytes(), a.name


def test_the_bundled_model_reads_as_gguf_py_reads_it(bundled_gguf_file, bundled_gguf_reader):
    tokens = bundled_gguf_file.fields["tokenizer.ggml.tokens"].contents()
    assert len(bundled_gguf_file.tensors) == 272 and len(tokens) == 49152
    assert_same(bundled_gguf_file, bundled_gguf_reader)


def every_kind(path):
    """A GGUF file with a value of every scalar type, arrays of numbers, bools and strings (with non-ASCII text),
    and F32, F16, Q8_0 and Q4_1 tensors, one of them 3-dimensional."""
    w = gguf.GGUFWriter(str(path), "llama")
    T = gguf.GGUFValueType
    for k, (v, t) in enumerate([(200, T.UINT8), (-5, T.INT8), (60000, T.UINT16), (-300, T.INT16),
                                (4_000_000_000, T.UINT32), (-7, T.INT32), (0.1, T.FLOAT32), (True, T.BOOL),
                                (2**63 + 5, T.UINT64), (-(2**40), T.INT64), (1e-300, T.FLOAT64)]):
        w.add_key_value(f"test.scalar{k}", v, t)
    w.add_string("test.text", "grüße, 世界 🐱")
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, -1.25, 3e-8])
    w.add_array("test.bools", [True, False, True])
    w.add_array("test.strings", ["", "a b", "ß", "<|im_end|>"])
    g = np.random.default_rng(0)
    w.add_tensor("f32", g.standard_normal((3, 5), dtype=np.float32))
    w.add_tensor("f16", g.standard_normal((2, 3, 4)).astype(np.float16))
    for name, kind in (("q8", gguf.GGMLQuantizationType.Q8_0), ("q4", gguf.GGMLQuantizationType.Q4_1)):
        rows = g.standard_normal((4, 64), dtype=np.float32)
        w.add_tensor(name, gguf.quants.quantize(rows, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_type_and_tensor_type_reads_as_gguf_py_reads_it(tmp_path):
    path = every_kind(tmp_path / "kinds.gguf")
    ours = open_gguf(path)
    assert_same(ours, gguf.GGUFReader(str(path)))
    assert ours.fields["test.text"].contents() == "grüße, 世界 🐱"
    assert ours.fields["test.scalar8"].contents() == 2**63 + 5 and ours.fields["test.scalar7"].contents() is True


def test_a_file_without_a_tokenizer_is_refused_before_its_tensors_are_read(tmp_path):
    with pytest.raises(ModelLoadError, match="carries no tokenizer"):
        import_gguf(every_kind(tmp_path / "kinds.gguf"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_truncated_file_is_refused_naming_where_it_ends(tmp_path):
    data = every_kind(tmp_path / "kinds.gguf").read_bytes()
    header_end = data.index(b"q4") + 40                      # past the tensor table, into the tensors' data
    for cut in sorted({*range(0, 64, 7), *range(64, header_end, 97), header_end, len(data) - 1}):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="not a GGUF file|ends inside|past the file's end"):
            open_gguf(tmp_path / "cut.gguf")


@pytest.mark.parametrize(("content", "message"), [
    (b"GGML" + bytes(20), "not a GGUF file"),
    (b"GGUF" + struct.pack("<I", 1) + bytes(16), "version 1 is not supported"),
    (crafted(struct.pack("<QQ", 0, 2**62)), "ends inside the metadata and tensor table"),          # a claimed count
    (crafted(struct.pack("<QQ", 0, 1), kv(b"k", 8, struct.pack("<Q", 2**60))), "ends inside k"),  # a claimed length
    (crafted(struct.pack("<QQ", 0, 1), kv(b"k", 9, struct.pack("<IQ", 8, 2**40))), "ends inside k"),
    (crafted(struct.pack("<QQ", 0, 1), kv(b"k", 9, struct.pack("<IQ", 9, 1) * 12 + bytes(80))), "nested more than"),
    (crafted(struct.pack("<QQ", 0, 1), kv(b"k", 42, bytes(16))), "unknown value type 42"),
    (crafted(struct.pack("<QQ", 0, 2), kv(b"k", 4, bytes(4)), kv(b"k", 4, bytes(4))), "appears twice"),
    (crafted(struct.pack("<QQ", 0, 1), kv(b"k", 8, struct.pack("<Q", 2) + b"\xff\xfe")), "not UTF-8"),
    (crafted(struct.pack("<QQ", 1, 0), struct.pack("<Q", 1) + b"t" + struct.pack("<IQIQ", 1, 2**40, 0, 0)),
     "lie past the file's end"),
    (crafted(struct.pack("<QQ", 1, 0), struct.pack("<Q", 1) + b"t" + struct.pack("<IQIQ", 1, 4, 99, 0)),
     "unknown type 99"),
])
def test_a_crafted_file_is_refused_with_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "crafted.gguf"
    path.write_bytes(content + bytes(64))
    with pytest.raises(GGUFError, match=message):
        open_gguf(path)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):      # as the import reports it
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
