"""inspector.views.experts on Qwen3-MoE with a dense layer among the experts layers (mlp_only_layers) and on
Mixtral: the routing is what the engine computed, the tables and the load agree with it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from inspector.views import experts as ex
from tests.unit.test_family_kv_cache import FAMILIES, PROMPT, family_model


@pytest.fixture(scope="module")
def qwen_moe(tmp_path_factory, tokenizer_files):
    FAMILIES["qwen3_moe"] = dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 norm_topk_prob=True, mlp_only_layers=[2])
    try:
        return family_model("qwen3_moe", tmp_path_factory.mktemp("fam") / "qwen3_moe", tokenizer_files)[0]
    finally:
        del FAMILIES["qwen3_moe"]


def test_routing_skips_dense_layers_and_matches_the_engines_gates(qwen_moe):
    cfg = qwen_moe.config
    assert cfg.layer_moe == (True, True, False, True)
    ids = qwen_moe.tokenizer.encode(PROMPT)
    r = ex.expert_routing(qwen_moe, ids)
    T = len(ids)
    assert r.layers == (0, 1, 3) and r.router.shape == r.gates.shape == (3, T, 4)
    # the gates: the router's softmax, its top 2 kept and renormalised (norm_topk_prob), 0 elsewhere
    top, idx = torch.topk(r.probs, 2, dim=-1)
    want = torch.zeros_like(r.probs).scatter_(-1, idx, top / top.sum(-1, keepdim=True))
    assert torch.allclose(r.gates, want, atol=1e-6)
    assert torch.allclose(r.gates.sum(-1), torch.ones(3, T), atol=1e-6)


def test_tables_and_load_agree_with_the_routing(qwen_moe):
    ids = qwen_moe.tokenizer.encode(PROMPT)
    r = ex.expert_routing(qwen_moe, ids)
    labels = [str(i) for i in ids]
    table = ex.routing_table(r, labels)
    T = len(ids)
    assert len(table) == 3 * T * 2 and set(table["layer"]) == {0, 1, 3}
    one = table[table["layer"] == 3]
    assert list(one[one["rank"] == 0]["expert"]) == r.gates[2].argmax(-1).tolist()
    assert np.allclose(one.groupby("position")["gate"].sum(), 1.0)
    assert (one["router_prob"] <= 1).all() and (one.groupby("position")["gate"].diff().dropna() <= 0).all()
    assert len(ex.routing_table(r, labels, [1])) == T * 2
    load = ex.expert_load(r)
    assert len(load) == 3 * 4 and (load.groupby("layer")["tokens"].sum() == 2 * T).all()
    assert np.allclose(load.groupby("layer")["share"].sum(), 1.0)
    assert np.allclose(load.groupby("layer")["gate_total"].sum(), T, atol=1e-4)
    counts = r.gates.ne(0).sum(1)                                               # (L, E)
    assert load["tokens"].tolist() == counts.flatten().tolist()
    fig = ex.top_expert_figure(r, labels)
    assert [list(row) for row in fig.data[0].z] == r.gates.argmax(-1).tolist()
    assert list(fig.data[0].y) == ["layer 0", "layer 1", "layer 3"]


def test_a_dense_model_has_no_routing(tiny_model):
    assert ex.moe_layers(tiny_model.config) == []
    with pytest.raises(ValueError, match="no mixture-of-experts layer"):
        ex.expert_routing(tiny_model, [1, 2, 3])
