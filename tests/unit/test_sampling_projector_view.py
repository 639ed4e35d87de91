"""inspector.views.sampling for a room (issue 21, item 7): the comparison laid out for a projector (one panel
per row, ten tokens, horizontal labels), the projector style never shrinking such a figure, and the note that
says why a cold setting without a filter "keeps" nearly every token (hand-computed probabilities)."""
from __future__ import annotations

import plotly.graph_objects as go
import pytest
import torch

from engine import SamplingParams
from inspector.views import sampling as smp
from inspector.views.theme import styled

# T = 0.3: scaled logits 0, -16.67, -40, -83.33, -133.33, -666.67, so p = 1, e^-16.67 = 5.8e-8, e^-40 = 4.2e-18,
# e^-83.33 = 6.4e-37 (above 0, below 1e-30), then e^-133.33 = 1.2e-58 and e^-666.67, both below float32's
# smallest number (1.4e-45): exactly 0.
COLD = torch.tensor([0.0, -5.0, -12.0, -25.0, -40.0, -200.0])


def test_a_cold_setting_without_a_filter_says_its_kept_tokens_are_mostly_never_drawn():
    settings = {"E": SamplingParams(temperature=0.3), "F": SamplingParams(temperature=0.3, top_p=0.99)}
    stages = smp.chains(COLD, settings, [], [])
    assert stages["E"]["sampler.probs"].tolist()[3] == pytest.approx(6.4e-37, rel=0.01)
    notes = smp.chain_notes(settings, stages)
    assert notes[0] == ("**E**: T=0.3 leaves the top token at p=1.000; **4 tokens** kept in the end. No top-k, top-p "
                        "or min-p here, so nothing is cut: *kept* counts every token whose probability is above 0. "
                        "99.9 % of the probability is on the top 1 token; of the 4 kept, 1 has p below 1e-30 "
                        "(together 6.4e-37: never drawn in practice), and 2 tokens underflowed to exactly 0 in "
                        "float32 (below about 1e-45): the only ones not counted.")
    assert notes[1] == ("**F**: T=0.3 leaves the top token at p=1.000; top-p 0.99 then needs 1 token to reach its "
                        "mass; **1 token** kept in the end.")                 # a filter cut: nothing to explain
    _, summary = smp.compare(COLD, settings, [], [], str)
    assert summary.set_index("setting")[["kept", "kept_tiny"]].to_dict("index") == {
        "E": {"kept": 4, "kept_tiny": 1}, "F": {"kept": 1, "kept_tiny": 0}}


def test_an_unfiltered_setting_with_nothing_tiny_says_so_without_underflow():
    """T = 1 on P5 = (.5, .2, .15, .1, .05): the top 5 tokens are needed for 99.9 %, none is tiny or 0."""
    p5 = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]).log()
    s = {"A": SamplingParams(temperature=1.0)}
    (note,) = smp.chain_notes(s, smp.chains(p5, s, [], []))
    assert note.endswith("99.9 % of the probability is on the top 5 tokens; of the 5 kept, 0 have p below 1e-30.")


def twelve_tokens():
    logits = torch.linspace(0, -6, 12)
    settings = {"A": SamplingParams(temperature=1.0), "B": SamplingParams(temperature=1.0, top_k=2),
                "C": SamplingParams(temperature=1.0, top_k=11)}
    return smp.compare(logits, settings, [], [], lambda i: f"tok{i}" * (1 + i % 3), top_n=12, chosen=0)


def test_compare_figure_on_a_projector_is_one_panel_a_row_with_ten_horizontal_labels():
    tokens, summary = twelve_tokens()
    wide = smp.compare_figure(tokens, summary)
    assert wide.layout.xaxis.tickangle == -60 and len(wide.layout.xaxis.categoryarray) == 12
    assert wide.layout.xaxis2.domain[0] > 0.3 and wide.layout.yaxis2.domain == (0.0, 1.0)        # side by side
    big = smp.compare_figure(tokens, summary, projector=True)
    axes = [("xaxis", "yaxis"), ("xaxis2", "yaxis2"), ("xaxis3", "yaxis3")]
    rows = [big.layout[y].domain for _, y in axes]
    assert all(big.layout[x].domain == (0.0, 1.0) for x, _ in axes)                                  # full width
    assert rows[0][1] == 1.0 and rows[0][0] > rows[1][1] > rows[1][0] > rows[2][1] > rows[2][0] >= 0.0
    # between rows: room (px) for two lines of 18-px labels and the next panel's title
    total = 3 * smp.PROJECTOR_ROW + 2 * smp.PROJECTOR_GAP
    assert (rows[0][0] - rows[1][1]) * total == pytest.approx(smp.PROJECTOR_GAP)
    for x, _ in axes:
        labels = list(big.layout[x].categoryarray)
        assert big.layout[x].tickangle == 0 and len(labels) == smp.PROJECTOR_TOKENS == 10
        assert [lab.split(".<br>")[0] for lab in labels] == [str(r) for r in range(1, 11)]
        assert all(len(lab.split("<br>")[1]) <= 8 for lab in labels)
    assert list(big.layout.xaxis.categoryarray)[:3] == ["1.<br>'tok0'", "2.<br>'tok1to…", "3.<br>'tok2to…"]
    # B keeps 2: its cut line after the second bar; C keeps 11, beyond the ten shown: no line
    assert [(s.xref, s.x0) for s in big.layout.shapes] == [("x2", 1.5)]
    # every bar and dot of a panel is one of its ten labels
    for tr in big.data:
        assert set(tr.x) <= set(big.layout["xaxis" + tr.xaxis[1:]].categoryarray)
    assert big.layout.legend.y > 1 and big.layout.height == total + 190


def test_projector_style_never_shortens_a_figure():
    """Taller by a third up to 1,200 px, as before; a figure already taller (stacked panels) keeps its height
    (it used to be cut to 1,200 px, squeezing five panels' labels into the next panel's title)."""
    heights = {h: styled(go.Figure(layout=dict(height=h)), projector=True).layout.height for h in (300, 1000, 1900)}
    assert heights == {300: 405, 1000: 1200, 1900: 1900}
