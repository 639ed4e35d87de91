"""engine.rope.RopeTables: a model's rotary tables are made for the first positions and grown as runs reach further,
and a grown table's first rows are the short table's bit for bit (the known answer: rope_tables over the whole
context, computed at once as the model held them before), for every kind of table (Llama 3's scaled frequencies,
Gemma 3's local table, longrope's two) and dtype; a forward past the first tables grows them, and its logits equal a
model whose tables were made long at once."""
from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.rope import RopeTables, rope_tables, table_kinds

pytestmark = pytest.mark.unit

BASE = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 20000}
CONFIGS = [
    BASE | {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    BASE | {"model_type": "gemma3_text", "head_dim": 16, "rope_local_base_freq": 10000, "sliding_window": 512,
            "hidden_activation": "gelu_pytorch_tanh",
            "layer_types": ["sliding_attention"], "query_pre_attn_scalar": 16},
    BASE | {"model_type": "phi3", "partial_rotary_factor": 0.5, "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "longrope", "long_factor": [1.5] * 4, "short_factor": [1.1] * 4}},
]


@pytest.mark.parametrize("raw", CONFIGS, ids=["llama3", "gemma3", "phi3-longrope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grown_tables_begin_with_the_short_ones_bit_for_bit(raw, dtype):
    cfg = ModelConfig.from_dict(raw, where="test")
    kinds = table_kinds(cfg)
    tables = RopeTables(cfg, torch.device("cpu"), dtype, kinds)
    assert tables.positions == RopeTables.START and set(tables) == set(kinds)
    short = {k: tables[k] for k in kinds}
    tables.ensure(RopeTables.START + 1)                          # doubles
    assert tables.positions == 2 * RopeTables.START
    tables.ensure(cfg.max_position_embeddings + 5)               # at most the context
    assert tables.positions == cfg.max_position_embeddings
    for k in kinds:
        whole = rope_tables(cfg, cfg.max_position_embeddings, torch.device("cpu"), dtype, k)
        for got, want, first in zip(tables[k], whole, short[k]):
            assert torch.equal(got, want)
            assert torch.equal(first, want[:RopeTables.START])


def test_a_forward_past_the_first_tables_grows_them_and_computes_as_long_tables(tiny_model, monkeypatch):
    """Tables made for 8 positions at first (START patched): a prefill of 12 and a decode step at 12 grow them, the
    native step's too; the logits equal those of the same model with tables made whole at once."""
    from engine.model import Model
    monkeypatch.setattr(RopeTables, "START", 8)
    src = tiny_model
    m = Model(src.config, src.weights, src.tokenizer, device=src.device, dtype=src.dtype, name="t", path=None,
              native_decode=True)
    assert m.rope.positions == 8 and m.accelerator.decode is not None, m.accelerator.why_not
    ids = torch.arange(3, 15)
    kv = m.new_cache(16)
    a = [m.forward(ids, kv, None, last_only=True), m.forward(torch.tensor([7]), kv, None)]
    assert m.rope.positions >= 13
    m.rope = RopeTables(m.config, m.device, m.dtype, tuple(m.rope))
    m.rope.ensure(m.config.max_position_embeddings)          # the whole context at once, as before
    kv = m.new_cache(16)
    b = [m.forward(ids, kv, None, last_only=True), m.forward(torch.tensor([7]), kv, None)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
