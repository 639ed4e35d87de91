"""Where models come from, as a student's browser meets it: the sidebar's model list survives a broken hub cache
(a dangling snapshot symlink, a refs/main pointing out of the repository), and a first GGUF import's progress
names the model, never a folder of the server."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from engine import ModelLoadError
from engine.sources import find_in_hub_cache, resolve
from inspector.session import models

pytestmark = pytest.mark.unit


def _repo(hub: Path, repo_id: str) -> Path:
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    (repo / "snapshots").mkdir(parents=True)
    return repo


def _snapshot(repo: Path, rev: str) -> Path:
    snap = repo / "snapshots" / rev
    snap.mkdir()
    (snap / "config.json").write_text("{}")
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """A hub cache with one sound repository and the broken kinds a real cache ends up holding."""
    hub = tmp_path / "hub"
    good = _repo(hub, "org/good")
    _snapshot(good, "abc123")
    (good / "refs").mkdir()
    (good / "refs" / "main").write_text("abc123")
    # An interrupted download: the snapshot is a symlink to a folder that is gone.
    (_repo(hub, "org/dangling") / "snapshots" / "rev1").symlink_to(tmp_path / "gone")
    # One dangling snapshot next to a sound one, and a symlink loop.
    mixed = _repo(hub, "org/mixed")
    (mixed / "snapshots" / "aaa").symlink_to(tmp_path / "gone-too")
    (mixed / "snapshots" / "loop").symlink_to(mixed / "snapshots" / "loop")
    _snapshot(mixed, "bbb")
    # refs/main naming a folder outside the repository (which has a config.json) must not be followed.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    escape = _repo(hub, "org/escape")
    (escape / "refs").mkdir()
    (escape / "refs" / "main").write_text("../../../outside")
    # refs/main that is a folder, not a file.
    (_repo(hub, "org/refdir") / "refs" / "main").mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.delenv("LLM_INSPECTOR_HUB_CACHE", raising=False)
    models.model_choices.clear()
    yield hub
    models.model_choices.clear()


def test_a_broken_hub_cache_entry_is_left_out_of_the_model_list(hub):
    choices = models.model_choices()
    hub_labels = sorted(k for k in choices if k.endswith("(hub cache)"))
    assert hub_labels == ["org/good (hub cache)", "org/mixed (hub cache)"]
    assert choices["org/good (hub cache)"] == "org/good"
    assert find_in_hub_cache("org/good") == hub / "models--org--good" / "snapshots" / "abc123"
    assert find_in_hub_cache("org/mixed") == hub / "models--org--mixed" / "snapshots" / "bbb"
    assert find_in_hub_cache("org/dangling") is None
    assert find_in_hub_cache("org/escape") is None
    assert find_in_hub_cache("org/refdir") is None


def test_choosing_a_dangling_hub_model_is_a_clear_error(hub):
    with pytest.raises(ModelLoadError, match="'org/dangling' is not a local directory and is not in the Hugging "
                                             "Face hub cache"):
        resolve("org/dangling")


def test_a_model_root_with_a_dangling_entry_still_lists(tmp_path, monkeypatch):
    root = tmp_path / "models"
    (root / "sound").mkdir(parents=True)
    (root / "sound" / "config.json").write_text("{}")
    (root / "broken.gguf").symlink_to(tmp_path / "gone.gguf")
    (root / "loop").symlink_to(root / "loop")
    monkeypatch.setenv("LLM_INSPECTOR_MODEL_ROOTS", str(root))
    monkeypatch.setenv("LLM_INSPECTOR_HUB_CACHE", "off")
    models.model_choices.clear()
    try:
        labels = [k for k in models.model_choices() if k.endswith("(server models)")]
    finally:
        models.model_choices.clear()
    assert labels == ["sound (server models)"]


# ---- a first GGUF import's progress ----------------------------------------------------------------------------

def _write_tiny_llama_gguf(path: Path) -> None:
    """A complete one-layer Llama GGUF (16 wide, 4 heads of 4, byte-level tokenizer) in float32."""
    gguf = pytest.importorskip("gguf")
    from engine.gguf_tokenizer import BYTE_TO_CHAR

    tokens = ["<|end|>", "<s>"] + [BYTE_TO_CHAR[b] for b in range(256)] + ["he", "ll", "hell", "hello", "Ġhello"]
    d, f, heads, kv, vocab = 16, 32, 4, 2, len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(d)
    w.add_feed_forward_length(f)
    w.add_block_count(1)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(["h e", "l l", "he ll", "hell o", "Ġ hello"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    rng = np.random.default_rng(0)
    hd = d // heads
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,), "output.weight": (vocab, d),
              "blk.0.attn_norm.weight": (d,), "blk.0.attn_q.weight": (heads * hd, d),
              "blk.0.attn_k.weight": (kv * hd, d), "blk.0.attn_v.weight": (kv * hd, d),
              "blk.0.attn_output.weight": (d, heads * hd), "blk.0.ffn_norm.weight": (d,),
              "blk.0.ffn_gate.weight": (f, d), "blk.0.ffn_up.weight": (f, d), "blk.0.ffn_down.weight": (d, f)}
    for name, shape in shapes.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


PATH_IN_TEXT = re.compile(r"(?:^|[\s'\"(=:])[/~]")       # a token that starts like an absolute or home path


def test_the_first_gguf_imports_progress_names_the_model_not_a_server_folder(tmp_path, monkeypatch):
    served = tmp_path / "srv" / "secret-models"
    served.mkdir(parents=True)
    gguf_file = served / "tiny-llama.gguf"
    _write_tiny_llama_gguf(gguf_file)
    cache = tmp_path / "srv" / "cache"
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(cache))
    seen: list[str] = []
    models.shared_model.clear()
    try:
        model = models.shared_model(str(gguf_file), "cpu", "float32", _progress=lambda f, m: seen.append(m))
    finally:
        models.shared_model.clear()
    assert model.config.hidden_size == 16 and any(cache.rglob("model.safetensors"))    # it was imported now
    assert seen[0] == "reading tiny-llama.gguf" and seen[-1] == "tiny-llama.gguf ready on cpu (float32)"
    assert "imported tiny-llama.gguf" in seen
    leaks = [m for m in seen if PATH_IN_TEXT.search(m) or "secret-models" in m or str(tmp_path) in m]
    assert not leaks, leaks


def test_a_gguf_too_large_for_memory_once_dequantised_is_refused_before_it_is_dequantised(tmp_path, monkeypatch):
    """The import holds every tensor in float32 before writing them: with less memory available than that (here a
    machine that reports 1 MB), the file is refused naming that size, before one tensor is dequantised."""
    import gguf.quants

    import engine.memory
    from engine.errors import ModelLoadError
    from engine.gguf_import import import_gguf
    gguf_file = tmp_path / "tiny-llama.gguf"
    _write_tiny_llama_gguf(gguf_file)
    monkeypatch.setattr(engine.memory, "available_bytes", lambda: 1 << 20)
    calls = []
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: calls.append(a) or pytest.fail("dequantised"))
    d, f, vocab = 16, 32, 263
    attn = 16 * 16 + 8 * 16 + 8 * 16 + 16 * 16                         # q, k, v, o: 4 heads (2 KV heads) of 4
    need = 4 * (2 * vocab * d + d + 2 * d + attn + 3 * d * f)          # embedding, output, norms, one layer
    with pytest.raises(ModelLoadError) as e:
        import_gguf(gguf_file, tmp_path / "out")
    assert "tiny-llama.gguf" in str(e.value) and "imported as float32" in str(e.value)
    assert need == 43_072 and "43.1 kB in float32" in str(e.value) and calls == [] and not (tmp_path / "out").exists()


def test_the_engines_import_progress_names_no_folder(tmp_path, monkeypatch):
    """The engine's own messages (the CLI's too), before the app's redaction."""
    from engine.sources import imported_dir
    gguf_file = tmp_path / "srv" / "tiny-llama.gguf"
    gguf_file.parent.mkdir()
    _write_tiny_llama_gguf(gguf_file)
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(tmp_path / "cache"))
    seen: list[str] = []
    out = imported_dir(gguf_file, progress=lambda f, m: seen.append(m))
    assert (out / "model.safetensors").is_file() and len(seen) >= 3
    assert not [m for m in seen if PATH_IN_TEXT.search(m) or str(tmp_path) in m], seen


def test_load_progress_through_the_app_has_the_caches_and_the_models_folder_redacted(tmp_path, monkeypatch,
                                                                                      tiny_model):
    """Whatever an engine message carries, the app's progress line shows the model's name and "…", not a folder
    of the server (a stand-in load that reports the paths an import works with)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(cache))
    source = str(tmp_path / "secret-models" / "tiny-llama.gguf")

    def fake_load(src, **kw):
        kw["progress"](0.5, f"copying {src} into {cache / 'models' / 'tiny-llama-0123'}")
        return tiny_model

    monkeypatch.setattr(models, "load_model", fake_load)
    seen: list[str] = []
    models.shared_model.clear()
    try:
        models.shared_model(source, "cpu", "float32", _progress=lambda f, m: seen.append(m))
    finally:
        models.shared_model.clear()
    assert seen == ["copying tiny-llama.gguf into …/models/tiny-llama-0123"]
