"""A probe's declared addition (Probe.add: a vector added to blocks.{i}.resid_post, a steering vector) on the native
batched step (engine/native/decode_rows.c, NativeDecoder.rows(adds=...)) and the lone one (decode.c,
NativeDecoder(add=...)): the logits of the PyTorch forward with
the same addition (float32 within 1e-5 of the largest logit, as tests/unit/test_native_decode.py holds the native
step; bfloat16 within two ulps, as tests/unit/test_native_half.py), each row bit for bit itself alone whatever its
neighbours add, steer() decoding both its runs there, and no path that cannot apply an addition ever serving a probe
that has one (its run then computes it on the PyTorch forward)."""
from __future__ import annotations

import pytest
import torch

from engine import GenerationRun, SamplingParams, load_model
from engine.accelerator import PLAIN
from engine.batch import step_together
from engine.batch.step import alone_reason
from engine.inspection.probe import Probe
from engine.native import build
from engine.native.step import NativeDecoder
from engine.settings import RunSettings
from engine.tools.steering import SteeringVector, steer

pytestmark = pytest.mark.unit

PROMPTS = ["The weather today is", "hello there, a longer prompt with more positions", "x"]


def _native_or_skip(model) -> NativeDecoder:
    if model.accelerator.decode is None:
        pytest.skip(f"native decode step unavailable here: {build.load()[1]}")
    return model.accelerator.decode


def _vector(model, seed: int, scale: float = 4.0) -> torch.Tensor:
    return scale * torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(seed))


def _by_hand(vector: torch.Tensor):
    """The addition as a replace hook computes it (the reference: no Probe.add involved)."""
    return lambda x, ctx: x + vector.to(x.dtype)


def _prefilled(model, prompt: str, probe: Probe | None = None) -> GenerationRun:
    run = GenerationRun(model.with_accelerator(PLAIN), prompt, params=SamplingParams(temperature=0),
                        max_new_tokens=6, ignore_eos=True, probe=probe)
    run.step()
    return run


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_with_an_addition_decode_as_the_pytorch_forward_with_it(tiny_model_dir, dtype):
    model = load_model(tiny_model_dir, device="cpu", dtype=dtype)
    step = _native_or_skip(model)
    v = _vector(model, 1)
    for layer in range(model.config.num_layers):
        nat = _prefilled(model, PROMPTS[0], Probe().replace(f"blocks.{layer}.resid_post", _by_hand(v)))
        ref = _prefilled(model, PROMPTS[0], Probe().replace(f"blocks.{layer}.resid_post", _by_hand(v)))
        lone = _prefilled(model, PROMPTS[0], Probe().replace(f"blocks.{layer}.resid_post", _by_hand(v)))
        for _ in range(3):
            tok, pos = nat.decode_input(), nat.cache.get_pos()
            got = step.rows([tok], [nat.cache], [pos], model.config.rms_norm_eps, False, adds=[{layer: v}])[0][0]
            # the lone step (decode.c) with the same addition: the batched row's logits bit for bit
            assert torch.equal(step(tok, lone.cache, pos, model.config.rms_norm_eps, False, add={layer: v})[0][0],
                               got)
            lone.cache.advance(1)
            want = ref.model.forward(torch.tensor([tok]), ref.cache, ref.probe, last_only=True)[0]
            plain = model.with_accelerator(PLAIN).logits(nat.prompt_ids + nat.token_ids)[-1]
            top = float(want.float().abs().max())
            bound = 1e-5 * top if dtype == "float32" else 4 * 2 ** -8 * top
            assert float((got.float() - want.float()).abs().max()) <= bound, (layer, dtype)
            assert float((got.float() - plain.float()).abs().max()) > 10 * bound      # the vector did move them
            nat.cache.advance(1)
            nat.step(got)
            ref.step(want)
        assert nat.token_ids == ref.token_ids


def test_batched_rows_with_additions_are_each_row_alone_bit_for_bit(tiny_model):
    step = _native_or_skip(tiny_model)
    eps = tiny_model.config.rms_norm_eps
    adds = [{0: _vector(tiny_model, 2)}, None, {0: _vector(tiny_model, 3), 1: _vector(tiny_model, 4)}]
    together = [_prefilled(tiny_model, p) for p in PROMPTS]
    alone = [_prefilled(tiny_model, p) for p in PROMPTS]
    for _ in range(4):
        got = step.rows([r.decode_input() for r in together], [r.cache for r in together],
                        [r.cache.get_pos() for r in together], eps, False, adds=adds)[0]
        for b, (r, a) in enumerate(zip(together, alone)):
            want = step.rows([a.decode_input()], [a.cache], [a.cache.get_pos()], eps, False, adds=[adds[b]])[0][0]
            assert torch.equal(got[b], want), b
            for run, row in ((r, got[b]), (a, want)):
                run.cache.advance(1)
                run.step(row)
    for r, a in zip(together, alone):
        n = r.cache.get_pos()
        assert r.token_ids == a.token_ids
        assert torch.equal(r.cache.k[:, :, :n], a.cache.k[:, :, :n]) and torch.equal(r.cache.v[:, :, :n],
                                                                                     a.cache.v[:, :, :n])
    # the row without an addition is its plain run alone on the native lone step (batch invariance holds with adds)
    plain = GenerationRun(tiny_model, PROMPTS[1], params=SamplingParams(temperature=0), max_new_tokens=6,
                          ignore_eos=True)
    plain.run()
    assert together[1].token_ids == plain.token_ids[:len(together[1].token_ids)]


def test_a_steered_run_decodes_on_the_native_batched_step(tiny_model, monkeypatch):
    _native_or_skip(tiny_model)
    calls: list = []
    real = NativeDecoder.rows
    monkeypatch.setattr(NativeDecoder, "rows", lambda self, tokens, *a, adds=None, **k: calls.append(
        (len(tokens), [sorted(r) if r else [] for r in adds or []])) or real(self, tokens, *a, adds=adds, **k))
    lone = []
    real_call = NativeDecoder.__call__
    monkeypatch.setattr(NativeDecoder, "__call__", lambda self, *a, **k: lone.append(1) or real_call(self, *a, **k))
    settings = RunSettings(prompt="The weather today is", chat=False, max_new_tokens=6,
                           params=SamplingParams(temperature=0), ignore_eos=True)
    vec = SteeringVector(1, _vector(tiny_model, 5, 1.0), ("p",), ("n",))
    run = steer(tiny_model, settings, vec, 8.0)
    # every decode step of both runs in one call: the plain row adds nothing, the steered one at its layer; from the
    # token where they part, a third row: the plain model (no addition) on the steered run's tokens
    j = next(i for i, (a, b) in enumerate(zip(run.plain_ids, run.steered_ids)) if a != b)
    n = settings.max_new_tokens - 1
    assert calls == [(2, [[], [1]])] * min(j, n) + [(3, [[], [1], []])] * (n - min(j, n)) and lone == []
    # and it is the run the PyTorch forward makes with the same vector added by a replace hook
    ref = GenerationRun(tiny_model.with_accelerator(PLAIN), settings.prompt, probe=Probe().replace(
        vec.stage, _by_hand(8.0 * vec.vector)), **settings.generation_kwargs())
    ref.run()
    assert run.steered_ids == ref.token_ids and run.steered_ids != run.plain_ids


def test_a_probe_with_an_addition_is_never_served_by_a_path_that_cannot_apply_it(tiny_model):
    step = _native_or_skip(tiny_model)
    v = _vector(tiny_model, 6)
    probe = Probe().capture("logits").add("blocks.1.resid_post", v)
    # the lone native step and the batch paths (engine.batch asks served_by with no stages) cannot apply it
    assert not probe.served_by(step.names) and not probe.served_by([])
    assert probe.served_by(step.names, adds=True) and not probe.served_by([], adds=True)
    assert not Probe().capture("blocks.0.mlp_out").add("blocks.1.resid_post", v).served_by(step.names, adds=True)

    def new(model, probe=None):
        return GenerationRun(model, PROMPTS[0], params=SamplingParams(temperature=0), max_new_tokens=6,
                             ignore_eos=True, probe=probe)
    ref = new(tiny_model.with_accelerator(PLAIN), Probe().replace("blocks.1.resid_post", _by_hand(v)))
    ref.run()
    lone = new(tiny_model, Probe().add("blocks.1.resid_post", v))
    lone.run()
    steered, plain = new(tiny_model, Probe().add("blocks.1.resid_post", v)), new(tiny_model)
    for run in (steered, plain):
        run.step()
    assert alone_reason(steered) is not None and alone_reason(plain) is None
    while not (steered.done and plain.done):
        step_together([steered, plain])
    assert lone.token_ids == steered.token_ids == ref.token_ids != plain.token_ids


@pytest.mark.parametrize("stage, vector, msg", [
    ("blocks.0.mlp_out", torch.zeros(64), "blocks.{i}.resid_post"),
    ("blocks.*.resid_post", torch.zeros(64), "blocks.{i}.resid_post"),
    ("blocks.0.resid_post", torch.zeros(2, 64), "1-D float tensor"),
])
def test_a_bad_addition_is_refused_by_name(stage, vector, msg):
    with pytest.raises(Exception, match=msg.replace("{", r"\{").replace("}", r"\}").replace(".", r"\.")):
        Probe().add(stage, vector)
