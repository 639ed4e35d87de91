"""The head atlas (engine.tools.head_atlas) on a hand-built two-layer Llama whose heads are planted: layer 0 head 0
is a previous-token head (its query and key are constants, so RoPE alone makes its score peak at offset 1), layer 1
head 0 an induction head (layer 0 head 0 copies the previous token's content into the stream; layer 1 head 0 matches
the query's token against that copy on the slowest rotary pairs) and layer 1 head 2 a duplicate-token head (the
query's token against each key's own, so it splits its attention evenly over the copies of its token). MLPs and every other head are zero. The planted
heads rank first; the previous-token score equals the softmax of the analytic RoPE scores computed here by hand;
the scoring functions give hand-computed answers on hand-made patterns; two atlases are identical; STOP stops it;
the CLI prints the same in JSON."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from engine import InputError, load_model
from engine.progress import STOP, Stopped
from engine.tools.head_atlas import default_corpus, head_atlas, induction_score, pattern_scores
from tests.helpers import ROOT, engine_cli, tiny_config, write_model_dir

pytestmark = pytest.mark.unit
AMP = (12.0, 12.0, 6.0, 3.0)        # layer 0 head 0: score(i, j) = sum_f AMP[f] cos(theta_f (i - j - 1))
MATCH = 60.0                        # layer 1 head 0: score = MATCH x cos(this token's content, previous token's)
DUP = 8.0                           # layer 1 head 2: score = DUP x cos(content, content) x 64/3 (layer 1's RMS)
CONTENT = 8                         # content in dims 1..8, the previous token's copy in 9..16
SLOTS = [4, 5, 6, 7, 12, 13, 14, 15]      # head dims of rotary pairs 4..7: with rope_theta 1e6, < 0.13 rad in 128
TEXTS = ["The cat sat on the mat. The cat sat on the mat again, and the dog sat on the cat.",
         "A previous-token head attends from each token to the one before it, whatever the text says."]


def planted_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d, f, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, theta = d // H, cfg["rope_theta"]
    emb = torch.zeros(V, d)
    emb[:, 0] = 1.0                                   # a constant direction: layer 0's query and key read it
    c = torch.randn(V, CONTENT, generator=g)
    emb[:, 1:1 + CONTENT] = c / c.norm(dim=1, keepdim=True)       # unit content: every row has one RMS
    t = {"model.embed_tokens.weight": emb, "model.norm.weight": torch.ones(d),
         "lm_head.weight": torch.randn(V, d, generator=g) * d ** -0.5}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": torch.ones(d), p + "post_attention_layernorm.weight": torch.ones(d),
              p + "mlp.gate_proj.weight": torch.zeros(f, d), p + "mlp.up_proj.weight": torch.zeros(f, d),
              p + "mlp.down_proj.weight": torch.zeros(d, f),
              p + "self_attn.q_proj.weight": torch.zeros(H * hd, d), p + "self_attn.k_proj.weight": torch.zeros(KV * hd, d),
              p + "self_attn.v_proj.weight": torch.zeros(KV * hd, d), p + "self_attn.o_proj.weight": torch.zeros(d, H * hd)}
    rms0 = math.sqrt(2 / d)                           # layer 0's input: 1 in dim 0 and a unit content vector
    q, k = t["model.layers.0.self_attn.q_proj.weight"], t["model.layers.0.self_attn.k_proj.weight"]
    for fr, a in enumerate(AMP):      # pair fr: q = (s, 0), k = s (cos th, sin th): q.k rotated = s^2 cos(th (i-j-1))
        th, s = theta ** (-2 * fr / hd), math.sqrt(a * math.sqrt(hd)) * rms0
        q[fr, 0], k[fr, 0], k[fr + hd // 2, 0] = s, s * math.cos(th), s * math.sin(th)
    v, o = t["model.layers.0.self_attn.v_proj.weight"], t["model.layers.0.self_attn.o_proj.weight"]
    for j in range(CONTENT):
        v[j, 1 + j], o[1 + CONTENT + j, j] = 1.0, 1.0
    q1, k1 = t["model.layers.1.self_attn.q_proj.weight"], t["model.layers.1.self_attn.k_proj.weight"]
    s = math.sqrt(MATCH * math.sqrt(hd))
    d_s = math.sqrt(DUP * math.sqrt(hd))
    for j, slot in enumerate(SLOTS):
        q1[slot, 1 + j], k1[slot, 1 + CONTENT + j] = s, s
        q1[2 * hd + slot, 1 + j], k1[hd + slot, 1 + j] = d_s, d_s      # head 2 (KV head 1): token vs token
    return t


@pytest.fixture(scope="module")
def planted(tmp_path_factory, tokenizer_files):
    cfg = tiny_config(rope_theta=1e6)
    path = write_model_dir(tmp_path_factory.mktemp("planted") / "planted", tokenizer_files, cfg, planted_tensors(cfg))
    return path, load_model(path, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def atlas(planted):
    return head_atlas(planted[1], TEXTS, repeats=2, length=32, seed=3)


def hand_previous_token(model, ids: list[int]) -> float:
    """Layer 0 head 0's mean attention from i to i-1, from the analytic scores: softmax over j <= i of
    sum_f AMP[f] cos(theta_f (i - j - 1))."""
    hd, theta, T = model.config.head_dim, 1e6, len(ids)
    i, j = torch.arange(T, dtype=torch.float64)[:, None], torch.arange(T, dtype=torch.float64)[None, :]
    s = sum(a * torch.cos(theta ** (-2 * fr / hd) * (i - j - 1)) for fr, a in enumerate(AMP))
    p = s.masked_fill(j > i, -math.inf).softmax(-1)
    return float(p[torch.arange(1, T), torch.arange(0, T - 1)].mean())


def test_the_planted_heads_rank_first(planted, atlas):
    model = planted[1]
    assert (atlas.layers, atlas.heads) == (2, 4)
    prev, ind = atlas.ranked("previous-token"), atlas.ranked("induction")
    encoded = [model.tokenizer.encode(t) for t in TEXTS]
    assert (prev[0]["layer"], prev[0]["head"]) == (0, 0) and prev[0]["previous-token"] > 0.9
    assert prev[1]["previous-token"] < 0.2                    # the others attend uniformly or by content
    assert (ind[0]["layer"], ind[0]["head"]) == (1, 0) and ind[0]["induction"] > 0.9
    assert ind[1]["induction"] < 0.2
    dup = atlas.ranked("duplicate-token")
    assert (dup[0]["layer"], dup[0]["head"]) == (1, 2) and dup[0]["duplicate-token"] > 0.45
    assert dup[1]["duplicate-token"] < 0.2
    shares = [c / (c + 1) for ids in encoded for i, t in enumerate(ids) if (c := ids[:i].count(t))]
    # an even split over the earlier copies and itself; within 0.01, as the layer-1 RMS differs a little from key to
    # key (layer 0's copy is 98 % one-hot, not 100 %), which moves the split at this sharpness
    assert dup[0]["duplicate-token"] == pytest.approx(sum(shares) / len(shares), abs=0.01)
    want = sum(hand_previous_token(model, ids) * (len(ids) - 1) for ids in encoded) / sum(len(i) - 1 for i in encoded)
    assert atlas.scores["previous-token"][0, 0] == pytest.approx(want, abs=2e-4)
    assert atlas.scores["entropy"][0, 0] < atlas.scores["entropy"][0, 1]     # sharp against uniform
    assert atlas.scores["entropy"][0, 1] > 2.0


def test_the_scores_of_a_hand_made_pattern():
    ids = [5, 7, 5, 9, 7]
    p = torch.zeros(2, 5, 5)
    p[0, 0, 0] = 1.0                                          # head 0: i -> i-1 (row 0 -> itself)
    for i in range(5):                                        # head 1: uniform over 0..i
        if i:
            p[0, i, i - 1] = 1.0
        p[1, i, :i + 1] = 1.0 / (i + 1)
    s = {n: sums / counts for n, (sums, counts) in pattern_scores(p, ids).items()}
    assert s["previous-token"].tolist() == pytest.approx([1.0, (1 / 2 + 1 / 3 + 1 / 4 + 1 / 5) / 4])
    assert s["first-token"].tolist() == pytest.approx([0.25, (1 / 2 + 1 / 3 + 1 / 4 + 1 / 5) / 4])
    assert s["self"].tolist() == pytest.approx([0.0, (1 / 2 + 1 / 3 + 1 / 4 + 1 / 5) / 4])
    # earlier copies: position 2 (token 5 at 0), position 4 (token 7 at 1); head 0 looks at 1 and 3: none
    assert s["duplicate-token"].tolist() == pytest.approx([0.0, (1 / 3 + 1 / 5) / 2])
    assert s["entropy"].tolist() == pytest.approx([0.0, sum(math.log(n) for n in (2, 3, 4, 5)) / 4])


def test_the_induction_score_of_a_hand_made_pattern():
    n, start = 4, 1                                          # [bos] a b c d a b c d
    T = start + 2 * n
    ind, prev = torch.zeros(1, T, T), torch.zeros(1, T, T)
    for i in range(T):
        prev[0, i, max(i - 1, 0)] = 1.0
        ind[0, i, i - n + 1 if i >= start + n else i] = 1.0
    assert induction_score(ind, n, start).tolist() == [1.0]
    assert induction_score(prev, n, start).tolist() == [0.0]
    half = 0.5 * ind + 0.5 * prev
    assert induction_score(half, n, start).tolist() == [0.5]


def test_two_atlases_are_identical_and_the_seed_draws_the_tokens(planted, atlas):
    again = head_atlas(planted[1], TEXTS, repeats=2, length=32, seed=3)
    for name, a in atlas.scores.items():
        assert np.array_equal(a, again.scores[name]), name
    assert again.random_ids == atlas.random_ids
    assert all(r[:32] == r[32:] and len(r) == 64 for r in atlas.random_ids)
    other = head_atlas(planted[1], TEXTS[:1], repeats=1, length=32, seed=4)
    assert other.random_ids[0] != atlas.random_ids[0]


def test_stop_between_two_forwards_gives_no_atlas(planted):
    heard = []

    def on_progress(p):
        heard.append(p.fraction)
        return STOP if len(heard) == 2 else None
    with pytest.raises(Stopped):
        head_atlas(planted[1], TEXTS, repeats=2, length=16, on_progress=on_progress)
    assert heard == [0.0, 0.25]
    heard.clear()
    head_atlas(planted[1], TEXTS, repeats=1, length=16, on_progress=lambda p: heard.append(p.fraction))
    assert heard == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])


def test_the_default_corpus_is_the_projects_own_prose(planted):
    tok = planted[1].tokenizer
    texts = default_corpus(tokenizer=tok, max_tokens=400)
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert texts and texts[0] in readme
    assert all(len(t) >= 200 for t in texts)
    assert sum(len(tok.encode(t)) for t in texts) <= 400


def test_the_cli_prints_the_atlas_as_json(planted, monkeypatch, tmp_path):
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(tmp_path))      # the atlas it keeps goes here
    r = engine_cli("atlas", "--model", planted[0], "--device", "cpu", "--dtype", "float32", "--json",
                   "--text", TEXTS[0], "--text", TEXTS[1], "--repeats", "2", "--length", "32", "--seed", "3")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["layers"], d["heads"], len(d["heads_scored"])) == (2, 4, 8)
    assert d["top"]["previous-token"][0] == [0, 0] and d["top"]["induction"][0] == [1, 0]
    head = next(h for h in d["heads_scored"] if (h["layer"], h["head"]) == (1, 0))
    assert head["induction"] > 0.9


@pytest.mark.parametrize("kw, named", [({"repeats": 0}, "repeats=0"), ({"length": 1}, "length=1"),
                                       ({"length": 513}, "length=513"), ({"repeats": 65}, "repeats=65")])
def test_bad_sizes_are_refused_by_name(planted, kw, named):
    with pytest.raises(InputError, match=named):
        head_atlas(planted[1], TEXTS, **kw)


def test_texts_too_short_to_score_are_refused(planted):
    with pytest.raises(InputError, match="two or more tokens"):
        head_atlas(planted[1], ["a"], repeats=1, length=8)
