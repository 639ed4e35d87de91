"""inspector.views.attention: entropy, pooling and windowing against hand-computed values (including a synthetic
2,048 × 2,048 pattern), the bounded memo, and the on-demand maps on the tiny model."""
from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from engine import Probe
from engine.model import Model
from inspector.session.memo import memo, run_key
from inspector.views.attention import (
    MAX_CELLS,
    attention_pattern,
    entropy_figure,
    entropy_overview,
    head_view,
    heatmap_figure,
    pool,
    query_rows,
    row_entropy,
    top_attended,
    top_attended_figure,
    window,
)


def causal_uniform(T: int) -> np.ndarray:
    """Row q attends uniformly to keys 0..q."""
    return np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]


def test_row_entropy_of_known_rows():
    p = torch.tensor([[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [0.25] * 4])
    np.testing.assert_allclose(row_entropy(p).numpy(), [0.0, math.log(2), math.log(4)], atol=1e-12)
    np.testing.assert_allclose(row_entropy(torch.tensor(causal_uniform(5))).numpy(),
                               [math.log(n) for n in range(1, 6)], atol=1e-12)


def test_pool_max_and_mass_by_hand():
    m = np.arange(16, dtype=float).reshape(4, 4)
    z, rows, cols = pool(m, max_side=2, how="max")
    np.testing.assert_array_equal(z, [[5, 7], [13, 15]])
    assert rows.tolist() == cols.tolist() == [0, 2]
    z, _, _ = pool(m, max_side=2, how="mass")
    np.testing.assert_allclose(z, [[(0 + 1 + 4 + 5) / 2, (2 + 3 + 6 + 7) / 2],
                                   [(8 + 9 + 12 + 13) / 2, (10 + 11 + 14 + 15) / 2]])
    # 5 positions into blocks of 3: the last block holds 2 rows; mass keeps causal rows summing to 1
    z, rows, _ = pool(causal_uniform(5), max_side=2, how="mass")
    assert rows.tolist() == [0, 3]
    np.testing.assert_allclose(z.sum(1), 1)
    np.testing.assert_allclose(z[0], [1, 0])                                 # rows 0-2 only see keys 0-2
    np.testing.assert_allclose(z[1], [(3 / 4 + 3 / 5) / 2, (1 / 4 + 2 / 5) / 2])
    z, _, _ = pool(causal_uniform(5), max_side=2, how="max")
    np.testing.assert_allclose(z, [[1, 0], [1 / 4, 1 / 4]])
    small = np.eye(3)
    z, rows, _ = pool(small, max_side=256)
    np.testing.assert_array_equal(z, small)
    with pytest.raises(ValueError):
        pool(small, 2, how="mean")


def test_window_clamps_into_range():
    m = np.arange(100, dtype=float).reshape(10, 10)
    z, pos = window(m, 3, 4)
    assert pos.tolist() == [3, 4, 5, 6]
    np.testing.assert_array_equal(z, m[3:7, 3:7])
    assert window(m, 9, 4)[1].tolist() == [6, 7, 8, 9]
    assert window(m, -5, 4)[1].tolist() == [0, 1, 2, 3]
    assert window(m, 0, 50)[1].tolist() == list(range(10))


def test_a_2048_position_map_is_reduced_fast():
    T = 2048
    rng = np.random.default_rng(0)
    m = np.tril(rng.random((T, T)))
    m[:, 0] += 5.0                                                            # an attention sink on token 0
    m /= m.sum(1, keepdims=True)
    labels = [f"{i} t{i}" for i in range(T)]
    t0 = time.perf_counter()
    z, rows, cols = pool(m, MAX_CELLS, "max")
    assert z.shape == (MAX_CELLS, MAX_CELLS) and rows[1] == 8
    assert z[17, 3] == m[136:144, 24:32].max()
    zm, _, _ = pool(m, MAX_CELLS, "mass")
    np.testing.assert_allclose(zm.sum(1), 1, atol=1e-9)
    assert zm[40, 1] == pytest.approx(m[320:328, 8:16].sum(1).mean())
    fig = heatmap_figure(z, rows, cols, labels, block=8)
    assert np.asarray(fig.data[0].z).shape == (MAX_CELLS, MAX_CELLS)
    assert fig.data[0].x[1] == "8 t8 … 15 t15" and len(set(fig.data[0].y)) == MAX_CELLS
    w, pos = window(m, T - MAX_CELLS, MAX_CELLS)
    assert w.shape == (MAX_CELLS, MAX_CELLS) and pos[-1] == T - 1
    top = top_attended(m, T - 1, labels, 5)
    assert top["position"].iloc[0] == 0 and top["weight"].is_monotonic_decreasing
    assert time.perf_counter() - t0 < 5.0


def test_heatmap_labels_and_small_maps():
    m = causal_uniform(4)
    labels = ["0 <s>", "1 ·a", "2 ·a", "3 ·b"]
    fig = heatmap_figure(m, range(4), range(4), labels, title="L0")
    assert list(fig.data[0].x) == labels and list(fig.data[0].y) == labels
    np.testing.assert_allclose(np.asarray(fig.data[0].z).sum(1), 1)
    ent = np.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(np.asarray(entropy_figure(ent).data[0].z), ent)


def test_top_attended_orders_and_caps_at_the_visible_keys():
    m = np.array([[1, 0, 0, 0], [0.2, 0.8, 0, 0], [0.1, 0.6, 0.3, 0], [0.4, 0.1, 0.1, 0.4]])
    labels = ["a", "b", "c", "d"]
    t = top_attended(m, 2, labels, 10)
    assert t["position"].tolist() == [1, 2, 0] and t["token"].tolist() == ["b", "c", "a"]
    assert top_attended(m, 3, labels, 2)["position"].tolist() == [0, 3]     # ties: the earlier first
    fig = top_attended_figure(t)
    assert list(fig.data[0].y) == ["b", "c", "a"]


def test_memo_is_bounded_and_least_recently_used_goes_first():
    store: dict = {}
    calls = []

    def make(k, size=1):
        return lambda: calls.append(k) or torch.zeros(size)

    for k in "abc":
        memo(store, k, make(k), max_entries=2)
    assert list(store) == ["b", "c"] and calls == ["a", "b", "c"]
    memo(store, "b", make("b"), max_entries=2)                                # a hit: no compute, b now newest
    memo(store, "d", make("d"), max_entries=2)
    assert list(store) == ["b", "d"] and calls == ["a", "b", "c", "d"]
    big: dict = {}
    memo(big, 1, make(1, 100), max_bytes=1000)
    memo(big, 2, make(2, 200), max_bytes=1000)                                # 400 + 800 bytes > 1000
    assert list(big) == [2]
    memo(big, 3, make(3, 1000), max_bytes=1000)                               # the newest is kept, however big
    assert list(big) == [3]


def test_run_key_tells_runs_apart():
    class R:
        def __init__(self, t):
            self.created = t
    a, b = R(1.0), R(2.0)
    assert run_key(a) != run_key(b) and run_key(a) == run_key(a)


def test_query_rows():
    assert query_rows(5, 8).tolist() == [0, 1, 2, 3, 4]
    assert query_rows(10, 4).tolist() == [0, 3, 6, 9]
    assert query_rows(2048, 256)[-1] == 2047 and len(query_rows(2048, 256)) == 256


@pytest.fixture(scope="module")
def ids(tiny_model):
    return tiny_model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)


@pytest.fixture(scope="module")
def full_patterns(tiny_model, ids):
    p = Probe().capture("blocks.*.attn.pattern")
    tiny_model.logits(ids, p)
    return {c.layer: c.value for c in p.recording.captures}


def test_attention_pattern_is_the_engines_and_stops_after_its_layer(tiny_model, ids, full_patterns, monkeypatch):
    blocks = []
    original = Model._block
    monkeypatch.setattr(Model, "_block", lambda self, p, lw, x, cache, i, *a: blocks.append(i)
                        or original(self, p, lw, x, cache, i, *a))
    pat = attention_pattern(tiny_model, ids, 0)
    assert blocks == [0]                                                      # layer 1 never ran
    assert tiny_model.live_hooks == 0
    H, T = tiny_model.config.num_heads, len(ids)
    assert pat.shape == (H, T, T) and pat.dtype == torch.float32
    torch.testing.assert_close(pat, full_patterns[0])
    torch.testing.assert_close(attention_pattern(tiny_model, ids, 1), full_patterns[1])
    avg = head_view(pat, None)
    np.testing.assert_allclose(avg.sum(1), 1, atol=1e-6)
    np.testing.assert_allclose(avg, pat.mean(0).double().numpy())
    np.testing.assert_array_equal(head_view(pat, 3), pat[3].double().numpy())
    with pytest.raises(ValueError):
        attention_pattern(tiny_model, ids, 2)


def test_entropy_overview_matches_the_materialised_patterns(tiny_model, ids, full_patterns):
    L, H = tiny_model.config.num_layers, tiny_model.config.num_heads
    exact = np.stack([row_entropy(full_patterns[i]).mean(-1).numpy() for i in range(L)])
    ent = entropy_overview(tiny_model, ids)
    assert ent.shape == (L, H)
    np.testing.assert_allclose(ent, exact, atol=1e-5)
    rows = query_rows(len(ids), 7)
    sampled = np.stack([row_entropy(full_patterns[i][:, rows]).mean(-1).numpy() for i in range(L)])
    np.testing.assert_allclose(entropy_overview(tiny_model, ids, max_queries=7), sampled, atol=1e-5)
    assert tiny_model.live_hooks == 0
