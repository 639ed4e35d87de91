"""The bytes a model's weights hold, by dtype (engine.weights.Weights.nbytes_by_dtype, what `bench` and the sidebar
show), counted by hand from the tiny model's shapes: a tied model's one matrix counted once, a precision plan's fp32
units beside the bf16 rest, a variant's shared tensors not counted twice."""
from __future__ import annotations

import pytest
import torch

from engine import load_model
from engine.bench.held import held_figures, held_line
from engine.memory import process_rss
from engine.variants import cast_model, precision_plan
from tests.helpers import TINY

pytestmark = pytest.mark.unit

d, F, V, L = TINY["hidden_size"], TINY["intermediate_size"], 49152, TINY["num_hidden_layers"]
hd = d // TINY["num_attention_heads"]
ATTN = d + d * (TINY["num_attention_heads"] + 2 * TINY["num_key_value_heads"]) * hd + TINY["num_attention_heads"] * hd * d
MLP = d + 3 * d * F                     # mlp_norm, gate + up, down
PARAMS_UNTIED = 2 * V * d + d + L * (ATTN + MLP)


def test_the_untied_tiny_model_holds_every_parameter_once_in_float32(tiny_model):
    assert tiny_model.weights.nbytes_by_dtype() == {torch.float32: 4 * PARAMS_UNTIED}
    assert tiny_model.weights.nbytes() == 4 * PARAMS_UNTIED


def test_a_tied_model_holds_its_embedding_once_and_reads_it_as_the_lm_heads_transpose(tiny_looping_model):
    w = tiny_looping_model.weights
    assert w.tied() and w.embed.data_ptr() == w.lm_head.data_ptr()
    assert torch.equal(w.embed, w.lm_head.t())
    assert w.nbytes_by_dtype() == {torch.float32: 4 * (PARAMS_UNTIED - V * d)}
    cast = cast_model(tiny_looping_model, "bfloat16")                     # a cast keeps the tie
    assert cast.weights.tied() and cast.weights.nbytes_by_dtype() == {torch.bfloat16: 2 * (PARAMS_UNTIED - V * d)}


def test_a_precision_plans_fp32_units_are_counted_beside_the_rest(tiny_model_dir):
    model = load_model(tiny_model_dir, device="cpu", dtype="bfloat16")
    plan = precision_plan(model, ["blocks.0.mlp"])
    assert plan.weights.nbytes_by_dtype() == {torch.bfloat16: 2 * (PARAMS_UNTIED - MLP), torch.float32: 4 * MLP}


def test_the_bench_reports_the_weights_it_holds(tiny_model):
    f = held_figures(tiny_model, process_rss())
    assert f["weights_bytes"] == 4 * PARAMS_UNTIED and f["weights_bytes_by_dtype"] == {"float32": 4 * PARAMS_UNTIED}
    assert "float32 " in held_line(f) and "target <= 1.15" in held_line(f)
