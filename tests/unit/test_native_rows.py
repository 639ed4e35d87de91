"""The native batched decode step (engine/native/decode_rows.c, NativeDecoder.rows), which Model.forward_batch takes
for a batch of runs (engine.batch: engine.forward_batch.Batch.rows) when the model has a native step, against the
PyTorch batched forward it stands in for (Model.with_accelerator(PLAIN)): the same logits, cache writes and every stage's statistics per row, rows of
different positions and cache lengths; tokens equal each run alone; a row that meets a NaN redoes the step on the
PyTorch path (only that run stops on it); a probe it cannot serve keeps the PyTorch path. A Llama of odd widths (a
vocabulary, a stream and an MLP none a multiple of eight, as GPT-2's 50,257 tokens are) takes both native steps, and
each row of its batched step is its run's lone native step bit for bit, in float32, bfloat16 and float16."""
from __future__ import annotations

import pytest
import torch

from engine import GenerationRun, SamplingParams
from engine import load_model
from engine.accelerator import PLAIN
from engine.batch import forward_together
from engine.inspection.probe import Probe, inspection_probe
from engine.native import build
from engine.native.step import NativeDecoder
from engine.tools.determinism import compare
from tests.helpers import assert_same_stats, step_together_to_the_end, tiny_config, write_model_dir

pytestmark = pytest.mark.unit

SPECS = [("hello there", 0, SamplingParams(temperature=0), 6),
         ("a much longer prompt than the first one, with more positions to attend to", 3,
          SamplingParams(temperature=0.9, top_k=40), 9),
         ("x", 11, SamplingParams(temperature=1.0, top_p=0.8), 7),
         ("seven rows make two of the kernel's row blocks", 5, SamplingParams(temperature=0.7), 5),
         ("five", 1, SamplingParams(temperature=0), 8), ("six", 2, SamplingParams(temperature=0), 4),
         ("and the seventh", 9, SamplingParams(temperature=1.2), 6)]


# the vocabulary 11 columns past its last sixteen (eight, then three one lane wide), the stream and q's width 60 (4 rows
# past the blocks of eight), k/v's 20, the MLP's 90 (2 rows past)
ODD = dict(vocab_size=49163, hidden_size=60, num_attention_heads=6, num_key_value_heads=2, intermediate_size=90)


@pytest.fixture(scope="module")
def odd_dir(tmp_path_factory, tokenizer_files):
    return write_model_dir(tmp_path_factory.mktemp("odd") / "odd-llama", tokenizer_files, tiny_config(**ODD))


@pytest.fixture
def odd_model(odd_dir, request):
    return load_model(odd_dir, device="cpu", dtype=getattr(request, "param", "float32"))


def _native_or_skip(model) -> NativeDecoder:
    if model.accelerator.decode is None:
        pytest.skip(f"native decode step unavailable here: {build.load()[1]}")
    return model.accelerator.decode


def _runs(model, specs=SPECS, probe=True):
    return [GenerationRun(model, p, params=sp, seed=s, max_new_tokens=n, ignore_eos=True,
                          probe=inspection_probe(timing=False) if probe else None) for p, s, sp, n in specs]


def _prefilled(model, specs=SPECS):
    runs = _runs(model, specs)
    for r in runs:
        r.step()
    return runs


def _rows_calls(monkeypatch) -> list:
    calls: list = []
    real = NativeDecoder.rows
    monkeypatch.setattr(NativeDecoder, "rows", lambda self, tokens, *a, **k: calls.append(len(tokens))
                        or real(self, tokens, *a, **k))
    return calls


@pytest.mark.parametrize("shape", ["tiny_model", "odd_model"])
def test_one_native_step_equals_the_pytorch_batched_forward(shape, request, monkeypatch):
    tiny_model = request.getfixturevalue(shape)
    _native_or_skip(tiny_model)
    calls = _rows_calls(monkeypatch)
    nat, ref = _prefilled(tiny_model), _prefilled(tiny_model.with_accelerator(PLAIN))
    for _ in range(3):                     # three steps: each row's cache grows at its own position
        got, want = (torch.stack(forward_together(runs)[0]) for runs in (nat, ref))      # no row failed
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()
        for n, (a, b) in enumerate(zip(nat, ref)):
            a.step(got[n])
            b.step(want[n])
    assert calls == [len(SPECS)] * 3       # the native path took every step, all seven rows in one call
    for a, b in zip(nat, ref):
        assert a.token_ids == b.token_ids
        n = a.cache.get_pos()
        assert torch.allclose(a.cache.k[:, :, :n], b.cache.k[:, :, :n], rtol=1e-4, atol=1e-5)
        assert torch.allclose(a.cache.v[:, :, :n], b.cache.v[:, :, :n], rtol=1e-4, atol=1e-5)
        assert_same_stats(a, b, rtol=1e-4, atol=1e-4)


def test_runs_stepped_natively_together_write_what_each_writes_alone(tiny_model, monkeypatch):
    _native_or_skip(tiny_model)
    calls = _rows_calls(monkeypatch)
    alone = _runs(tiny_model)
    for r in alone:
        r.run()
    together = _runs(tiny_model)
    step_together_to_the_end(together)
    assert calls and max(calls) == len(SPECS)
    for a, b in zip(alone, together):
        assert b.token_ids == a.token_ids and b.stop_reason == "max_new_tokens"
        assert_same_stats(a, b, rtol=1e-4, atol=1e-4)


def test_a_row_that_meets_a_nan_stops_only_its_own_run_as_alone(tiny_model, monkeypatch):
    """A NaN planted in one run's cached keys: the native call reports the row, the step is redone on the PyTorch
    path, and that run stops on non-finite logits exactly as it does alone; the others go on as alone."""
    _native_or_skip(tiny_model)
    calls = _rows_calls(monkeypatch)
    specs = SPECS[:3]

    def planted(runs):
        runs[1].cache.k[-1, 0, 3, 5] = float("nan")      # the last layer's keys
        return runs
    alone = planted(_prefilled(tiny_model, specs))
    for r in alone:
        r.run()
    together = planted(_prefilled(tiny_model, specs))
    step_together_to_the_end(together)
    assert calls                            # the native call was tried (and reported the row)
    assert alone[1].stop_reason == together[1].stop_reason == "non-finite logits"
    assert together[1].token_ids == alone[1].token_ids
    for a, b in zip(alone[::2], together[::2]):
        assert b.token_ids == a.token_ids and b.stop_reason == "max_new_tokens"
    nan_a = [r for r in alone[1].probe.recording.stat_records() if r.step == 1]
    nan_b = [r for r in together[1].probe.recording.stat_records() if r.step == 1]
    assert [r.name for r in nan_a] == [r.name for r in nan_b]
    for x, y in zip(nan_a, nan_b):          # NaN and Inf counts as the PyTorch path's alone
        assert torch.equal(x.values[:, 5:].nan_to_num(), y.values[:, 5:].nan_to_num()), x.name


def test_a_probe_the_native_step_cannot_serve_keeps_the_pytorch_path(tiny_model, monkeypatch):
    _native_or_skip(tiny_model)
    calls = _rows_calls(monkeypatch)
    runs = _prefilled(tiny_model, SPECS[:2])
    runs[0].probe = Probe().capture("blocks.0.attn.q")      # a capture of a stage the native step does not keep
    rows, _ = forward_together(runs)
    assert not calls and len(rows) == 2 and all(isinstance(r, torch.Tensor) for r in rows)


@pytest.mark.parametrize("odd_model", ["float32", "bfloat16", "float16"], indirect=True)
def test_an_odd_shaped_models_rows_are_each_its_lone_native_step_bit_for_bit(odd_model, monkeypatch):
    """The odd widths reach the products' tails (row_product.h): each run alone (every decode step the lone native
    step, none handed back) and the same runs stepped together on the batched native step give the same tokens,
    logits and statistics of every stage, torch.equal (engine.tools.determinism.compare)."""
    assert odd_model.accelerator.decode is not None, odd_model.accelerator.why_not
    assert _native_or_skip(odd_model).rows_refusal == ""
    calls, statuses, real = _rows_calls(monkeypatch), [], NativeDecoder.__call__
    monkeypatch.setattr(NativeDecoder, "__call__", lambda self, *a, **k: statuses.append(out := real(self, *a, **k))
                        or out)
    alone = _runs(odd_model)
    for r in alone:
        r.run()
    # every token but each run's first (its prefill's) is a decode step; a prompt of one token is one besides
    decodes = sum(n - 1 + (len(odd_model.tokenizer.encode(p)) == 1) for p, _, _, n in SPECS)
    assert [s[2] for s in statuses] == [0] * decodes and not calls
    together = _runs(odd_model)
    step_together_to_the_end(together)
    assert calls and max(calls) == len(SPECS)
    for a, b in zip(alone, together):
        t = compare(a, b)
        assert t.bit_identical, (a.token_ids, b.token_ids, t.first_step, t.first_stage)
