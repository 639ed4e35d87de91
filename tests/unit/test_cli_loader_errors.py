"""CLI and loader input that used to end in a traceback or be silently accepted: each is now `error: …` with
exit status 2 (the CLI) or a ModelLoadError naming the key or file (the loader)."""
from __future__ import annotations

import json
import os
import time

import pytest

from engine import ModelLoadError, load_model
from engine.cli import main
from engine.config import ModelConfig
from engine.generate import generate
from engine.gguf_import import IMPORT_VERSION, is_imported, source_facts
from engine.sources import import_dir_for, imported_dir
from tests.helpers import tiny_config, write_model_dir

pytestmark = pytest.mark.unit


def run_cli(capsys, *argv: str) -> str:
    t0 = time.perf_counter()
    assert main(list(argv)) == 2
    assert time.perf_counter() - t0 < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ") and "Traceback" not in "\n".join(err), err
    return err[-1]


@pytest.mark.parametrize("argv, words", [
    (["generate", "hi", "--device", "foo"], "unsupported device 'foo'; use cpu or cuda"),
    (["hooks", "--device", "tpu:0"], "unsupported device"),
    (["show", "/nonexistent/run.trace"], "cannot read run.trace"),
    (["show", "/"], "cannot read"),
])
def test_cli_refuses_bad_arguments(capsys, argv, words):
    assert words in run_cli(capsys, *argv)


def test_cli_unwritable_outputs(capsys, tiny_model_dir, tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where a folder should be")
    msg = run_cli(capsys, "stats", "hello", "--model", str(tiny_model_dir), "--csv", str(blocked / "s.csv"))
    assert "s.csv" in msg
    msg = run_cli(capsys, "trace", "hello", "--model", str(tiny_model_dir), "--max-new-tokens", "1",
                  "--out", str(blocked / "run.trace"))
    assert "run.trace" in msg


def test_bench_threads_must_be_positive(capsys, tiny_model_dir):
    assert "--threads must be >= 1" in run_cli(capsys, "bench", "--model", str(tiny_model_dir), "--threads", "-1")


@pytest.mark.parametrize("flag, value, words", [
    ("--new-tokens", "1", "--new-tokens must be >= 2"), ("--new-tokens", "0", "--new-tokens must be >= 2"),
    ("--repeats", "0", "--repeats must be >= 1"), ("--prompt-tokens", "1", "--prompt-tokens must be >= 2")])
def test_bench_sizes_are_checked_before_any_work(capsys, tiny_model_dir, flag, value, words):
    assert words in run_cli(capsys, "bench", "--model", str(tiny_model_dir), flag, value)


@pytest.mark.parametrize("change, words", [
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
    ({"attention_bias": 1}, "attention_bias must be true or false"),
    ({"rope_theta": 0}, "rope_theta=0 must be a finite number > 0"),
    ({"rope_theta": -5.0}, "rope_theta=-5.0 must be a finite number > 0"),
    ({"rope_parameters": [1, 2]}, "rope_parameters must be a JSON object"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "rope_scaling.factor=0 must be a finite number > 0"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1}},
     "high_freq_factor > low_freq_factor"),
    ({"rope_scaling": "linear"}, "rope_scaling must be a JSON object"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000 must be a whole number in [1, 1,024]"),
    ({"max_position_embeddings": 1 << 40}, "max_position_embeddings"),
    ({"head_dim": 15}, "head_dim=15 is odd; rotary position embedding (RoPE) rotates pairs of dimensions, so "
                       "head_dim must be even"),
    ({"hidden_size": 60}, "head_dim = hidden_size / num_attention_heads = 60 / 4 = 15 is odd"),
])
def test_config_values_are_range_checked(change, words):
    with pytest.raises(ModelLoadError) as e:
        ModelConfig.from_dict(tiny_config(**change))
    assert words in str(e.value)


@pytest.mark.parametrize("change", [{"hidden_size": 60}, {"head_dim": 15}, {"head_dim": 1}])
def test_an_odd_head_dim_is_refused_at_load_not_at_the_first_forward(tmp_path, tokenizer_files, change):
    """Weights of consistent shapes (60 = 4 heads x 15): only RoPE's pairs of dimensions cannot be formed."""
    d = write_model_dir(tmp_path / "odd", tokenizer_files, tiny_config(**change))
    with pytest.raises(ModelLoadError, match=r"head_dim.* is odd.*head_dim must be even"):
        load_model(d, device="cpu", dtype="float32")


def test_an_even_head_dim_other_than_hidden_over_heads_loads_and_runs(tmp_path, tokenizer_files):
    """The counterpart of the odd ones above (once, not after each of them)."""
    even = write_model_dir(tmp_path / "even", tokenizer_files, tiny_config(head_dim=14))
    model = load_model(even, device="cpu", dtype="float32")
    assert model.config.head_dim == 14
    assert len(generate(model, "hello", max_new_tokens=2, ignore_eos=True).token_ids) == 2     # forwards run


def sharded(tmp_path, tokenizer_files, weight_map) -> str:
    d = write_model_dir(tmp_path / "m", tokenizer_files)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(d)


@pytest.mark.parametrize("weight_map, words", [
    ([1, 2, 3], "weight_map must map tensor names to file names"),
    ({"model.norm.weight": 7}, "weight_map must map tensor names to file names"),
    ({"model.norm.weight": "../../etc/x.safetensors"}, "shards must be .safetensors files in the model's own folder"),
    ({"model.norm.weight": "/etc/passwd"}, "shards must be .safetensors files in the model's own folder"),
])
def test_index_entries_are_confined_to_the_model_folder(tmp_path, tokenizer_files, weight_map, words):
    with pytest.raises(ModelLoadError) as e:
        load_model(sharded(tmp_path, tokenizer_files, weight_map), device="cpu", dtype="float32")
    assert words in str(e.value)


def test_an_unwritable_import_cache_is_a_clear_error(tmp_path, monkeypatch):
    from engine.sources import bundled_gguf
    blocked = tmp_path / "cache-is-a-file"
    blocked.write_text("")
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(blocked))
    with pytest.raises(ModelLoadError, match="cannot write the import cache"):
        imported_dir(bundled_gguf())


def test_two_gguf_files_of_equal_name_and_size_never_share_an_import(tmp_path, monkeypatch):
    """The import is keyed by the resolved path, and reused only while the content is the same."""
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(bytes(range(256)) * 4096)
    assert import_dir_for(a) != import_dir_for(b)
    out = import_dir_for(a)
    out.mkdir(parents=True)
    (out / "import.json").write_text(json.dumps({"import_version": IMPORT_VERSION, **source_facts(a)}))
    assert is_imported(out, a)
    data = bytearray(a.read_bytes())
    data[1000] ^= 0xFF                              # same name, size and folder; other content
    a.write_bytes(bytes(data))
    os.utime(a, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert not is_imported(out, a)
