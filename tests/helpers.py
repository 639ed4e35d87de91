"""Helpers the tests share (imported as tests.helpers): a tiny random-weight Llama in HF layout, and a
Streamlit server on a free 127.0.0.1 port."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]

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


def write_model_dir(path: Path, tokenizer_files: Path, cfg: dict | None = None,
                    tensors: dict[str, torch.Tensor] | None = None) -> Path:
    cfg = cfg or tiny_config()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors if tensors is not None else tiny_tensors(cfg), str(path / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((tokenizer_files / name).read_bytes())
    return path


def engine_cli(*args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m engine ARGS` through its entry point (engine.cli.main) in this process: the same exit status,
    stdout and stderr as the command, without starting Python, torch and the engine again (3-8 s a call on
    two shared cores). Tests about the process itself (argv bytes, its memory, its start-up) keep subprocess."""
    import contextlib
    import io
    import os

    from engine.cli import main
    out, err = io.StringIO(), io.StringIO()
    here, threads = os.getcwd(), torch.get_num_threads()       # (bench --threads sets the process's)
    os.chdir(cwd or ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:                     # argparse's own usage errors (exit status 2)
                code = e.code
    finally:
        os.chdir(here)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
    code = 0 if code is None else code if isinstance(code, int) else 1
    return subprocess.CompletedProcess([sys.executable, "-m", "engine", *map(str, args)], code, out.getvalue(),
                                       err.getvalue())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def server_process(cmd: list[str], cwd: Path, env: dict, log: Path, port: int):
    """A server process (its output in `log`) on 127.0.0.1:port; yields (url, process) once Streamlit's health
    check answers; always stopped."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
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


@contextmanager
def streamlit_server(env: dict, log: Path, *args: str, classroom: bool = False):
    """`streamlit run app.py` on a free 127.0.0.1 port (the README's command: one person); with classroom, as
    scripts/serve.sh starts it for a class (`python -m inspector.ui.serve run app.py`: the app's modules imported and
    frozen out of garbage collection first). Yields (url, process) once healthy; always stopped."""
    port = free_port()
    main = ["inspector.ui.serve"] if classroom else ["streamlit"]
    cmd = [sys.executable, "-m", *main, "run", "app.py", "--server.headless", "true", "--server.port",
           str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false", *args]
    with server_process(cmd, ROOT, env, log, port) as (url, proc):
        yield url, proc


def reference_stats(x: torch.Tensor, masked: bool = False) -> torch.Tensor:
    """Slow, obvious per-position statistics of one tensor (T, ...): the test oracle for StatsBatcher."""
    x = x.detach().double().reshape(x.shape[0], -1)
    rows = []
    for r in x.tolist():
        kept = [v for v in r if v == v and not (masked and v == float("-inf"))]
        fin = [v for v in r if v == v and abs(v) != float("inf")]
        n_nan = sum(1 for v in r if v != v)
        n_inf = sum(1 for v in r if abs(v) == float("inf") and not (masked and v == float("-inf")))
        mean = sum(fin) / len(fin) if fin else float("nan")
        std = (sum((v - mean) ** 2 for v in fin) / len(fin)) ** 0.5 if fin else float("nan")
        lo, hi = (min(kept), max(kept)) if kept else (float("inf"), float("-inf"))
        rows.append([lo, hi, mean, std, max(abs(lo), abs(hi)), n_nan, n_inf])
    return torch.tensor(rows, dtype=torch.float32)


def open_generation_settings(page) -> None:
    """Open the sidebar's "Generation settings" and wait until its sliders are drawn. (Typing at once used to
    send every slider's minimum to the server — inspector.ui.widgets.sampling_widgets now always gives a slider its
    value; this test helper still waits, as a person would, before typing.)"""
    page.get_by_text("Generation settings").click()
    page.locator('[data-testid="stSidebar"] [data-testid="stSliderThumbValue"]').first.wait_for(state="visible")


_ESCAPED = re.compile(r"\\([!-/:-@\[-`{-~])")        # CommonMark's backslash escapes (any ASCII punctuation)


def as_shown(markdown_source: str) -> str:
    """What a Markdown element's source shows as text once its escapes are resolved (inspector.ui.common.plain escapes
    every punctuation character and puts a zero-width space into bare links)."""
    return _ESCAPED.sub(r"\1", markdown_source).replace("\u200b", "")


def forge(monkeypatch, key: str, value) -> None:
    """The widget with this key hands the page `value` whatever its bounds, as a forged message does with a
    Streamlit release that does not clamp (the installed one clamps; the page must not rely on it)."""
    import streamlit as st
    from streamlit.delta_generator import DeltaGenerator
    for name in ("number_input", "slider", "select_slider", "text_input"):
        real = getattr(DeltaGenerator, name)

        def fake(self, *a, _real=real, **k):
            out = _real(self, *a, **k)
            return value if k.get("key") == key else out
        monkeypatch.setattr(DeltaGenerator, name, fake)
        monkeypatch.setattr(st, name, lambda *a, _fake=fake, **k: _fake(st._main, *a, **k))


# A Streamlit page whose script is running: the app root's script state (what the frontend itself records), or
# the toolbar's "Running..." widget. The widget alone is not enough: with client.toolbarMode "minimal" or
# "viewer" (.streamlit/config.toml, scripts/serve.sh) Streamlit does not draw it.
RUNNING = ('[data-testid="stApp"][data-test-script-state="running"], '
           '[data-testid="stApp"][data-test-script-state="rerunRequested"], [data-testid="stStatusWidget"]')


class OwnContexts:
    """A shared Playwright Browser as one test uses it: new_context and new_page as the Browser's, and close()
    closes only the contexts this test opened; the Chromium process stays for the next test."""

    def __init__(self, browser) -> None:
        self._browser, self._opened = browser, []

    def new_context(self, **kw):
        ctx = self._browser.new_context(**kw)
        self._opened.append(ctx)
        return ctx

    def new_page(self, **kw):
        return self.new_context(**kw).new_page()

    def close(self) -> None:
        while self._opened:
            try:
                self._opened.pop().close()
            except Exception:          # already gone with a crashed page: nothing left to close
                pass


@contextmanager
def own_contexts(browser):
    """`with own_contexts(browser) as b:` — b opens contexts and pages in the shared Chromium; all closed at the end."""
    b = OwnContexts(browser)
    try:
        yield b
    finally:
        b.close()


def screenshots_dir() -> Path | None:
    """Where the browser tests save the docs' screenshots: $LLM_INSPECTOR_SCREENSHOTS, when set (the README's and
    docs/CLASSROOM.md's come from `LLM_INSPECTOR_SCREENSHOTS=docs/screenshots`); otherwise none are taken (a
    screenshot asserts nothing, and the projector tour's took a fifth of its time)."""
    folder = os.environ.get("LLM_INSPECTOR_SCREENSHOTS")
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    return Path(folder)


def step_together_to_the_end(runs) -> None:
    """engine.batch.step_together until every run has ended; no run's step may raise."""
    from engine.batch import step_together
    while not all(r.done for r in runs):
        for o in step_together(runs):
            assert not isinstance(o, BaseException), o


def assert_same_stats(alone, together, rtol: float, atol: float) -> None:
    """Two runs' probes hold the same statistics records (step, stage, position) with values within rtol / atol."""
    ra, rb = alone.probe.recording.stat_records(), together.probe.recording.stat_records()
    assert [(r.step, r.name, r.pos0) for r in ra] == [(r.step, r.name, r.pos0) for r in rb]
    for x, y in zip(ra, rb):
        assert torch.allclose(x.values, y.values, rtol=rtol, atol=atol, equal_nan=True), (x.name, x.step)


def drive_together(barrier, runs) -> list:
    """Each run driven to its end by `barrier` (engine.batch.StepBarrier) in a thread of its own, the threads started
    together: each run's GenerationResult, or the exception its thread raised."""
    import threading
    out: list = [None] * len(runs)
    gate = threading.Barrier(len(runs))

    def work(n: int) -> None:
        gate.wait()
        try:
            out[n] = barrier.drive(runs[n])
        except Exception as e:          # what the run's own thread raises
            out[n] = e
    threads = [threading.Thread(target=work, args=(n,)) for n in range(len(runs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out
