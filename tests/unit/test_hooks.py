"""Probe hooks: capture, statistics, replace; planted NaNs; hook lifetime."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine import EngineError, Probe, SamplingParams, plant, scale, zero_heads
from engine.generate import generate
from engine.inspection.stages import PLAIN_STAGES as LAYER_STAGES
from engine.inspection.stat_columns import STAT_NAMES
from tests.helpers import reference_stats

IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2683, 359, 253]


def test_every_stage_is_offered(tiny_model):
    probe = Probe().capture("*")
    generate(tiny_model, IDS[:4], max_new_tokens=2, ignore_eos=True, probe=probe)
    offered = {c.name for c in probe.recording.captures}
    assert offered == set(tiny_model.hook_names())
    assert len(tiny_model.hook_names()) == 2 + 2 * len(LAYER_STAGES) + 2 + 6 + 1


def test_capture_values_are_the_computation(tiny_model):
    cfg, w = tiny_model.config, tiny_model.weights
    probe = Probe().capture(["embed", "blocks.0.attn_norm", "blocks.0.attn.pattern", "blocks.0.attn.q"])
    tiny_model.logits(IDS, probe)
    embed = probe.recording.captured("embed")[0].value
    assert torch.equal(embed, w.embed[IDS])
    norm = probe.recording.captured("blocks.0.attn_norm")[0].value
    by_hand = embed / (embed.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps).sqrt() * w.layers[0].attn_norm
    assert torch.allclose(norm, by_hand, atol=1e-5)
    q = probe.recording.captured("blocks.0.attn.q")[0].value
    assert q.shape == (len(IDS), cfg.num_heads, cfg.head_dim)
    assert torch.allclose(q.reshape(len(IDS), -1), norm @ w.layers[0].wqkv[:, :cfg.num_heads * cfg.head_dim], atol=1e-5)
    pat = probe.recording.captured("blocks.0.attn.pattern")[0].value
    assert pat.shape == (cfg.num_heads, len(IDS), len(IDS))
    assert torch.allclose(pat.sum(-1), torch.ones(cfg.num_heads, len(IDS)), atol=1e-5)
    assert float(pat.triu(1).abs().max()) == 0.0      # causal: nothing attends to the future


def test_capture_filters_layers_and_positions(tiny_model):
    probe = Probe().capture("blocks.*.resid_post", layers=[1], positions=[2, 5])
    tiny_model.logits(IDS, probe)
    (c,) = probe.recording.captures
    assert (c.name, c.layer, c.positions) == ("blocks.1.resid_post", 1, [2, 5])
    full = Probe().capture("blocks.1.resid_post")
    tiny_model.logits(IDS, full)
    assert torch.equal(c.value, full.recording.captures[0].value[[2, 5]])


def test_stats_equal_reference_on_captured_tensors(tiny_model):
    probe = Probe().capture("*").record_stats("*")
    generate(tiny_model, IDS, max_new_tokens=3, seed=1, ignore_eos=True, probe=probe,
             params=SamplingParams(temperature=0.9, top_k=20))
    records = probe.recording.stat_records()
    assert len(records) > 3 * 2 * len(LAYER_STAGES)
    caps = {(c.step, c.name): c.value for c in probe.recording.captures}
    for r in records:
        x = caps[(r.step, r.name)]
        if r.name.endswith(("attn.scores", "attn.pattern")):
            x = x.transpose(0, 1)
        masked = r.name.endswith("attn.scores") or r.name.startswith("sampler.")
        ref = reference_stats(x.unsqueeze(0) if x.dim() == 1 else x, masked=masked)
        assert torch.allclose(r.values, ref, rtol=1e-4, atol=1e-5, equal_nan=True), r.name
    # the sampler's top-k cut (-inf) is a mask, not a fault
    assert probe.recording.first_nonfinite() is None


def test_stats_do_not_change_results(tiny_model):
    plain = tiny_model.logits(IDS)
    probed = tiny_model.logits(IDS, Probe().record_stats("*"))
    assert torch.allclose(plain, probed, atol=1e-5)  # explicit vs fused attention: same maths


def test_replace_interventions(tiny_model):
    base = tiny_model.logits(IDS)
    assert torch.equal(tiny_model.logits(IDS, Probe().replace("blocks.0.mlp.act", scale(1.0))), base)
    changed = tiny_model.logits(IDS, Probe().replace("blocks.1.attn.z", zero_heads(0, 1)))
    assert not torch.allclose(changed, base)
    probe = Probe().replace("blocks.1.attn.z", zero_heads(0, 1)).capture("blocks.1.attn.z")
    tiny_model.logits(IDS, probe)
    z = probe.recording.captures[0].value
    assert float(z[:, :2].abs().max()) == 0 and float(z[:, 2:].abs().max()) > 0
    # zeroing every head of the last layer's mlp output == removing it from the residual
    probe = Probe().replace("blocks.1.mlp_out", lambda x, ctx: torch.zeros_like(x)).capture(
        ["blocks.1.resid_mid", "blocks.1.resid_post"])
    tiny_model.logits(IDS, probe)
    assert torch.equal(probe.recording.captures[0].value, probe.recording.captures[1].value)


def test_replace_with_wrong_shape_is_an_error(tiny_model):
    with pytest.raises(EngineError, match="blocks.0.mlp.act"):
        tiny_model.logits(IDS, Probe().replace("blocks.0.mlp.act", lambda x, ctx: x[:, :3]))
    assert tiny_model.live_hooks == 0


@pytest.mark.parametrize("stage,layer,position", [("blocks.1.mlp.act", 1, 4), ("blocks.0.attn.q_rot", 0, 2),
                                                  ("blocks.1.resid_mid", 1, 0)])
def test_planted_nan_found_exactly_and_seen_downstream(tiny_model, stage, layer, position):
    probe = Probe().record_stats("*").replace(stage, plant(float("nan"), position=position, index=3))
    tiny_model.logits(IDS, probe)
    rec, pos = probe.recording.first_nonfinite()
    assert (rec.name, rec.layer, pos) == (stage, layer, position)
    names = [r.name for r in probe.recording.stat_records()]
    bad = {r.name for r in probe.recording.stat_records() if float(r.values[:, 5].sum() + r.values[:, 6].sum()) > 0}
    start = names.index(stage)
    # nothing before the plant is non-finite; the planted stage and every later stage that reads it is
    assert not bad & set(names[:start])
    downstream = [n for n in names[start:] if not n.endswith(("attn.q", "attn.k", "attn.v", "attn_norm", "mlp_norm",
                                                              "attn.q_rot", "attn.k_rot", "mlp.gate", "mlp.up"))
                  or n.startswith(f"blocks.{layer}") and names.index(n) == start]
    assert set(downstream) <= bad, sorted(set(downstream) - bad)
    assert {"final_norm", "logits"} <= bad


@pytest.mark.model
def test_planted_nan_on_bundled_model_layer_17(bundled_model):
    ids = bundled_model.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    probe = Probe().record_stats("*").replace("blocks.17.mlp.act", plant(float("nan"), position=5))
    bundled_model.logits(ids, probe)
    rec, pos = probe.recording.first_nonfinite()
    assert (rec.name, rec.layer, pos) == ("blocks.17.mlp.act", 17, 5)
    by_name = {r.name: r.values for r in probe.recording.stat_records()}
    # every later stage of layer 17 and every stage of later layers sees the NaN at position 5 (or later)
    for name, v in by_name.items():
        layer = int(name.split(".")[1]) if name.startswith("blocks.") else None
        if layer is not None and layer > 17 or name in ("blocks.17.mlp_out", "blocks.17.resid_post", "final_norm",
                                                        "logits"):
            assert float(v[5, 5]) > 0, name
            assert float(v[:5, 5].sum()) == 0, f"{name}: NaN before the planted position"
        if layer is not None and layer < 17:
            assert float(v[:, 5].sum()) == 0, name


def test_no_hook_outlives_its_call(tiny_model):
    assert tiny_model.live_hooks == 0
    probe = Probe().record_stats("*").capture("logits")
    generate(tiny_model, IDS[:3], max_new_tokens=2, probe=probe)
    assert tiny_model.live_hooks == 0

    def boom(x, ctx):
        assert tiny_model.live_hooks == 1     # live while the call runs
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        tiny_model.logits(IDS, Probe().replace("blocks.1.attn_out", boom))
    assert tiny_model.live_hooks == 0
    with pytest.raises(EngineError, match="outside a forward call"):
        probe("embed", torch.zeros(1, 4))


def test_timing_marks_cover_every_layer(tiny_model):
    probe = Probe(timing=True)
    generate(tiny_model, IDS[:3], max_new_tokens=2, ignore_eos=True, probe=probe)
    labels = [lbl for step, lbl, t in probe.recording.marks if step == 1]
    assert labels == ["start", "embed", "blocks.0", "blocks.1", "logits"]
    times = [t for step, lbl, t in probe.recording.marks if step == 1]
    assert times == sorted(times)


def test_stat_names():
    assert STAT_NAMES == ("min", "max", "mean", "std", "absmax", "nan", "inf")
    assert math.isclose(F.silu(torch.tensor(1.0)).item(), 1 / (1 + math.exp(-1)), rel_tol=1e-6)


def test_weight_override_is_run_only(tiny_model):
    before = tiny_model.weights.layers[1].w_down.clone()

    def poison(w):
        w[5, 7] = float("nan")
        return w
    probe = Probe().record_stats("*").override_weight("blocks.1.mlp.w_down", poison)
    tiny_model.logits(IDS, probe)
    rec, pos = probe.recording.first_nonfinite()
    assert (rec.name, rec.layer, pos) == ("blocks.1.mlp_out", 1, 0)
    assert torch.equal(tiny_model.weights.layers[1].w_down, before)       # the shared model is untouched
    assert torch.isfinite(tiny_model.logits(IDS)).all()
    with pytest.raises(EngineError, match="unknown weight"):
        Probe().override_weight("blocks.1.mlp.nope", poison)


def test_rms_eps_zero_on_zero_input_gives_nan(tiny_model):
    probe = Probe().record_stats("*").replace("embed", plant(0.0, position=2, index=slice(None)))
    probe.norm_eps = 0.0
    tiny_model.logits(IDS, probe)
    rec, pos = probe.recording.first_nonfinite()
    assert (rec.name, rec.layer, pos) == ("blocks.0.attn_norm", 0, 2)
    ok = Probe().record_stats("*").replace("embed", plant(0.0, position=2, index=slice(None)))
    tiny_model.logits(IDS, ok)                                             # with the model's eps: finite
    assert ok.recording.first_nonfinite() is None


def test_last_only_logits_belong_to_the_last_position(tiny_model):
    probe = Probe().record_stats(["embed", "logits"]).capture("logits").replace(
        "logits", plant(float("nan"), position=len(IDS) - 1))
    cache = tiny_model.new_cache(len(IDS))
    tiny_model.forward(torch.tensor(IDS), cache, probe, last_only=True)
    assert probe.recording.captured("logits")[0].positions == [len(IDS) - 1]
    rec, pos = probe.recording.first_nonfinite()
    assert (rec.name, pos) == ("logits", len(IDS) - 1)
    assert [r.pos0 for r in probe.recording.stat_records("embed")] == [0]
