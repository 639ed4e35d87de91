"""The native decode step (engine/native) against the PyTorch forward it stands in for, on the tiny random model:
the same logits, KV cache and statistics of every stage; which calls take it; the fallbacks."""
from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from engine import load_model
from engine.accelerator import PLAIN
from engine.inspection.probe import Probe, inspection_probe
from engine.inspection.reference_stats import dense_stats
from engine.inspection.stages import forward_stages
from engine.native import build
from engine.native.step import LAYER_SLOTS, NativeDecoder
from engine.variants import precision_plan

pytestmark = pytest.mark.unit

PROMPT = [1, 400, 2000, 31, 77, 1234, 9000, 15]
STEPS = [5, 4000, 321, 48000, 17, 9]


def _native_or_skip(model) -> NativeDecoder:
    nat = model.accelerator.decode
    if nat is None:
        pytest.skip(f"native decode step unavailable here: {build.load()[1]}")
    return nat


def _run(model, probe=None, native=True, cache_len=32):
    """Prompt (PyTorch prefill) then STEPS one token each -> logits (steps, V), the cache. native=False: the same
    model through the public switch (Model.with_accelerator(PLAIN))."""
    model = model if native else model.with_accelerator(PLAIN)
    cache = model.new_cache(cache_len)
    out = [model.forward(torch.tensor(PROMPT), cache, probe, last_only=True)]
    out += [model.forward(torch.tensor([t]), cache, probe) for t in STEPS]
    return torch.cat(out), cache


def _by_stage(probe) -> dict:
    return {(b.step, b.pos0, n): b.values[g] for b in probe.recording.stats for g, n in enumerate(b.names)}


def test_the_native_step_reads_the_models_own_weights(tiny_model):
    """No second copy of the weights: each layer pointer the step hands decode.c is the model's own tensor's."""
    nat = _native_or_skip(tiny_model)
    for f in LAYER_SLOTS:
        ptrs = ctypes.cast(nat.layer_ptrs[f], ctypes.POINTER(ctypes.c_void_p))
        assert [ptrs[i] for i in range(tiny_model.config.num_layers)] == [
            getattr(lw, f).data_ptr() for lw in tiny_model.weights.layers]


def test_logits_and_cache_equal_the_pytorch_forward(tiny_model):
    nat = _native_or_skip(tiny_model)
    calls = []
    real = NativeDecoder.__call__
    NativeDecoder.__call__ = lambda self, *a: calls.append(a[2]) or real(self, *a)
    try:
        a, ca = _run(tiny_model)
    finally:
        NativeDecoder.__call__ = real
    b, cb = _run(tiny_model, native=False)
    assert calls == list(range(len(PROMPT), len(PROMPT) + len(STEPS)))   # every decode step, none of the prefill
    assert nat is tiny_model.accelerator.decode
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ca.k, cb.k, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ca.v, cb.v, rtol=1e-5, atol=1e-6)
    assert ca.get_pos() == cb.get_pos() == len(PROMPT) + len(STEPS)


def test_logits_by_hand_for_one_step(tiny_model):
    """One decode step written out in plain torch ops (no engine code) from the cache the prefill left."""
    _native_or_skip(tiny_model)
    m, c = tiny_model, tiny_model.config
    cache = m.new_cache(16)
    m.forward(torch.tensor(PROMPT), cache, last_only=True)
    keys0, values0 = cache.k.clone(), cache.v.clone()
    got = m.forward(torch.tensor([STEPS[0]]), cache)[0]
    pos, H, K, hd, w = len(PROMPT), c.num_heads, c.num_kv_heads, c.head_dim, m.weights

    def norm(v, g):
        return v / torch.sqrt((v.double() ** 2).mean() + c.rms_norm_eps).float() * g

    def rot(v):      # (heads, hd) at position pos
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2).double() / hd))
        ang = torch.cat([pos * inv, pos * inv]).float()
        return v * ang.cos() + torch.cat([-v[:, hd // 2:], v[:, :hd // 2]], -1) * ang.sin()

    x = w.embed[STEPS[0]].clone()
    for i, lw in enumerate(w.layers):
        qkv = norm(x, lw.attn_norm) @ lw.wqkv
        q, k, v = qkv[:H * hd].view(H, hd), qkv[H * hd:(H + K) * hd].view(K, hd), qkv[(H + K) * hd:].view(K, hd)
        keys = torch.cat([keys0[i, :, :pos], rot(k)[:, None]], 1)                 # (K, S, hd)
        values = torch.cat([values0[i, :, :pos], v[:, None]], 1)
        z = torch.stack([torch.softmax(keys[h // (H // K)] @ rot(q)[h] / hd ** 0.5, -1) @ values[h // (H // K)]
                         for h in range(H)])
        x = x + z.reshape(-1) @ lw.wo
        gate, up = (norm(x, lw.mlp_norm) @ lw.w_gate_up).chunk(2)
        x = x + (torch.nn.functional.silu(gate) * up) @ lw.w_down
    want = norm(x, w.norm) @ w.lm_head
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_statistics_of_every_stage_equal_the_pytorch_path(tiny_model):
    _native_or_skip(tiny_model)
    pa, pb = Probe().record_stats("*"), Probe().record_stats("*")
    a, _ = _run(tiny_model, pa)
    b, _ = _run(tiny_model, pb, native=False)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    sa, sb = _by_stage(pa), _by_stage(pb)
    assert sa.keys() == sb.keys()
    decode = [k for k in sa if k[1] >= len(PROMPT)]
    names = {k[2] for k in decode}
    assert names == set(forward_stages(tiny_model.config.num_layers))      # every stage a decode forward offers
    for k in decode:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_statistics_equal_dense_statistics_of_captured_stages(tiny_model):
    """Independent of the batcher: the native rows against dense_stats of the tensors a capture keeps."""
    _native_or_skip(tiny_model)
    stats = Probe().record_stats("*")
    _run(tiny_model, stats)
    cap = Probe().capture(["blocks.1.*", "logits"])
    _run(tiny_model, cap, native=False)
    got = _by_stage(stats)
    pos, compared = len(PROMPT) + 2, 0
    for c in cap.recording.captures:
        if c.positions != [pos]:
            continue
        t = c.value.transpose(0, 1) if c.name.endswith(("scores", "pattern")) else c.value
        want = dense_stats(t.reshape(t.shape[0], -1))
        torch.testing.assert_close(got[(0, pos, c.name)], want, rtol=1e-5, atol=1e-5)
        compared += 1
    assert compared == 18          # the 17 stages of block 1, and the logits


def test_which_probes_the_native_step_serves(tiny_model):
    names = _native_or_skip(tiny_model).names
    assert Probe().record_stats("*").served_by(names)
    assert inspection_probe(timing=True).served_by(names)           # the app's: statistics, logits, timing
    assert not Probe().capture("blocks.0.attn_out").served_by(names)
    assert not Probe().record_stats("*").replace("blocks.0.mlp.act", lambda x, ctx: x).served_by(names)
    assert not Probe().record_stats("*").override_weight("blocks.0.attn.wo", lambda w: w).served_by(names)
    p = Probe().record_stats("*")
    assert p.served_by(names)
    p.capture("blocks.1.mlp.act")                                    # a new spec: the answer is asked again
    assert not p.served_by(names)
    calls = []
    real = NativeDecoder.__call__
    NativeDecoder.__call__ = lambda self, *a: calls.append(1) or real(self, *a)
    try:
        _run(tiny_model, Probe().record_stats("*").capture("blocks.0.attn_out"))
        assert calls == []
        _run(tiny_model, Probe().record_stats("blocks.1.*"))
        assert len(calls) == len(STEPS)
    finally:
        NativeDecoder.__call__ = real


def test_the_apps_probe_decodes_natively_with_the_same_logits_statistics_and_marks(tiny_model):
    """The app's run (inspection_probe: statistics of every stage, the logits captured, per-layer timing)
    decodes through the native step and records what the PyTorch forward records: the same captured logits
    and statistics, and a timing mark after the embedding, every layer and the logits of each step."""
    _native_or_skip(tiny_model)
    calls, real = [], NativeDecoder.__call__
    NativeDecoder.__call__ = lambda self, *a: calls.append(1) or real(self, *a)
    try:
        fast = inspection_probe(timing=True)
        a, _ = _run(tiny_model, fast)
    finally:
        NativeDecoder.__call__ = real
    slow = inspection_probe(timing=True)
    b, _ = _run(tiny_model, slow, native=False)
    assert len(calls) == len(STEPS)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    caps = [[c.value for c in p.recording.captured("logits")] for p in (fast, slow)]
    assert len(caps[0]) == len(caps[1]) == 1 + len(STEPS)
    for x, y in zip(*caps):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    sa, sb = _by_stage(fast), _by_stage(slow)
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-4, atol=1e-4)
    L = tiny_model.config.num_layers
    want = ["start", "embed", *(f"blocks.{i}" for i in range(L)), "logits"]
    for p in (fast, slow):                 # one call per forward here: the prefill's, then each decode step's
        starts = [i for i, (_, label, _) in enumerate(p.recording.marks) if label == "start"]
        assert len(starts) == 1 + len(STEPS)
        last = [(label, t) for _, label, t in p.recording.marks[starts[-1]:]]
        assert [label for label, _ in last] == want
        assert all(t1 <= t2 for (_, t1), (_, t2) in zip(last, last[1:]))      # each stage ends after the last


def test_a_probe_on_some_stages_keeps_only_those(tiny_model):
    _native_or_skip(tiny_model)
    p = Probe().record_stats(["blocks.1.mlp.*", "logits"])
    _run(tiny_model, p)
    decode = {k[2] for k in _by_stage(p) if k[1] >= len(PROMPT)}
    assert decode == {"blocks.1.mlp.gate", "blocks.1.mlp.up", "blocks.1.mlp.act", "logits"}


def test_a_nan_under_statistics_is_redone_by_the_pytorch_forward(tiny_model_dir):
    model = load_model(tiny_model_dir, device="cpu", dtype="float32")
    lw = model.weights.layers[1]
    wo = lw.wo.clone()
    wo[3, 5] = float("nan")
    model.weights.layers[1] = dataclasses.replace(lw, wo=wo)
    _native_or_skip(model)
    pa, pb = Probe().record_stats("*"), Probe().record_stats("*")
    _run(model, pa)
    _run(model, pb, native=False)
    sa, sb = _by_stage(pa), _by_stage(pb)
    assert sa.keys() == sb.keys()
    nan_col = 5
    key = (0, len(PROMPT), "blocks.1.attn_out")
    assert sa[key][0, nan_col] > 0                          # the NaN is counted, as the PyTorch path counts it
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-5, atol=1e-5, equal_nan=True)


def test_unbuildable_library_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises((RuntimeError, OSError)):
        build.build(tmp_path / "x.so")
    assert not (tmp_path / "x.so").exists() and not list(tmp_path.glob("*.so"))


def test_no_native_step_without_a_library(tiny_model_dir, monkeypatch):
    from engine.native import step
    monkeypatch.setattr(step.build, "load", lambda: (None, "no compiler"))
    model = load_model(tiny_model_dir, device="cpu", dtype="float32")
    assert model.accelerator.decode is None
    a, _ = _run(model)
    assert torch.isfinite(a).all() and a.shape == (1 + len(STEPS), model.config.vocab_size)


def test_turned_off_by_environment(monkeypatch):
    monkeypatch.setenv("LLM_INSPECTOR_NATIVE", "0")
    build.load.cache_clear()
    try:
        lib, why = build.load()
        assert lib is None and "LLM_INSPECTOR_NATIVE=0" in why
    finally:
        monkeypatch.delenv("LLM_INSPECTOR_NATIVE")
        build.load.cache_clear()


def test_only_loaded_models_get_the_native_copy(tiny_model):
    """A model made from another (a precision plan, a quantised copy) decodes with the PyTorch forward rather
    than make its own copy of the weights."""
    from engine.model import Model
    _native_or_skip(tiny_model)
    assert precision_plan(tiny_model, ["blocks.0.mlp"]).accelerator.decode is None
    copy = Model(tiny_model.config, tiny_model.weights, tiny_model.tokenizer, device=tiny_model.device,
                 dtype=tiny_model.dtype)
    assert copy.accelerator.decode is None
    a, _ = _run(copy)
    b, _ = _run(tiny_model, native=False)
    assert torch.equal(a, b)            # the same PyTorch forward, bit for bit
