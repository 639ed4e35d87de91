"""Shared fixtures: a tiny random-weight Llama in HF layout (with the real SmolLM2 tokenizer), and the
bundled model itself, each built once per test session."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.sources import bundled_gguf

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096)


def tiny_config(**overrides) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
           "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32", **TINY}
    cfg.update(overrides)
    return cfg


def tiny_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights, scaled so activations stay O(1) through the layers."""
    g = torch.Generator().manual_seed(seed)
    d, f, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def r(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale if scale is not None else shape[-1] ** -0.5)

    t = {"model.embed_tokens.weight": r(V, d, scale=1.0), "model.norm.weight": 1 + 0.1 * r(d, scale=1.0)}
    if not cfg.get("tie_word_embeddings"):
        t["lm_head.weight"] = r(V, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": 1 + 0.1 * r(d, scale=1.0),
              p + "self_attn.q_proj.weight": r(q, d), p + "self_attn.k_proj.weight": r(kv, d),
              p + "self_attn.v_proj.weight": r(kv, d), p + "self_attn.o_proj.weight": r(d, q),
              p + "post_attention_layernorm.weight": 1 + 0.1 * r(d, scale=1.0),
              p + "mlp.gate_proj.weight": r(f, d), p + "mlp.up_proj.weight": r(f, d),
              p + "mlp.down_proj.weight": r(d, f)}
        if cfg.get("model_type") == "qwen2" or cfg.get("attention_bias"):
            t |= {p + "self_attn.q_proj.bias": 0.1 * r(q, scale=1.0),
                  p + "self_attn.k_proj.bias": 0.1 * r(kv, scale=1.0),
                  p + "self_attn.v_proj.bias": 0.1 * r(kv, scale=1.0)}
    return t


@pytest.fixture(scope="session")
def tokenizer_files(tmp_path_factory) -> Path:
    """tokenizer.json + tokenizer_config.json of the bundled model, built from its GGUF once."""
    import gguf

    from engine.gguf_tokenizer import write_tokenizer_dir
    out = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_dir(gguf.GGUFReader(str(bundled_gguf())), out)
    return out


def write_model_dir(path: Path, tokenizer_files: Path, cfg: dict | None = None,
                    tensors: dict[str, torch.Tensor] | None = None) -> Path:
    cfg = cfg or tiny_config()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors if tensors is not None else tiny_tensors(cfg), str(path / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((tokenizer_files / name).read_bytes())
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_files) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama", tokenizer_files)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from engine import load_model
    return load_model(tiny_model_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def bundled_model():
    from engine import load_model
    return load_model(None, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def bundled_dir(bundled_model) -> Path:
    return bundled_model.path


@pytest.fixture(scope="session")
def hf_reference(bundled_dir):
    """transformers' LlamaForCausalLM on the imported directory: the test-only reference."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(str(bundled_dir), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def app_file(tmp_path_factory) -> Path:
    """The app for AppTest: a copy of app.py whose page folder is called `views/`.

    A folder named `pages/` beside the main script puts Streamlit in its v1 multipage mode, and AppTest
    re-decides that at every run (PagesManager.uses_pages_directory), so a run after switch_page would
    execute the page file alone, without app.py's sidebar. The copied pages still import pages.common from
    the repository (its root is on sys.path). The real layout is covered by tests/test_browser.py."""
    root = Path(__file__).resolve().parents[1]
    app = root / "app.py"
    out = tmp_path_factory.mktemp("app")
    (out / "app.py").write_text(app.read_text().replace('st.Page("pages/', 'st.Page("views/'))
    (out / "views").mkdir()
    for p in re.findall(r'st\.Page\("([^"]+)"', app.read_text()):
        shutil.copy(root / p, out / "views" / Path(p).name)
    return out / "app.py"


@contextmanager
def streamlit_server(env: dict, log: Path, *args: str):
    """`streamlit run app.py` on a free 127.0.0.1 port; yields (url, process) once healthy; always stopped."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true", "--server.port",
           str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false", *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if urllib.request.urlopen(url + "/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            assert time.monotonic() < end, "the server did not come up:\n" + log.read_text()[-3000:]
            time.sleep(0.5)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
    os.environ.setdefault("LLM_INSPECTOR_CACHE", str(Path.home() / ".cache" / "llm-inspector"))
