"""The bad-input corpus, broken model folders through the engine and bad input through the CLI (exit status
2 and `error: ...`): every case asserts the message and that the model still works afterwards."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from engine import EngineError, ModelLoadError, load_model
from engine.cli import main as cli_main
from engine.generate import generate
from tests.bad_input import (
    GOOD,
    ROOT,
    _config,
    _ids,
    _nan,
    _set,
    _template,
    _tensors,
    _truncate,
    broken_copy,
    still_works,
)
from tests.helpers import tiny_config

# ---- malformed model directories, through the engine ----------------------------------------------------------











BROKEN_MODELS = [
    ("half-downloaded safetensors", lambda d: _truncate(d, 0.5), (r"model.safetensors: cannot read safetensors "
                                                                  r"file \(truncated or corrupt\?\)")),
    ("safetensors cut in its header", lambda d: _truncate(d, 0.00001), r"cannot read safetensors file"),
    ("empty safetensors", lambda d: _truncate(d, 0), r"cannot read safetensors file .*header too small"),
    ("wrong dtype (int32)", lambda d: _tensors(d, _set("model.norm.weight", torch.ones(64, dtype=torch.int32))),
     r"tensor model.norm.weight has dtype torch.int32; expected float32, float16 or bfloat16"),
    ("wrong dtype (float64)", lambda d: _tensors(d, _set("model.norm.weight", lambda t: t.double())),
     r"model.norm.weight has dtype torch.float64"),
    ("wrong shape", lambda d: _tensors(d, _set("model.layers.1.mlp.up_proj.weight", torch.zeros(127, 64))),
     r"model.layers.1.mlp.up_proj.weight has shape \(127, 64\), expected \(128, 64\)"),
    ("missing tensor", lambda d: _tensors(d, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight")),
     r"missing tensor\(s\): model.layers.0.self_attn.k_proj.weight"),
    ("unexpected tensor", lambda d: _tensors(d, _set("model.layers.0.extra.weight", torch.zeros(2))),
     r"unexpected tensor\(s\): model.layers.0.extra.weight"),
    ("NaN weights", lambda d: _tensors(d, _set("model.layers.1.self_attn.o_proj.weight", _nan)),
     r"model.layers.1.self_attn.o_proj.weight contains NaN or Inf values"),
    ("Inf weights", lambda d: _tensors(d, _set("lm_head.weight", lambda t: t.index_fill(0, torch.tensor([3]),
                                                                                        float("inf")))),
     r"lm_head.weight contains NaN or Inf values"),
    ("unknown rope scaling", lambda d: _config(d, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     r"unsupported rope_scaling type 'yarn'; supported: default, linear, llama3"),
    ("rope scaling not an object", lambda d: _config(d, rope_scaling="linear"), r"rope_scaling must be a JSON object"),
    ("tokenizer vocabulary larger than the model's", lambda d: (_config(d, vocab_size=1000), _tensors(d, lambda t: [
        t.__setitem__(k, t[k][:1000].clone()) for k in ("model.embed_tokens.weight", "lm_head.weight")])),
     r"the tokenizer has 49152 tokens but the model's vocabulary has 1000: they do not belong together"),
    ("unsupported architecture", lambda d: _config(d, model_type="bloom"),
     r"unsupported architecture model_type='bloom'"),
    ("config.json not JSON", lambda d: (d / "config.json").write_text("{not json"), r"config.json is not valid JSON"),
    ("config.json missing", lambda d: (d / "config.json").unlink(), r"has no config.json"),
    ("config key missing", lambda d: (d / "config.json").write_text(json.dumps(
        {k: v for k, v in tiny_config().items() if k != "vocab_size"})), r"missing required key 'vocab_size'"),
    ("pickle checkpoint only", lambda d: ((d / "model.safetensors").rename(d / "pytorch_model.bin")),
     r"only pickle checkpoints \(.bin/.pt\) found; this engine never unpickles"),
    ("tokenizer.json missing", lambda d: (d / "tokenizer.json").unlink(), r"No tokenizer.json"),
    pytest.param("tokenizer.json corrupt", lambda d: (d / "tokenizer.json").write_text('{"half": '),
                 r"tokenizer"),
    pytest.param("tokenizer_config.json corrupt", lambda d: (d / "tokenizer_config.json").write_text("{"),
                 r"tokenizer"),
    pytest.param("config.json is a list", lambda d: (d / "config.json").write_text("[1, 2]"),
                 r"config.json"),
    pytest.param("config size not a number", lambda d: _config(d, hidden_size="big"),
                 r"hidden_size"),
    ("odd head_dim", lambda d: _config(d, head_dim=15),
     r"head_dim=15 is odd; rotary position embedding \(RoPE\) rotates pairs of dimensions, so head_dim must be even"),
    pytest.param("zero attention heads", lambda d: _config(d, num_attention_heads=0),
                 r"num_attention_heads"),
]






@pytest.mark.parametrize("name,breaker,msg", BROKEN_MODELS, ids=_ids(BROKEN_MODELS))
def test_malformed_model_directory(tmp_path, tiny_model_dir, tiny_model, name, breaker, msg, good_answer):
    d = broken_copy(tmp_path, tiny_model_dir, name, breaker)
    with pytest.raises(ModelLoadError, match=msg):
        load_model(d, device="cpu", dtype="float32")
    still_works(tiny_model, good_answer)


def test_broken_chat_template_is_an_input_error(tmp_path, tiny_model_dir, tiny_model, good_answer):
    d = broken_copy(tmp_path, tiny_model_dir, "template", lambda d: _template(d, "{% if %}"))
    model = load_model(d, device="cpu", dtype="float32")
    try:
        with pytest.raises(EngineError, match="chat template"):
            generate(model, GOOD, chat=True, max_new_tokens=2)
    finally:
        still_works(tiny_model, good_answer)




# ---- the command line: exit status 2 and `error: ...` ---------------------------------------------------------

def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args], cwd=ROOT, capture_output=True, timeout=300,
                          check=False)


def test_cli_bad_input_exits_2_with_a_message_and_then_works(tmp_path, tiny_model_dir):
    broken = broken_copy(tmp_path, tiny_model_dir, "half", lambda d: _truncate(d, 0.5))
    for args, msg in [(["   ", "--model", str(tiny_model_dir)], "error: the prompt is empty"),
                      (["hi", "--model", str(broken)], "cannot read safetensors file (truncated or corrupt?)"),
                      (["hi", "--model", str(tiny_model_dir), "--temperature", "-1"], "temperature must be >= 0")]:
        r = run_cli("generate", *args)
        assert r.returncode == 2 and msg in r.stderr.decode(), r.stderr.decode()[-2000:]
    r = run_cli("generate", "hi", "--model", str(tiny_model_dir), "--max-new-tokens", "2")
    assert r.returncode == 0, r.stderr.decode()[-2000:]


def test_cli_prompt_of_invalid_utf8_bytes_exits_2(tiny_model_dir):
    r = subprocess.run([sys.executable.encode(), b"-m", b"engine", b"generate", b"caf\xe9 \xff",
                        b"--model", bytes(tiny_model_dir)], cwd=ROOT, capture_output=True, timeout=300, check=False)
    assert r.returncode == 2 and b"surrogate" in r.stderr, r.stderr[-2000:]


CLI_CASES = [
    (["--top-p", "0"], lambda d: None, r"top_p must be in \(0, 1\]"),
    (["--max-new-tokens", "0"], lambda d: None, r"max_new_tokens must be a whole number >= 1"),
    (["--seed", "-1"], lambda d: None, r"seed must be a whole number"),
    (["--repetition-penalty", "0"], lambda d: None, r"repetition_penalty must be > 0"),
    ([], lambda d: _tensors(d, _set("model.layers.1.self_attn.o_proj.weight", _nan)), r"contains NaN or Inf"),
    ([], lambda d: _config(d, rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"unsupported rope_scaling"),
    ([], lambda d: _tensors(d, lambda t: t.pop("model.norm.weight")), r"missing tensor\(s\): model.norm.weight"),
]


@pytest.mark.parametrize("args,breaker,msg", CLI_CASES, ids=["top_p", "max_new", "seed", "rep", "nan", "yarn",
                                                             "missing"])
def test_cli_main_reports_errors_with_exit_2(tmp_path, tiny_model_dir, capsys, args, breaker, msg):
    """The CLI's own entry point in this process (the subprocess test above covers the real command)."""
    d = broken_copy(tmp_path, tiny_model_dir, "m", breaker)
    assert cli_main(["generate", "hello", "--model", str(d), "--max-new-tokens", "2", *args]) == 2
    err = capsys.readouterr().err
    assert re.search("error: .*" + msg, err), err[-2000:]
    assert cli_main(["generate", "hello", "--model", str(tiny_model_dir), "--max-new-tokens", "2"]) == 0


# ---- a broken hub cache, through a page's sidebar -------------------------------------------------------------

def _sidebar_script():
    from inspector.ui.sidebar import sidebar
    sidebar()


def test_a_dangling_hub_snapshot_does_not_break_the_sidebar(tmp_path, monkeypatch, tiny_model, tiny_model_dir):
    """An interrupted download leaves snapshots/<rev> a symlink to nothing; every page's sidebar lists the hub
    cache."""
    from streamlit.testing.v1 import AppTest

    import inspector.session.models as models
    hub = tmp_path / "hub"
    (hub / "models--org--broken" / "snapshots").mkdir(parents=True)
    (hub / "models--org--broken" / "snapshots" / "rev1").symlink_to(tmp_path / "gone")
    good = hub / "models--org--good" / "snapshots" / "abc"
    good.mkdir(parents=True)
    (good / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.delenv("LLM_INSPECTOR_HUB_CACHE", raising=False)
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    monkeypatch.setattr(models, "load_model", lambda *a, **k: tiny_model)
    models.shared_model.clear()
    try:
        at = AppTest.from_function(_sidebar_script, default_timeout=120).run()
        assert not at.exception, at.exception
        options = at.sidebar.selectbox(key="sb_model").options
        assert "org/good (hub cache)" in options and not any("org/broken" in o for o in options)
    finally:
        models.shared_model.clear()
