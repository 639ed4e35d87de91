"""The native decode step (decode.c) on a GGUF model kept in its blocks (load_model(quant="stored")): each matrix's
product is quant_ops.h's row dot product over the file's bytes, held to the PyTorch forward of the same model
(Model.with_accelerator(PLAIN)), whose QuantMatrix.matmul decodes the same blocks.

Tolerance: both paths multiply the very same weights (the decoders are one copy, quant_ops.h) and at one token sum
each product in the same order (quant.c's one-row product is the dot decode.c calls), so the products agree exactly;
what differs is the rest of the step (RMSNorm, attention, SiLU: decode.c's loops against PyTorch's kernels), whose
fp32 sums of a few hundred terms differ by a few ulp, as on the float model (test_native_decode.py holds those to
1e-5). STEP_TOL = 1e-5 of the logits' scale (max |logit|) is that bound (measured here: below 1e-6, 4-6e-6 absolute on
logits of scale 8-9); the greedy tokens must be equal. quant="stored-int8" (llama.cpp's arithmetic, quant_int8.h): the
step and quant.c's product round x to 8 bits the same way and call the same row dot, so a product's output is the same
bits for the same x; the rest of the step still differs by ulps, and here (one layer) no x lies within those ulps of
an 8-bit rounding boundary, so the same bound holds. On deep models it does not: a value that flips its rounding moves
by a whole step of its block, and the flips compound (the bundled model, 30 layers: the native step's logits 2.5 %
relative L2 from the PyTorch forward's in int8, 1e-6 in float, measured 2026-12-07)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

from engine import GenerationRun, load_model                         # noqa: E402
from engine.generate import generate
from engine.accelerator import PLAIN                                 # noqa: E402
from engine.inspection.probe import inspection_probe                 # noqa: E402
from engine.native import build                                      # noqa: E402
from engine.quant_matrix import QuantMatrix                          # noqa: E402
from engine.sampling import SamplingParams                           # noqa: E402
from engine.native.step import NativeDecoder                          # noqa: E402
from tests.helpers import step_together_to_the_end                   # noqa: E402
from tests.unit.test_gguf_as_stored import write_gguf                # noqa: E402

pytestmark = pytest.mark.unit

STEP_TOL = 1e-5
PROMPT = [1, 260, 72, 101]
STEPS = [262, 33, 5, 104, 200, 7]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(tmp_path / "cache"))
    return tmp_path


def stored_model(path, quant="stored"):
    if build.load()[0] is None:
        pytest.skip(f"native library unavailable here: {build.load()[1]}")
    return load_model(path, device="cpu", dtype="float32", quant=quant)


def run(model, steps=STEPS):
    """Prompt (PyTorch prefill), then one token a call -> logits (1 + steps, V)."""
    kv = model.new_cache(32)
    out = [model.forward(torch.tensor(PROMPT), kv, last_only=True)]
    out += [model.forward(torch.tensor([t]), kv) for t in steps]
    return torch.cat(out)


# Q8_0 q/k/v and embedding, Q4_1 lm_head, Q5_1 wo, Q4_0 gate/up, Q5_0 down (test_gguf_as_stored.FORMATS); tied: the
# Q8_0 embedding is the head; k_quant: down in Q4_K (valid random blocks)
@pytest.mark.parametrize("quant", ["stored", "stored-int8"])
@pytest.mark.parametrize("tied,k_quant", [(False, False), (True, False), (False, True)])
def test_the_native_step_decodes_the_files_blocks_as_the_pytorch_forward_does(cache, tied, k_quant, quant):
    model = stored_model(write_gguf(cache / "q.gguf", tied=tied, k_quant=k_quant), quant)
    w = model.weights
    int8 = {m.format for m in (w.lm_head, *(getattr(lw, f) for lw in w.layers for f in ("wqkv", "wo", "w_gate_up",
                                                                                       "w_down")))
            if m.arithmetic == "int8"}
    assert int8 == (set() if quant == "stored" else {"Q8_0", "Q4_1"} - ({"Q4_1"} if tied else set())
                    | ({"Q4_K"} if k_quant else set()))
    assert all(isinstance(getattr(lw, f), QuantMatrix) for lw in w.layers for f in ("wqkv", "wo", "w_gate_up",
                                                                                      "w_down"))
    assert isinstance(w.lm_head, QuantMatrix) and w.tied() == tied
    step = model.accelerator.decode
    assert step is not None, model.accelerator.why_not
    calls = []
    real = type(step).__call__
    type(step).__call__ = lambda self, *a, **k: calls.append(a[2]) or real(self, *a, **k)
    try:
        a = run(model)
    finally:
        type(step).__call__ = real
    b = run(model.with_accelerator(PLAIN))
    assert calls == list(range(len(PROMPT), len(PROMPT) + len(STEPS)))       # every decode step went native
    diff = (a - b).abs().max().item()
    assert diff <= STEP_TOL * b.abs().max().item(), (diff, b.abs().max().item())
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("quant", ["stored", "stored-int8"])
def test_greedy_tokens_and_inspection_statistics_match_the_pytorch_forward(cache, quant):
    model = stored_model(write_gguf(cache / "q.gguf"), quant)
    assert model.accelerator.decode is not None, model.accelerator.why_not
    plain = model.with_accelerator(PLAIN)
    greedy = SamplingParams(temperature=0.0)
    p, q = inspection_probe(), inspection_probe()
    run_n = generate(model, torch.tensor(PROMPT), max_new_tokens=12, ignore_eos=True, probe=p, params=greedy)
    run_p = generate(plain, torch.tensor(PROMPT), max_new_tokens=12, ignore_eos=True, probe=q, params=greedy)
    assert run_n.token_ids == run_p.token_ids
    got, want = p.recording.stat_records(), q.recording.stat_records()
    assert [(r.name, r.layer) for r in got] == [(r.name, r.layer) for r in want] and got


def test_the_batched_native_rows_refuse_a_quantized_model_and_the_batch_runs_on_pytorch(cache):
    model = stored_model(write_gguf(cache / "q.gguf"))
    step = model.accelerator.decode
    assert "weights kept quantized" in step.rows_refusal
    with pytest.raises(ValueError, match="batched native step cannot run this model: weights kept quantized"):
        step.rows([5, 6], [model.new_cache(8), model.new_cache(8)], [0, 0], 1e-5, False)


def test_runs_of_a_quantized_model_stepped_together_never_call_the_rows_kernel(cache, monkeypatch):
    """engine.batch does not batch a quantized model's runs (decode_rows.c reads float matrices, and on the PyTorch
    forward a row would not be its native run alone, bit for bit): each steps alone on the native step, its tokens
    those of the run alone, and decode_rows.c is never called."""
    model = stored_model(write_gguf(cache / "q.gguf"))
    calls = []
    real = NativeDecoder.rows
    monkeypatch.setattr(NativeDecoder, "rows", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    specs = [(PROMPT, 0, 6), (PROMPT[:2], 3, 5), (STEPS, 7, 4)]
    greedy = SamplingParams(temperature=0.0)

    def runs(m):
        return [GenerationRun(m, torch.tensor(p), params=greedy, seed=s, max_new_tokens=n, ignore_eos=True)
                for p, s, n in specs]
    together, alone = runs(model), runs(model)
    step_together_to_the_end(together)
    for r in alone:
        r.run()
    assert calls == [] and all(r.batched_steps == 0 for r in together)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
