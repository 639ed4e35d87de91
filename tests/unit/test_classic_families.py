"""GPT-2, GPT-NeoX (Pythia) and Phi in the engine: the app's full inspection records every stage their blocks offer (and
no stage they lack), the native decode step takes them and its batched form refuses them naming their LayerNorm, a
position past GPT-2's n_positions is refused,
and GPT-2 checkpoints in the older layout (no "transformer." prefix, causal-mask buffers saved) load the same.

The tiny models are made by transformers (test-only) from the reference tier's configs (tests.reference)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import load_model
from engine.accelerator import PLAIN
from engine.errors import InputError
from engine.inspection.probe import inspection_probe
from engine.inspection.stages import forward_stages
from engine.native import build as native_build
from engine.native.step import refusal

pytestmark = pytest.mark.unit
transformers = pytest.importorskip("transformers")
CLASSIC = ("gpt2", "gpt_neox", "gpt_neox-sequential", "phi")
PROMPT = [1, 400, 2000, 31, 77, 1234, 9000, 15]
STEPS = [5, 4000, 321]


@pytest.fixture(scope="module")
def classic(tmp_path_factory, tokenizer_files):
    from tests.reference.family_models import build
    root = tmp_path_factory.mktemp("classic")
    return {name: build(name, root / name, tokenizer_files) for name in CLASSIC}


@pytest.mark.parametrize("name", CLASSIC)
def test_a_full_inspection_records_every_stage_the_block_offers(classic, name):
    model = load_model(classic[name], device="cpu", dtype="float32")
    probe = inspection_probe(timing=True)
    cache = model.new_cache(32)
    model.forward(torch.tensor(PROMPT), cache, probe, last_only=True)
    for t in STEPS:
        model.forward(torch.tensor([t]), cache, probe)
    names = forward_stages(model.config)
    recorded = {n for b in probe.recording.stats for n in b.names}
    assert set(names) <= recorded
    # the prompt's rows, its logits row (last_only: at its last position), each step's
    assert {b.pos0 for b in probe.recording.stats} == {0, len(PROMPT) - 1,
                                                      *range(len(PROMPT), len(PROMPT) + len(STEPS))}
    for b in probe.recording.stats:     # the statistics of each stage are numbers (a masked score's -inf aside)
        v = torch.as_tensor(b.values)
        assert not bool(torch.isnan(v).any())
    # the stages the family lacks are absent: no gate in a plain MLP, no resid_mid in a parallel block, no mlp_norm
    # in Phi's (one norm for both halves)
    assert "blocks.0.mlp.gate" not in names and "blocks.0.mlp.up" in names and "blocks.0.mlp.act" in names
    assert ("blocks.0.resid_mid" in names) == (name not in ("gpt_neox", "phi"))
    assert ("blocks.0.mlp_norm" in names) == (name != "phi")


@pytest.mark.parametrize("name", CLASSIC)
def test_the_native_step_takes_the_family_and_the_batched_step_refuses_it_naming_the_layernorm(classic, name):
    """decode.c computes these blocks (tests/unit/test_native_families.py holds it to the PyTorch forward);
    decode_rows.c computes Llama's only, and says what it lacks."""
    if native_build.load()[0] is None:
        pytest.skip(f"native library unavailable here: {native_build.load()[1]}")
    model = load_model(classic[name], device="cpu", dtype="float32")
    assert refusal(model) is None and model.accelerator.decode is not None, model.accelerator.why_not
    assert "norm='layer'" in model.accelerator.decode.rows_refusal


def test_a_position_past_gpt2s_n_positions_is_refused(classic):
    model = load_model(classic["gpt2"], device="cpu", dtype="float32").with_accelerator(PLAIN)
    n = model.context_length
    assert n == 256 and model.weights.pos_embed.shape == (n, 64)
    cache = model.new_cache(n)
    model.forward(torch.tensor([5] * (n - 1)), cache)
    model.forward(torch.tensor([5]), cache)          # the last position there is
    with pytest.raises(InputError, match="context length 256"):
        model.forward(torch.tensor([5]), cache)


def test_gpt2_in_the_older_layout_loads_the_same_model(classic, tmp_path):
    """openai-community/gpt2's file: names without "transformer.", each layer's attn.bias / attn.masked_bias buffers
    (the causal mask, not weights) saved beside the weights."""
    src = classic["gpt2"]
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(str(src / "model.safetensors")).items()}
    for i in range(4):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 256, 256, dtype=torch.bool))
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    old = load_model(tmp_path, device="cpu", dtype="float32").logits(PROMPT)
    assert torch.equal(old, load_model(src, device="cpu", dtype="float32").logits(PROMPT))


def test_models_made_from_gpt2_keep_its_positions_and_final_norm_bias(classic):
    """A cast copy and a precision plan compute GPT-2 as the model does (its learned positions and ln_f's bias
    travel with the weights, not only the Llama-shaped fields)."""
    from engine.variants import cast_model, precision_plan
    model = load_model(classic["gpt2"], device="cpu", dtype="float32")
    want = model.logits(PROMPT)
    assert torch.equal(cast_model(model, "float32").logits(PROMPT), want)
    plan = precision_plan(model, ["embed", "final_norm"])
    assert plan.weights.pos_embed is model.weights.pos_embed and plan.weights.norm_bias is model.weights.norm_bias
    assert torch.allclose(plan.logits(PROMPT), want, rtol=0, atol=1e-5)


def test_the_family_notes_say_what_the_classic_blocks_change(classic):
    from inspector.views.family import family_notes
    gpt2, neox, seq, phi = (load_model(classic[n], device="cpu", dtype="float32").config for n in CLASSIC)
    assert [page for _, page in family_notes(gpt2)] == ["attention"] and "learned" in family_notes(gpt2)[0][0]
    assert [page for _, page in family_notes(neox)] == ["attention", "activations"]
    assert "first 4 of each head's 16" in family_notes(neox)[0][0] and "no resid_mid" in family_notes(neox)[1][0]
    assert family_notes(seq) == []          # rotary_pct 1.0, sequential: nothing a Llama page does not show
    assert [page for _, page in family_notes(phi)] == ["attention", "activations"]
    assert "first 8 of each head's 16" in family_notes(phi)[0][0]


def test_pythia_in_the_older_layout_loads_the_same_model(classic, tmp_path):
    """A Pythia folder as EleutherAI published it: config.json with rotary_pct / rotary_emb_base at the top level and
    no attention_bias (GPT-NeoX's biases are on by default), and each layer's attention.bias, attention.masked_bias
    and rotary_emb.inv_freq buffers saved beside the weights."""
    import json
    src = classic["gpt_neox"]
    cfg = json.loads((src / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.pop("attention_bias")
    cfg |= {"rotary_pct": rope["partial_rotary_factor"], "rotary_emb_base": rope["rope_theta"], "rope_scaling": None}
    tensors = load_file(str(src / "model.safetensors"))
    for i in range(4):
        tensors[f"gpt_neox.layers.{i}.attention.bias"] = torch.tril(torch.ones(1, 1, 256, 256, dtype=torch.bool))
        tensors[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
        tensors[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = torch.ones(2)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    old = load_model(tmp_path, device="cpu", dtype="float32")
    assert (old.config.rotary_dim, old.config.parallel_residual, old.config.attention_bias) == (4, True, True)
    assert torch.equal(old.logits(PROMPT), load_model(src, device="cpu", dtype="float32").logits(PROMPT))


def test_phis_head_bias_is_loaded_cast_and_added_to_the_logits(classic):
    """Phi's lm_head has a bias (V,): a cast copy casts it with the head, a precision plan's fp32 logits unit takes it
    in fp32, and the logit lens (unembed) adds it as the forward does."""
    from engine.variants import cast_model
    model = load_model(classic["phi"], device="cpu", dtype="float32")
    assert model.weights.head_bias.shape == (model.config.vocab_size,) and bool(model.weights.head_bias.any())
    half = cast_model(model, "bfloat16")
    assert half.weights.head_bias.dtype == torch.bfloat16
    assert torch.equal(half.weights.head_bias, model.weights.head_bias.to(torch.bfloat16))
    # a precision plan's fp32 logits unit takes the bias with the head (from the fp32 source, not the bf16 copy's)
    from engine.variants import precision_plan
    plan = precision_plan(half, ["logits"], source=model)
    assert torch.equal(plan.weights.head_bias, model.weights.head_bias)
    last = f"blocks.{model.config.num_layers - 1}.resid_post"
    probe = inspection_probe().capture(last)
    want = model.forward(torch.tensor(PROMPT), model.new_cache(16), probe)
    resid = next(c.value for c in probe.recording.captures if c.name == last)
    assert torch.allclose(model.unembed(resid), want, rtol=0, atol=1e-5 * float(want.abs().max()))
