"""inspector.views.softcap and the attention page's layer labels, on hand-made numbers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from inspector.views.attention import layer_label, outside_window
from inspector.views.softcap import softcap_figure, softcap_summary, softcap_table


def test_softcap_table_ranks_by_logit_and_says_how_far_the_cap_pulled():
    cap = 2.0
    uncapped = torch.tensor([0.1, 6.0, -3.0, 1.0, 2.5])
    capped = cap * torch.tanh(uncapped / cap)
    t = softcap_table(uncapped, capped, 3, lambda i: f"t{i}")
    assert list(t["token_id"]) == [1, 4, 3] and list(t["token"]) == ["t1", "t4", "t3"]
    assert np.allclose(t["bent"], t["uncapped"] - t["capped"])
    assert t["bent"].is_monotonic_decreasing                      # the larger the logit, the harder the pull
    assert t["capped"].max() < cap
    # the cap keeps the order but flattens: the top token loses probability
    assert t["prob_capped"].iloc[0] < t["prob_uncapped"].iloc[0]
    s = softcap_summary(uncapped, capped, cap)
    assert s["max_abs_uncapped"] == pytest.approx(6.0) and s["max_abs_capped"] < cap
    assert s["top_pull"] == pytest.approx(6.0 - 2.0 * np.tanh(3.0), rel=1e-5)
    assert s["entropy_capped"] > s["entropy_uncapped"]
    assert s["share_bent"] == pytest.approx(4 / 5)                # all but the 0.1 logit moved by > 1 % of the cap
    fig = softcap_figure(t, cap)
    assert [tr.name for tr in fig.data] == ["no cap (y = x)", "2 · tanh(x / 2)", "top tokens"]


def test_layer_labels_name_local_and_global_layers():
    assert layer_label((None, None), 1) == "Layer 1"                       # a plain model: as before
    assert layer_label((4096, None), 0) == "Layer 0 · local (window 4,096)"
    assert layer_label((4096, None), 1) == "Layer 1 · global"
    band = torch.tril(torch.ones(1, 6, 6)) - torch.tril(torch.ones(1, 6, 6), -3)   # each query: itself + 2 back
    assert outside_window(band, 3) == 0 and outside_window(band, 2) > 0


def test_entropy_figure_ticks_say_local_or_global():
    from inspector.views.attention import entropy_figure
    ent = np.ones((3, 2))
    fig = entropy_figure(ent, (8, None, 8))
    assert list(fig.layout.yaxis.ticktext) == ["0 · local 8", "1 · global", "2 · local 8"]
    assert entropy_figure(ent, (None,) * 3).layout.yaxis.ticktext is None
    assert entropy_figure(ent).layout.yaxis.ticktext is None
