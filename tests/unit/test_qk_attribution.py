"""Why a head attends there (engine.tools.qk_attribution) on the tiny Llama (4 query heads, 2 KV heads): the terms
sum to the score the forward computed (its attn.scores stage) within its float32 rounding, at every layer, for heads
of both KV groups, at a key before the query and at the query itself; at layer 0 the stream is the embedding alone,
so its one term is the score, computed by hand here from the weights; bad input is refused by name."""
from __future__ import annotations

import json

import pytest
import torch

from engine import InputError, Probe
from engine.rope import rope_tables, rotate
from engine.tools.qk_attribution import MAX_POSITIONS, qk_attribution
from tests.helpers import engine_cli

pytestmark = pytest.mark.unit
TEXT = "The cat sat on the mat. The cat sat on the"


@pytest.mark.parametrize("layer, head, q, k", [(0, 0, 6, 2), (1, 1, 9, 3), (1, 2, 11, 11), (1, 3, 11, 0)])
def test_the_terms_sum_to_the_forwards_score(tiny_model, layer, head, q, k):
    ids = tiny_model.tokenizer.encode(TEXT)
    r = qk_attribution(tiny_model, ids, layer, head, q, k)
    probe = Probe().capture(f"blocks.{layer}.attn.scores")
    tiny_model.logits(ids, probe)
    score = float(probe.recording.captured(f"blocks.{layer}.attn.scores")[0].value[head, q, k])
    assert r.score == score and r.exact
    assert abs(r.total - score) <= 1e-5 * max(1.0, abs(score)), (r.total, score)
    assert r.terms.shape == (len(r.names), len(r.names)) and r.names[0] == "embed" and r.names[-1] == "bias"
    labels, grouped = r.by_group()
    assert float(grouped.sum()) == pytest.approx(r.total, rel=1e-12, abs=1e-12)
    assert len(labels) == 1 + 2 * layer + 1


def test_at_layer_zero_the_one_term_is_the_score_by_hand(tiny_model):
    cfg, lw = tiny_model.config, tiny_model.weights.layers[0]
    ids = tiny_model.tokenizer.encode(TEXT)
    q, k, head = 7, 3, 2
    r = qk_attribution(tiny_model, ids, 0, head, q, k)
    e = tiny_model.weights.embed[torch.tensor(ids)].double()
    hd, H = cfg.head_dim, cfg.num_heads
    kv = head // (H // cfg.num_kv_heads)

    def side(p, first):
        x = e[p] * torch.rsqrt(e[p].pow(2).mean() + cfg.rms_norm_eps) * lw.attn_norm.double()
        v = (x @ lw.wqkv.double()[:, first:first + hd]).view(1, 1, hd)
        cos, sin = rope_tables(cfg, p + 1, "cpu", torch.float64)
        return rotate(v, cos[p:p + 1], sin[p:p + 1]).flatten()
    want = cfg.head_dim ** -0.5 * float(side(q, head * hd) @ side(k, (H + kv) * hd))
    assert float(r.terms[0, 0]) == pytest.approx(want, rel=1e-12)
    assert float(r.terms.abs().sum()) == pytest.approx(abs(want), rel=1e-12)    # no bias, no other part


@pytest.mark.parametrize("args, msg", [((2, 0, 3, 1), "layer must be"), ((0, 4, 3, 1), "head must be"),
                                       ((0, 0, 99, 1), "query must be"), ((0, 0, 3, 4), "key must be"),
                                       ((0, 0, 3, -1), "key must be")])
def test_bad_input_is_refused_by_name(tiny_model, args, msg):
    with pytest.raises(InputError, match=msg):
        qk_attribution(tiny_model, tiny_model.tokenizer.encode(TEXT), *args)
    with pytest.raises(InputError, match=f"1 to {MAX_POSITIONS:,} positions"):
        qk_attribution(tiny_model, [1] * (MAX_POSITIONS + 1), 0, 0, 0, 0)


def test_the_cli_prints_the_split(tiny_model_dir):
    r = engine_cli("qk", TEXT, "--model", tiny_model_dir, "--layer", "1", "--head", "1", "--query", "9", "--key",
                   "3", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert abs(d["total"] - d["score"]) <= 1e-5 * max(1.0, abs(d["score"])) and d["exact"]
    assert d["top_pairs"] and set(d["top_pairs"][0]) == {"query side", "key side", "term"}
    bad = engine_cli("qk", TEXT, "--model", tiny_model_dir, "--layer", "1", "--head", "1", "--query", "2", "--key",
                     "5")
    assert bad.returncode != 0 and "key must be" in bad.stderr
