"""Each head's top windows of a head atlas (engine.tools.atlas_windows, gathered inside head_atlas's one pass) on the
planted two-layer model of test_head_atlas: for every score, layer and head, the atlas's TOP_K (sequence, query,
key, score) equal a brute force written here from the definitions, over patterns captured by a Probe in separate
forwards: every query position of every sequence scored by plain loops, sorted by (score, sequence, position). The
planted previous-token head's windows attend to the position before; the induction head's to the token after the
earlier copy; the merge is independent of the order sequences are offered in."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine import load_model
from engine.inspection.probe import Probe
from engine.tools.atlas_windows import TOP_K, TopWindows
from engine.tools.head_atlas import SCORE_NAMES, head_atlas
from tests.helpers import tiny_config, write_model_dir
from tests.unit.test_head_atlas import TEXTS, planted_tensors

pytestmark = pytest.mark.unit
LENGTH, REPEATS = 24, 2


@pytest.fixture(scope="module")
def planted(tmp_path_factory, tokenizer_files):
    cfg = tiny_config(rope_theta=1e6)
    path = write_model_dir(tmp_path_factory.mktemp("planted") / "planted", tokenizer_files, cfg, planted_tensors(cfg))
    return load_model(path, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def atlas(planted):
    return head_atlas(planted, TEXTS, repeats=REPEATS, length=LENGTH, seed=5)


def captured_patterns(model, ids: list[int]) -> list[np.ndarray]:
    """Every layer's (heads, T, T) softmax pattern of one forward, captured (not through the atlas's hook)."""
    probe = Probe().capture("blocks.*.attn.pattern")
    model.forward(torch.tensor(ids), model.new_cache(len(ids)), probe)
    got = {c.name: c.value for c in probe.recording.captures}
    return [got[f"blocks.{i}.attn.pattern"].double().numpy() for i in range(model.config.num_layers)]


def brute_candidates(p: np.ndarray, ids: list[int], head: int) -> dict[str, list[tuple[float, int, int]]]:
    """(score, query, key) of every query position of one head's (T, T) pattern, from the definitions."""
    T, out = len(ids), {n: [] for n in SCORE_NAMES if n != "induction"}
    for i in range(1, T):
        row = p[head, i]
        out["previous-token"].append((row[i - 1], i, i - 1))
        out["first-token"].append((row[0], i, 0))
        out["self"].append((row[i], i, i))
        out["entropy"].append((-sum(w * math.log(max(w, 1e-300)) for w in row[:T]), i, int(np.argmax(row))))
        copies = [j for j in range(i) if ids[j] == ids[i]]
        if copies:
            out["duplicate-token"].append((sum(row[j] for j in copies), i, max(copies, key=lambda j: (row[j], -j))))
    return out


def test_every_heads_top_windows_equal_a_brute_force(planted, atlas):
    L, H = planted.config.num_layers, planted.config.num_heads
    cands = {(n, layer, h): [] for n in SCORE_NAMES for layer in range(L) for h in range(H)}
    seqs = atlas.sequences()
    assert seqs[:len(TEXTS)] == [planted.tokenizer.encode(t) for t in TEXTS] and len(seqs) == len(TEXTS) + REPEATS
    for s, ids in enumerate(seqs):
        pats = captured_patterns(planted, ids)
        for layer in range(L):
            for h in range(H):
                if s >= len(TEXTS):       # a repeated random sequence: induction only
                    for i in range(LENGTH, 2 * LENGTH):
                        cands["induction", layer, h].append((pats[layer][h, i, i - LENGTH + 1], s, i, i - LENGTH + 1))
                    continue
                for n, rows in brute_candidates(pats[layer], ids, h).items():
                    cands[n, layer, h] += [(v, s, q, k) for v, q, k in rows]
    for (n, layer, h), rows in cands.items():
        want = sorted(rows, key=lambda r: (r[0] if n == "entropy" else -r[0], r[1], r[2]))[:TOP_K]
        got = atlas.top_windows(n, layer, h)
        where = f"{n} L{layer}H{h}"
        assert [(w["sequence"], w["query"]) for w in got] == [(s, q) for _, s, q, _ in want], where
        assert [w["score"] for w in got] == pytest.approx([v for v, *_ in want], abs=1e-12), where
        # the attended key: for entropy and duplicate-token the first most attended position (of the earlier copies)
        assert [w["key"] for w in got] == [k for *_, k in want], where


def test_the_planted_heads_windows_point_where_the_heads_look(atlas):
    for w in atlas.top_windows("previous-token", 0, 0):
        assert w["key"] == w["query"] - 1 and w["score"] > 0.9
    for w in atlas.top_windows("induction", 1, 0):
        assert w["sequence"] >= len(TEXTS) and w["key"] == w["query"] - LENGTH + 1 and w["score"] > 0.9
        assert w["ids"][w["key"] - 1] == w["ids"][w["query"]]       # the token after the earlier copy of the query's
    dup = atlas.top_windows("duplicate-token", 1, 2)
    assert len(dup) == TOP_K and all(w["ids"][w["key"]] == w["ids"][w["query"]] for w in dup)


def test_the_merge_does_not_depend_on_the_order_sequences_come_in():
    g = np.random.default_rng(0)
    offers = [(s, g.random((3, 7)).round(1), np.arange(1, 8), g.integers(0, 7, (3, 7))) for s in range(6)]
    a, b = TopWindows(["self"], 1, 3), TopWindows(["self"], 1, 3)
    for o in offers:
        a.offer("self", 0, *o)
    for o in reversed(offers):
        b.offer("self", 0, *o)
    assert np.array_equal(a.value["self"], b.value["self"]) and np.array_equal(a.at["self"], b.at["self"])
    flat = sorted((-v, s, q) for s, vs, qs, _ in offers for h in [0] for v, q in zip(vs[h], qs))[:TOP_K]
    assert [[int(s), int(q)] for _, s, q in flat] == a.at["self"][0, 0, :, :2].tolist()


def test_fewer_candidates_than_windows_leave_empty_slots(atlas):
    empty = TopWindows(["self"], 1, 1)
    empty.offer("self", 0, 0, np.array([[0.5, 0.25]]), np.array([1, 2]), np.array([[1, 2]]))
    assert empty.at["self"][0, 0, :2].tolist() == [[0, 1, 1], [0, 2, 2]]
    assert (empty.at["self"][0, 0, 2:] == -1).all() and np.isnan(empty.value["self"][0, 0, 2:]).all()
