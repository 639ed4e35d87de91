"""The public forward is enough for every tool: stop_after ends a forward after a named stage (every stage up to
it as in a full forward, nothing after it computed), on_layer hears each block before it runs, and run_blocks
runs a span of blocks on a given residual stream, equal to the full forward's stream at the span's end."""
from __future__ import annotations

import pytest
import torch

from engine import load_model
from engine.errors import InputError
from engine.inspection.probe import Probe
from engine.model import Model
from engine.progress import STOP, Stopped
from engine.variants import precision_plan
from tests.helpers import tiny_config, write_model_dir

pytestmark = pytest.mark.unit
LAYERS = 4
IDS = torch.tensor([(11 * i + 5) % 700 + 10 for i in range(9)])


@pytest.fixture(scope="module")
def model4(tmp_path_factory, tokenizer_files):
    path = write_model_dir(tmp_path_factory.mktemp("tiny4") / "tiny-llama-4", tokenizer_files,
                           tiny_config(num_hidden_layers=LAYERS))
    return load_model(path, device="cpu", dtype="float32")


@pytest.fixture()
def block_calls(monkeypatch):
    """Every call of the model's block, as (layer, whole block?)."""
    calls: list[tuple[int, bool]] = []
    block = Model._block

    def counted(self, p, lw, x, cache, i, at, eps, mlp=True, *rest):
        calls.append((i, mlp))
        return block(self, p, lw, x, cache, i, at, eps, mlp, *rest)
    monkeypatch.setattr(Model, "_block", counted)
    return calls


def run(model, stop_after=None, **kw):
    """One forward of IDS capturing every stage: (output, [(name, value)] in forward order, cache)."""
    probe = Probe().capture("*")
    cache = model.new_cache(len(IDS))
    out = model.forward(IDS, cache, probe, stop_after=stop_after, **kw)
    return out, [(c.name, c.value) for c in probe.recording.captures], cache


@pytest.mark.parametrize("stop_after, offered_last, blocks", [
    ("blocks.1.attn.pattern", "blocks.1.resid_mid", [(0, True), (1, False)]),
    ("blocks.2.attn_norm", "blocks.2.resid_mid", [(0, True), (1, True), (2, False)]),
    ("blocks.1.mlp.act", "blocks.1.resid_post", [(0, True), (1, True)]),
    (2, "blocks.2.resid_post", [(0, True), (1, True), (2, True)]),
    ("embed", "embed", []),
    ("final_norm", "final_norm", [(i, True) for i in range(LAYERS)]),
])
def test_stop_after_offers_what_the_full_forward_offers_up_to_its_half_block_and_computes_nothing_after(
        model4, block_calls, stop_after, offered_last, blocks):
    full_logits, full, _ = run(model4)
    assert block_calls == [(i, True) for i in range(LAYERS)]
    block_calls.clear()
    out, got, cache = run(model4, stop_after)
    names = [n for n, _ in full]
    assert [n for n, _ in got] == names[:names.index(offered_last) + 1]       # no stage after it was offered
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, full))
    assert block_calls == blocks                                                # no later block ran
    assert torch.equal(out, dict(full)[offered_last])                          # the stream where it stopped
    assert cache.get_pos() == len(IDS)


def test_stop_after_embed_returns_the_embedding_rows(model4, block_calls):
    out = model4.forward(IDS, model4.new_cache(len(IDS)), stop_after="embed")
    assert torch.equal(out, model4.weights.embed[IDS]) and block_calls == []


def test_stop_after_logits_is_the_full_forward(model4):
    plain = model4.forward(IDS, model4.new_cache(len(IDS)))
    assert torch.equal(model4.forward(IDS, model4.new_cache(len(IDS)), stop_after="logits"), plain)


@pytest.mark.parametrize("bad", ["tokenizer", "sampler.probs", "detokenizer", f"blocks.{LAYERS}.attn.q",
                                 "blocks.0.attn.nope", "blocks.*.attn.pattern", LAYERS, -1, True, 1.5])
def test_stop_after_outside_the_forward_is_an_input_error_naming_it(model4, bad):
    with pytest.raises(InputError, match="stop_after"):
        model4.forward(IDS, model4.new_cache(len(IDS)), stop_after=bad)
    assert model4.live_hooks == 0


def test_chunks_after_a_stop_read_the_cache_rows_the_stop_wrote(model4):
    """A forward stopped in block 2 writes blocks 0..2's keys and values: a second chunk stopped there too
    sees the same attention as one forward over all positions."""
    name = "blocks.2.attn.pattern"
    whole = Probe().capture(name)
    model4.forward(IDS, model4.new_cache(len(IDS)), whole, stop_after=name)
    cache, parts = model4.new_cache(len(IDS)), Probe().capture(name)
    model4.forward(IDS[:5], cache, parts, stop_after=name)
    model4.forward(IDS[5:], cache, parts, stop_after=name)
    (w,), (a, b) = whole.recording.captured(name), parts.recording.captured(name)
    assert cache.get_pos() == len(IDS) and b.positions == list(range(5, len(IDS)))
    assert torch.allclose(a.value, w.value[:, :5, :5], atol=1e-6) and torch.allclose(b.value, w.value[:, 5:], atol=1e-6)


def test_on_layer_hears_each_block_just_before_it_runs(model4, block_calls):
    heard: list[tuple[int, int]] = []
    plain = model4.forward(IDS, model4.new_cache(len(IDS)))
    told = model4.forward(IDS, model4.new_cache(len(IDS)), on_layer=lambda i: heard.append((i, len(block_calls))))
    assert heard == [(i, LAYERS + i) for i in range(LAYERS)]      # block i heard when blocks 0..i-1 have run
    assert torch.equal(told, plain)
    heard.clear()
    model4.forward(IDS, model4.new_cache(len(IDS)), on_layer=lambda i: heard.append((i, 0)),
                   stop_after="blocks.1.attn.v")
    assert [i for i, _ in heard] == [0, 1]                          # a stop in block 1: blocks 2 and 3 never start


def test_an_on_layer_answer_stop_ends_the_forward_before_that_block(model4, block_calls):
    """The one progress protocol's STOP reaches the forward as on_layer's answer; the forward (not the callback)
    ends the call: block 2 and later never run and the cache is not advanced."""
    cache, before = model4.new_cache(len(IDS)), len(block_calls)
    probe = Probe().capture("blocks.*.resid_post")
    with pytest.raises(Stopped):
        model4.forward(IDS, cache, probe, on_layer=lambda i: STOP if i == 2 else None)
    assert len(block_calls) - before == 2 and cache.get_pos() == 0
    assert sorted({c.name for c in probe.recording.captures}) == ["blocks.0.resid_post", "blocks.1.resid_post"]
    assert model4.live_hooks == 0                                         # the probe was detached all the same


def streams(model) -> list[torch.Tensor]:
    """The full forward's residual stream entering each block, and leaving the last: (T, d) each."""
    probe = Probe().capture(["embed", "blocks.*.resid_post"])
    model.forward(IDS, model.new_cache(len(IDS)), probe)
    return [c.value for c in probe.recording.captures]


@pytest.mark.parametrize("start, end", [(0, LAYERS), (1, 3), (2, 3), (3, LAYERS), (2, 2)])
def test_a_span_of_blocks_equals_the_full_forward_at_the_span_end(model4, block_calls, start, end):
    s = streams(model4)
    block_calls.clear()
    out = model4.run_blocks(s[start], model4.new_cache(len(IDS)), start, end, positions=torch.arange(len(IDS)))
    assert torch.equal(out, s[end])
    assert block_calls == [(i, True) for i in range(start, end)]


def test_a_span_over_a_cache_holding_a_prefix_continues_the_full_forward(model4):
    """Positions 5.. of the stream through every block, reading the first five positions' keys from the cache
    a forward over them left: the full forward's last stream at those positions."""
    s, T = streams(model4), len(IDS)
    cache = model4.new_cache(T)
    model4.forward(IDS[:5], cache)
    rows = torch.arange(5, T)
    mask = torch.arange(T)[None, :] <= rows[:, None]                               # causal over the cache
    out = model4.run_blocks(s[0][5:], cache, 0, LAYERS, positions=rows, mask=mask)
    assert torch.allclose(out, s[LAYERS][5:], atol=1e-5)


def test_a_span_applies_the_probe_hooks_of_its_blocks(model4):
    """A replace hook in the span's block changes the result as it does in a full forward."""
    s = streams(model4)
    zero = Probe().replace("blocks.2.attn.z", lambda x, ctx: torch.zeros_like(x))
    patched = Probe().capture("blocks.3.resid_post").replace("blocks.2.attn.z", lambda x, ctx: torch.zeros_like(x))
    model4.forward(IDS, model4.new_cache(len(IDS)), patched)
    out = model4.run_blocks(s[2], model4.new_cache(len(IDS)), 2, LAYERS, zero, positions=torch.arange(len(IDS)))
    assert torch.equal(out, patched.recording.captured("blocks.3.resid_post")[0].value)
    assert not torch.equal(out, s[LAYERS]) and model4.live_hooks == 0


@pytest.mark.parametrize("start, end, shape", [(2, 1, (9, 64)), (0, LAYERS + 1, (9, 64)), (0, 1, (9, 32)),
                                               (0, 1, (9,)), (0, 1, (8, 64))])
def test_a_bad_span_is_an_input_error(model4, start, end, shape):
    with pytest.raises(InputError, match="run_blocks"):
        model4.run_blocks(torch.zeros(shape), model4.new_cache(9), start, end, positions=torch.arange(9))


def test_a_patching_pack_starting_past_a_plans_fp32_layer_keeps_the_fp32_stream(tiny_model_dir):
    """Patching runs its packed rows through run_blocks. In a float16 model whose residual stream is fp32 from
    block 0 on, a pack that starts at block 1 computes on the fp32 stream, as the full forward does (it was
    rounded to float16), and ends at the full forward's logits."""
    from engine.tools.patching import PackedRun, base_run, run_packed
    plan = precision_plan(load_model(tiny_model_dir, device="cpu", dtype="float16"), ["blocks.0.resid"])
    ids = [int(i) for i in IDS]
    seen = []

    def keep(rows):
        seen.append(rows)
        return rows
    base = base_run(plan, ids, extra=("blocks.1.resid_mid",))
    logits = run_packed(plan, base, [PackedRun(1, 0, edits=(("resid_mid", keep),))])
    full = base.acts["blocks.1.resid_mid"]
    assert full.dtype == seen[0].dtype == torch.float32
    assert torch.allclose(seen[0], full, atol=1e-3)
    assert torch.allclose(logits[0], plan.logits(ids)[-1], atol=1e-2)
