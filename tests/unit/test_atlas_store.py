"""The head atlas kept on disk (engine.tools.atlas_store) for the planted model of test_head_atlas: the file read
back is bit for bit the atlas computed and encodes to the same bytes; a second call reads it without computing; a
file for other weights or another recipe, a truncated or damaged file, values out of bounds and windows outside
their sequences are each refused with a note naming what is wrong, and the atlas is computed again and rewritten;
rewritten weights are another fingerprint; --recompute computes again; writers racing readers leave only whole
files."""
from __future__ import annotations

import json
import os
import shutil
import threading

import numpy as np
import pytest

import engine.tools.atlas_store as store
from engine import load_model
from engine.tools.atlas_store import (
    atlas_recipe, decode_atlas, encode_atlas, kept_head_atlas, stored_head_atlas, weights_fingerprint, write_atomic,
)
from engine.tools.head_atlas import MAX_TEXT_TOKENS, SCORE_NAMES
from tests.helpers import engine_cli, tiny_config, write_model_dir
from tests.unit.test_head_atlas import TEXTS, planted_tensors

pytestmark = pytest.mark.unit
KW = {"repeats": 2, "length": 16, "seed": 1}


@pytest.fixture(scope="module")
def planted_dir(tmp_path_factory, tokenizer_files):
    cfg = tiny_config(rope_theta=1e6)
    return write_model_dir(tmp_path_factory.mktemp("planted") / "planted", tokenizer_files, cfg, planted_tensors(cfg))


@pytest.fixture(scope="module")
def model(planted_dir):
    return load_model(planted_dir, device="cpu", dtype="float32")


@pytest.fixture
def computed(monkeypatch, tmp_path):
    """The cache in tmp_path, and a count of the atlases computed (engine.tools.head_atlas.head_atlas calls)."""
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(tmp_path))
    calls, real = [], store.head_atlas
    monkeypatch.setattr(store, "head_atlas", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def identity(model):
    return weights_fingerprint(model), atlas_recipe(model, TEXTS, max_text_tokens=MAX_TEXT_TOKENS, **KW)


def decode(model, data: bytes):
    cfg = model.config
    return decode_atlas(data, *identity(model), cfg.num_layers, cfg.num_heads, cfg.vocab_size)


def test_the_file_round_trips_bit_for_bit_and_is_read_without_computing(model, computed, tmp_path):
    first = kept_head_atlas(model, TEXTS, **KW)
    assert (first.source, len(computed), first.note) == ("computed", 1, None)
    assert first.path.parent == tmp_path / "atlases" and first.path.is_file()
    data = first.path.read_bytes()
    back = decode(model, data)
    assert encode_atlas(back, *identity(model)) == data
    a = first.atlas
    for name in SCORE_NAMES:
        for got, want in ((back.scores, a.scores), (back.window_value, a.window_value), (back.window_at, a.window_at)):
            assert got[name].dtype == want[name].dtype and got[name].tobytes() == want[name].tobytes(), name
    assert all(back.top_text[n].tobytes() == a.top_text[n].astype(np.int64).tobytes() for n in a.top_text)
    assert (back.texts, back.text_ids, back.random_ids, back.tokens) == (a.texts, a.text_ids, a.random_ids, a.tokens)
    again = kept_head_atlas(model, TEXTS, **KW)
    assert (again.source, len(computed)) == ("disk", 1)
    assert again.atlas.top_windows("induction", 1, 0) == a.top_windows("induction", 1, 0)
    assert stored_head_atlas(model, TEXTS, **KW).source == "disk"
    other = kept_head_atlas(model, TEXTS[:1], **KW)          # another recipe: its own file
    assert (other.source, len(computed)) == ("computed", 2) and other.path != first.path
    assert not [p for p in first.path.parent.iterdir() if ".tmp-" in p.name]


def _bad_values(atlas):
    atlas.scores["self"][0, 1] = 1.5
    return atlas


def _bad_window(atlas):
    atlas.window_at["self"][1, 0, 0, 1] = 10_000
    return atlas


def _nan_score(atlas):
    atlas.scores["induction"][1, 1] = np.nan
    return atlas


@pytest.mark.parametrize("spoil, named", [
    (lambda d, m, enc: d[:len(d) // 2], "cut short"),
    (lambda d, m, enc: d[:-1] + bytes([d[-1] ^ 1]), "SHA-256 differs"),
    (lambda d, m, enc: b"not an atlas", "no magic"),
    (lambda d, m, enc: d[:40], "cut short inside its header"),
    (lambda d, m, enc: enc(m, fingerprint="0" * 64), "other weights"),
    (lambda d, m, enc: enc(m, recipe_change={"seed": 99}), "another recipe"),
    (lambda d, m, enc: enc(m, change=_bad_values), "self scores are not finite numbers"),
    (lambda d, m, enc: enc(m, change=_nan_score), "induction scores are not finite numbers"),
    (lambda d, m, enc: enc(m, change=_bad_window), "points outside its sequence"),
])
def test_a_bad_file_is_refused_with_a_note_and_recomputed(model, computed, spoil, named):
    first = kept_head_atlas(model, TEXTS, **KW)
    good = first.path.read_bytes()

    def enc(m, fingerprint=None, recipe_change=None, change=None):
        fp, recipe = identity(m)
        atlas = decode(m, good)
        return encode_atlas(change(atlas) if change else atlas, fingerprint or fp, recipe | (recipe_change or {}))
    first.path.write_bytes(spoil(good, model, enc))
    assert stored_head_atlas(model, TEXTS, **KW).atlas is None
    again = kept_head_atlas(model, TEXTS, **KW)
    assert again.source == "computed" and len(computed) == 2
    assert named in again.note and str(first.path) in again.note
    assert first.path.read_bytes() == good                   # rewritten whole: the same deterministic atlas


def test_rewritten_weights_are_another_fingerprint(model, planted_dir, tmp_path):
    copy = shutil.copytree(planted_dir, tmp_path / "copy")
    before = weights_fingerprint(load_model(copy, device="cpu", dtype="float32"))
    assert before != weights_fingerprint(model)              # another folder: another model
    st = (copy / "model.safetensors").stat()
    os.utime(copy / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert weights_fingerprint(load_model(copy, device="cpu", dtype="float32")) != before
    (copy / "import.json").write_text(json.dumps({"import_version": 3, "source_sha256": "a" * 64}))
    imported = load_model(copy, device="cpu", dtype="float32")
    fp = weights_fingerprint(imported)
    (copy / "import.json").write_text(json.dumps({"import_version": 3, "source_sha256": "b" * 64}))
    assert weights_fingerprint(imported) != fp               # a GGUF import: its source's checksum names it


def test_writers_racing_readers_leave_only_whole_files(model, computed, tmp_path):
    first = kept_head_atlas(model, TEXTS, **KW)
    data, path, seen, errors = first.path.read_bytes(), first.path, [], []

    def write():
        for _ in range(15):
            write_atomic(path, data)

    def read():
        for _ in range(40):
            try:
                seen.append(path.read_bytes() == data)
            except OSError as e:           # never: os.replace swaps the name atomically
                errors.append(e)
    threads = [threading.Thread(target=f) for f in (write, write, write, read, read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and seen and all(seen)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_the_cli_reads_the_kept_atlas_and_recomputes_on_request(planted_dir, computed):
    args = ("atlas", "--model", planted_dir, "--device", "cpu", "--dtype", "float32", "--json", "--text", TEXTS[0],
            "--repeats", "2", "--length", "16")
    runs = [engine_cli(*args), engine_cli(*args), engine_cli(*args, "--recompute")]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    d = [json.loads(r.stdout) for r in runs]
    assert [x["source"] for x in d] == ["computed", "disk", "computed"] and len(computed) == 2
    assert d[0]["heads_scored"] == d[1]["heads_scored"] == d[2]["heads_scored"]
    w = d[1]["windows"]["previous-token"][0]
    assert (w["layer"], w["head"]) == (0, 0) and all(x["key"] == x["query"] - 1 for x in w["windows"])
