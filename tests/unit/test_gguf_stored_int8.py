"""load_model(quant="stored-int8"): the same GGUF blocks as quant="stored", multiplied in llama.cpp's arithmetic
(QuantMatrix arithmetic "int8": engine/native/quant_int8.h) where the format has that kernel (Q4_K, Q8_0, Q4_1),
the others by their float kernel and said so in the notes; the mode refused where "stored" is, a bad mode's error
naming the modes there are; the CLI takes it.

The logits against quant="stored" (the file's exact weights times an fp32 x): they must differ (x is rounded to 8
bits: a product moves by up to half a step of x times the weights, tests/unit/test_quant_int8.py's bound) and stay
close. Measured here on this random one-layer model: each int8 product of a normal x is 0.55 % (Q8_0, Q4_1) to 0.75 %
(Q4_K) off the exact one in relative L2 (the 8-bit x's step, amax / 127, over the block's spread), and the logits
2.9 % (the random block amplifies a perturbation of its products ~4-5 times); INT8_REL_L2 = 6e-2 is twice that: a
wrong kernel (a scale or a sub-block off) moves them by tens of per cent."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

from engine import load_model                                         # noqa: E402
from engine.errors import EngineError                                 # noqa: E402
from engine.native import build                                       # noqa: E402
from engine.quant_matrix import QuantMatrix                           # noqa: E402
from tests.unit.test_gguf_as_stored import IDS, cli_generate, write_gguf      # noqa: E402

pytestmark = pytest.mark.unit

INT8_REL_L2 = 6e-2
SLOTS = ("wqkv", "wo", "w_gate_up", "w_down")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_the_int8_mode_keeps_the_same_blocks_and_gives_each_format_with_a_kernel_llama_cpps_product(cache):
    path = write_gguf(cache / "k.gguf", k_quant=True)     # q/k/v Q8_0, wo Q5_1, gate/up Q4_0, down Q4_K, head Q4_1
    exact = load_model(path, device="cpu", dtype="float32", quant="stored")
    int8 = load_model(path, device="cpu", dtype="float32", quant="stored-int8")
    assert "llama.cpp int8 products" in int8.name and "int8" not in exact.name
    a, b = exact.weights, int8.weights
    arith = {f: getattr(b.layers[0], f).arithmetic for f in SLOTS} | {"lm_head": b.lm_head.arithmetic}
    assert arith == {"wqkv": "int8", "wo": "float", "w_gate_up": "float", "w_down": "int8", "lm_head": "int8"}
    assert all(getattr(lw, f).arithmetic == "float" for lw in a.layers for f in SLOTS)
    for f in SLOTS:
        m, n = getattr(a.layers[0], f), getattr(b.layers[0], f)
        assert isinstance(n, QuantMatrix) and n.format == m.format and torch.equal(n.blocks, m.blocks)
    assert a.notes == []
    assert b.notes == [
        "1 Q5_1 matrices (blk.0.attn_output.weight): Q5_1 has no int8 product (those with one: Q4_K, Q8_0, Q4_1); "
        "multiplied by its float kernel (x kept in float32)",
        "2 Q4_0 matrices (blk.0.ffn_gate.weight, blk.0.ffn_up.weight): Q4_0 has no int8 product (those with one: "
        "Q4_K, Q8_0, Q4_1); multiplied by its float kernel (x kept in float32)"]
    if build.load()[0] is None:
        pytest.skip("without the native library both modes are their numpy references")
    x, y = exact.logits(IDS), int8.logits(IDS)
    rel = ((x - y).norm() / x.norm()).item()
    assert 0 < rel <= INT8_REL_L2, rel


def test_the_int8_mode_is_refused_where_stored_is_and_a_bad_mode_names_the_modes(cache, tiny_model_dir):
    with pytest.raises(EngineError, match="quant='stored-int8' keeps a GGUF file's blocks.*not a .gguf file"):
        load_model(tiny_model_dir, quant="stored-int8")
    with pytest.raises(EngineError, match="quant='stored-int8' runs on the CPU in float32"):
        load_model(write_gguf(cache / "tiny.gguf"), dtype="bfloat16", quant="stored-int8")
    with pytest.raises(EngineError, match="unsupported quant 'int8'; use dequantized, stored, stored-int8"):
        load_model(tiny_model_dir, quant="int8")


def test_the_cli_loads_a_gguf_with_quant_stored_int8_and_refuses_an_unknown_mode(cache, capsys, monkeypatch):
    from engine.cli import main

    path = write_gguf(cache / "tiny.gguf")
    code, loaded = cli_generate(path, "stored-int8", monkeypatch)
    assert code == 0
    assert loaded and loaded[-1].weights.layers[0].wqkv.arithmetic == "int8"
    with pytest.raises(SystemExit):
        main(["generate", "hello", "--model", str(path), "--quant", "int8"])
    assert "invalid choice: 'int8' (choose from 'dequantized', 'stored', 'stored-int8')" in capsys.readouterr().err
