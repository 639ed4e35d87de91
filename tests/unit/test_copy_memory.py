"""A copy of a loaded model's weights, or a tuned lens fit, that would not fit is refused before it is made
(engine.memory.check_work_fits):
a model kept quantised (a GGUF file as stored) is copied through its float32 values by a cast (engine.variants.
cast_model: the NaN doctor's precision comparison, the rescue set) and by a re-quantization (engine.tools.quant.
quantized_model: the Quantization page's comparison and scoreboard), 8 bytes a value for the 8B-shaped Q4_K file's
4.5 GB of blocks -- 64 GB on a 24 GB machine, which the kernel's out-of-memory killer ended. The bytes are counted
here by hand from the tiny file's shapes."""
from __future__ import annotations

import pytest

import engine.memory
from engine import load_model
from engine.bench import size_files
from engine.errors import ModelLoadError
from engine.memory import gb
from engine.tools.quant import quantized_model
from engine.variants import cast_model

pytestmark = pytest.mark.unit

D, F, LAYERS, V, KV_ROWS = 256, 512, 2, 49152, 2 * 64
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": D, "intermediate_size": F,
        "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": V,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": True,
        "hidden_act": "silu"}
# values by hand: the tied embedding, per layer q (D x D), k and v (KV_ROWS x D), o (D x D), gate, up, down (F x D)
MATRIX_VALUES = V * D + LAYERS * (2 * D * D + 2 * KV_ROWS * D + 3 * F * D)
NORM_VALUES = D + LAYERS * 2 * D


@pytest.fixture
def stored(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(tmp_path / "cache"))
    return load_model(size_files.write_gguf("tiny", TINY, "Q8_0", tmp_path), quant="stored")


def test_the_float_copy_of_a_model_kept_quantised_is_counted_by_its_shapes(stored):
    assert stored.weights.dequantized_nbytes() == 4 * MATRIX_VALUES
    assert stored.weights.values() == MATRIX_VALUES + NORM_VALUES


def test_a_cast_and_a_requantization_that_do_not_fit_are_refused_before_they_are_made(stored, monkeypatch):
    cast_need = 4 * MATRIX_VALUES + 2 * (MATRIX_VALUES + NORM_VALUES)       # float32 values, then their bf16 copy
    quant_need = 4 * MATRIX_VALUES + 4 * (MATRIX_VALUES + NORM_VALUES)      # float32 values, each one's round trip
    monkeypatch.setattr(engine.memory, "available_bytes", lambda: 4 * MATRIX_VALUES)
    with pytest.raises(ModelLoadError, match=f"bfloat16 copy of .* needs {gb(cast_need)} .* not computed"):
        cast_model(stored, "bfloat16")
    with pytest.raises(ModelLoadError, match=f"Q8_0 copy of .* needs {gb(quant_need)} .* not computed"):
        quantized_model(stored, "Q8_0")
    monkeypatch.setattr(engine.memory, "available_bytes", lambda: 2 * quant_need + (512 << 20))
    assert cast_model(stored, "bfloat16").weights.layers[0].w_down.dtype == cast_model(stored, "bfloat16").dtype
    assert not quantized_model(stored, "Q8_0").weights.quantized()


def test_a_tuned_lens_fit_that_does_not_fit_is_refused_before_its_sums_are_allocated(stored, monkeypatch):
    """Its float64 sums of every layer (2 d^2 + 2 d values each) and the quantised unembedding's float32 values: for
    the 8B-shaped file 8.6 GB + 2.1 GB, which took the Activations page's fit to 13.5 GB of RSS."""
    from engine.tools.tuned_lens import fit_stages

    need = LAYERS * (2 * D * D + 2 * D) * 8 + 4 * V * D
    monkeypatch.setattr(engine.memory, "available_bytes", lambda: need)
    with pytest.raises(ModelLoadError, match=f"the tuned lens fit needs {gb(need)} .* not computed"):
        fit_stages(stored, ["def f(x): return x + 1", "class A: pass"], steps=0)
    monkeypatch.setattr(engine.memory, "available_bytes", lambda: need + (1 << 30))
    assert fit_stages(stored, ["def f(x): return x + 1", "class A: pass"], steps=0).lens.U.shape[0] == LAYERS
