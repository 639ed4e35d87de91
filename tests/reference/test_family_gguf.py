"""GGUF import of every family llama.cpp names: a tiny transformers checkpoint written as llama.cpp's converter would
(tests/reference/gguf_writer.py), imported by engine.gguf_import, reads back equal to the folder it came from: every
tensor, and the engine's logits; the classic families' imports also against transformers' own logits."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file

from engine import load_model
from engine.errors import UnsupportedModelError
from engine.family import FAMILIES
from engine.gguf_import import import_gguf
from engine.quant_experts import QuantExperts
from tests.reference.family_models import CASES, build
from tests.reference.gguf_writer import write_gguf

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
pytestmark = pytest.mark.reference
PROMPT = [int(t) for t in torch.randint(3, 49000, (24,), generator=torch.Generator().manual_seed(11))]
# The cases of every family with a gguf_arch (mixtral is written as llama), without longrope.
CLASSIC = ["gpt2", "gpt_neox", "gpt_neox-sequential", "phi", "stablelm", "stablelm-qkv-bias", "starcoder2",
           "starcoder2-no-bias", "cohere"]
GGUF_CASES = ["llama3", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "granite", "smollm3",
              "mixtral", "qwen3_moe", *CLASSIC]
# What llama.cpp hard-codes rather than stores, so a file can only say it one way: the case set that way.
LLAMA_CPP_FIXED = {
    "gemma2": dict(query_pre_attn_scalar=16),         # = head_dim (key_length), below the 27B model's 46 layers
    "gemma3_text": dict(num_hidden_layers=6,          # every 6th layer global (set_swa_pattern(6))
                        layer_types=["sliding_attention"] * 5 + ["full_attention"]),
    "smollm3": dict(no_rope_layers=[1, 1, 1, 0]),     # every 4th layer without RoPE (n_no_rope_layer_step = 4)
    "gpt2": dict(n_inner=None),                       # GPT2Model writes feed_forward_length = 4 x n_embd
    "phi": dict(intermediate_size=256),               # so does Phi2Model
    "starcoder2": dict(sliding_window=None),          # StarCoder2Model writes no window: llama.cpp computes none
}


def _build(name: str, out, tokenizer_files):
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(CASES, name, dict(CASES[name], **LLAMA_CPP_FIXED.get(name, {})))
        return build(name, out, tokenizer_files)


def first_key_value(path) -> tuple[str, str]:
    """The file's first metadata pair, read by the GGUF layout (magic, version, tensor and pair counts, then each
    pair: u64 length and key, u32 type, value; type 8 is a string), where gguf-py's writer puts the architecture.
    Not gguf.GGUFReader: it reads every field of the file first, the tokenizer's 49,152 strings included, which
    took seconds per family (half this test's time)."""
    with open(path, "rb") as f:
        magic, _version, _tensors, pairs = struct.unpack("<4sIQQ", f.read(24))
        assert magic == b"GGUF" and pairs > 0
        key = f.read(struct.unpack("<Q", f.read(8))[0]).decode()
        assert struct.unpack("<I", f.read(4))[0] == 8, key
        return key, f.read(struct.unpack("<Q", f.read(8))[0]).decode()


@pytest.fixture(scope="module")
def bundled_reader(bundled_gguf_file):
    """The session's bundled GGUF (tests/conftest.py), whose tokenizer fields each family's file copies."""
    return bundled_gguf_file


@pytest.mark.parametrize("name", GGUF_CASES)
def test_gguf_of_each_family_imports_equal_to_its_folder(tmp_path, tokenizer_files, bundled_reader, name):
    folder = _build(name, tmp_path / "hf", tokenizer_files)
    path = write_gguf(folder, tmp_path / f"{name}.gguf", bundled_reader)
    fam = FAMILIES[CASES[name]["model_type"]]
    assert first_key_value(path) == ("general.architecture", fam.gguf_arch)
    imported = import_gguf(path, tmp_path / "imported")
    cfg = json.loads((imported / "config.json").read_text())
    assert cfg["model_type"] == fam.model_type
    want, got = load_file(str(folder / "model.safetensors")), load_file(str(imported / "model.safetensors"))
    assert set(got) == set(want)
    off = fam.norm_offset
    for key, w in want.items():
        w, g = w.float(), got[key].float()
        if off and key.endswith("norm.weight"):
            # llama.cpp stores Gemma's norms as 1 + w in float32, which drops w's lowest bits: equal as the engine
            # uses them, (1 + w) (the (1 + w) - 1 of the import is exact, and adding 1 back gives 1 + w again)
            w, g = w + off, g + off
        assert torch.equal(g, w), key
    ours = load_model(folder, device="cpu", dtype="float32")
    theirs = load_model(imported, device="cpu", dtype="float32")
    assert theirs.config == ours.config
    assert torch.equal(theirs.logits(PROMPT), ours.logits(PROMPT))
    if name in CLASSIC:
        import transformers
        ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        with torch.no_grad():
            want = ref(torch.tensor([PROMPT])).logits[0]
        assert float((theirs.logits(PROMPT) - want).abs().max() / want.abs().max()) <= 1e-4


def test_phi3_longrope_factors_are_refused(tmp_path, tokenizer_files, bundled_reader):
    """llama.cpp keeps longrope's per-frequency factors as tensors (rope_factors_long/short); the engine's config
    reads them from config.json only, so such a file is refused, naming them, not imported without them."""
    folder = build("phi3-longrope", tmp_path / "hf", tokenizer_files)
    path = write_gguf(folder, tmp_path / "phi3.gguf", bundled_reader)
    with pytest.raises(UnsupportedModelError, match="rope_factors_long"):
        import_gguf(path, tmp_path / "imported")
    assert not (tmp_path / "imported").exists()


def test_unknown_rope_scaling_is_refused(tmp_path, tokenizer_files, bundled_reader):
    folder = build("qwen2", tmp_path / "hf", tokenizer_files)
    path = write_gguf(folder, tmp_path / "q.gguf", bundled_reader,
                      kv={"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        import_gguf(path, tmp_path / "imported")


def test_a_classic_gguf_is_not_kept_as_stored_but_refused_by_name(tmp_path, tokenizer_files, bundled_reader):
    """quant='stored' assembles Llama's checkpoint; GPT-2's (learned positions, LayerNorm biases, Conv1D layout)
    is refused, naming the family and the way to load it, rather than loaded with its biases and positions lost."""
    folder = _build("gpt2", tmp_path / "hf", tokenizer_files)
    path = write_gguf(folder, tmp_path / "gpt2.gguf", bundled_reader)
    with pytest.raises(UnsupportedModelError, match="gpt2's is laid out otherwise.*quant='dequantized'"):
        load_model(path, device="cpu", dtype="float32", quant="stored")


# The families whose checkpoint is Llama's layout (engine.gguf_stored keeps their blocks, the MoE families' stacked
# experts as QuantExperts); llama3 is tests/unit/test_native_quant_step.py's.
STORED_CASES = ["qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "granite", "smollm3", "cohere",
                "mixtral", "qwen3_moe"]


@pytest.mark.parametrize("name", STORED_CASES)
def test_each_llama_layout_family_reads_back_as_stored_equal_to_its_dequantised_self(tmp_path, tokenizer_files,
                                                                                     bundled_reader, name):
    """A Q8_0 file of each family (its matrices quantised by gguf.quants.quantize, norms float32) loaded as stored
    and dequantised: both compute with the file's own values (a Q8_0 value d * q is exact in float32), so their
    logits differ only by float32 summation order -- the stored model's products are quant_ops.h's row dots, the
    dequantised model's are float products -- at most a few units of float32 rounding of the largest logit for sums
    of 64-96 terms (bound 1e-5 of the largest, as the native step is held to the PyTorch forward). The prefill
    (the PyTorch forward of each) and a greedy decode (the native step where the family takes it: stored and
    dequantised alike, the MoE families' kept experts too) give the same tokens. The MoE
    families' stacks are kept whole (QuantExperts), counted in the weights' bytes, and read by the tools as the
    dequantised model's own experts."""
    from engine import GenerationRun, SamplingParams
    from engine.inspection.probe import Probe
    folder = _build(name, tmp_path / "hf", tokenizer_files)
    path = write_gguf(folder, tmp_path / f"{name}.Q8_0.gguf", bundled_reader, quant="Q8_0")
    stored = load_model(path, device="cpu", dtype="float32", quant="stored")
    plain = load_model(path, device="cpu", dtype="float32")
    assert stored.weights.quantized(), "no matrix was kept in its blocks"
    assert (stored.accelerator.decode is None) == (plain.accelerator.decode is None), \
        (stored.accelerator.why_not, plain.accelerator.why_not)
    if stored.config.family.experts:        # every expert kept in its blocks, and decoded natively from them
        kept = [lw.experts_gate_up for lw in stored.weights.layers if lw.experts_gate_up is not None]
        assert kept and all(isinstance(t, QuantExperts) and t.format == "Q8_0" for t in kept)
        assert stored.accelerator.decode is not None, stored.accelerator.why_not
        assert any("router (Q8_0) dequantised" in n for n in stored.weights.notes)   # read as floats, and said
        floats, lw = stored.weights.floats().layers[0], plain.weights.layers[0]     # what the tools read
        assert torch.equal(floats.experts_gate_up, lw.experts_gate_up) and torch.equal(floats.experts_down,
                                                                                        lw.experts_down)
        assert stored.weights.nbytes_by_dtype()["Q8_0"] >= sum(t.nbytes for t in kept)
        int8 = load_model(path, device="cpu", dtype="float32", quant="stored-int8")      # llama.cpp's arithmetic
        experts = [lw.experts_down for lw in int8.weights.layers if lw.experts_down is not None]
        assert experts and all(t.arithmetic == "int8" and t[0].arithmetic == "int8" for t in experts)
        x, y = int8.logits(PROMPT), plain.logits(PROMPT)     # 8-bit x: within its own error, not float rounding's
        assert float((x - y).norm() / y.norm()) <= 0.06 and int8.accelerator.decode is not None
    a, b = stored.logits(PROMPT), plain.logits(PROMPT)
    assert float((a - b).abs().max() / b.abs().max()) <= 1e-5
    runs = [GenerationRun(m, PROMPT[:8], params=SamplingParams(temperature=0), max_new_tokens=8, ignore_eos=True,
                          probe=Probe().capture("logits")) for m in (stored, plain)]
    step, calls = stored.accelerator.decode, []
    if step is not None:        # the stored model's decode steps: every one native (spied)
        real = type(step).__call__
        type(step).__call__ = lambda self, *a, **k: calls.append(1) or real(self, *a, **k)
    try:
        runs[0].run()
    finally:
        if step is not None:
            type(step).__call__ = real
    runs[1].run()
    assert step is None or len(calls) == 7, len(calls)
    assert runs[0].token_ids == runs[1].token_ids
    for k in range(1, 8):
        x, y = (r.probe.recording.captured("logits", k)[0].value.float() for r in runs)
        assert float((x - y).abs().max() / y.abs().max()) <= 1e-5, k
