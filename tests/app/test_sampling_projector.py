"""AppTest of the Sampling page for a room (issue 21, item 7): in projector mode its tables are HTML tables
(st.table, whose type CSS can set; st.dataframe draws a 13-px canvas) and its comparison is one panel per row
with at most ten horizontally labelled tokens each; a setting without a filter says how many of the tokens it
"keeps" have probabilities no draw will hit, and how many underflowed to exactly 0 (hand-computed here)."""
from __future__ import annotations

import numpy as np

from inspector.ui.state import session_of
from inspector.views import sampling as smp
from tests.app.test_app_pages_b import captured_logits, chart, find_df, pages, tiny_app  # noqa: F401


def keyed_in_order(node) -> list[str]:
    """The keys of the keyed elements under an AppTest node, in the order they are on screen."""
    out = []
    for child in getattr(node, "children", {}).values():
        key = getattr(child, "key", None)
        if key:
            out.append(key)
        out += keyed_in_order(child)
    return out


def test_sampling_page_in_projector_mode_has_big_tables_and_stacked_horizontal_panels(tiny_app, pages):  # noqa: F811
    at = tiny_app.switch_page(pages["sampling"]).run()
    assert not at.exception
    assert len(at.dataframe) == 3 and len(at.table) == 0          # the usual grids, off the projector
    wide = chart(at, "smp_compare_fig")["layout"]
    assert wide["xaxis"]["tickangle"] == -60 and wide["xaxis2"]["domain"][0] > 0.3     # side by side
    at.sidebar.toggle(key="sb_projector").set_value(True).run()
    assert not at.exception
    # the comparison first, above the step and the settings (issue 33, item 6: it was 1,500-1,900 px down)
    order = [k for k in keyed_in_order(at.main) if k in ("smp_compare_fig", "smp_step", "smp_0_temperature")]
    assert order == ["smp_compare_fig", "smp_step", "smp_0_temperature"], order
    # every table an HTML table (the projector's type reaches it), none a canvas grid
    assert len(at.dataframe) == 0 and len(at.table) == 3
    summary = at.table[0].value
    assert {"kept", "kept with p < 1e-30", "entropy"} <= set(summary.columns)
    assert summary["setting"].tolist() == ["A", "B", "C"]
    run = session_of(at.session_state).run
    logits = captured_logits(run, 0)
    assert summary["kept"].tolist()[0] == 1                       # the run's own settings: greedy keeps one
    fig = chart(at, "smp_compare_fig")
    layout = fig["layout"]
    # one panel per row, full width, top to bottom A, B, C, none overlapping another
    rows = [layout[f"yaxis{s}"]["domain"] for s in ("", "2", "3")]
    assert all(layout[f"xaxis{s}"]["domain"] == [0, 1] for s in ("", "2", "3"))
    assert rows[0][0] > rows[1][1] and rows[1][0] > rows[2][1]
    # labels horizontal and at least the projector's tick size; ten tokens a panel (20 are asked for)
    assert all(layout[f"xaxis{s}"]["tickangle"] == 0 for s in ("", "2", "3"))
    assert min(layout[f"xaxis{s}"]["tickfont"]["size"] for s in ("", "2", "3")) >= 18
    assert at.number_input(key="smp_top_n").value == 20
    for s in ("", "2", "3"):
        assert len(layout[f"xaxis{s}"]["categoryarray"]) == smp.PROJECTOR_TOKENS == 10
        assert all(len(part) <= 8 for label in layout[f"xaxis{s}"]["categoryarray"] for part in label.split("<br>"))
    # the panel's first label is the most likely token (rank 1), as off the projector
    assert layout["xaxis"]["categoryarray"][0].startswith("1.<br>")
    assert int(np.argmax(logits)) == run.result.token_ids[0]


def test_sampling_page_says_why_a_cold_unfiltered_setting_keeps_nearly_everything(tiny_app, pages):  # noqa: F811
    """E (the fifth setting) has no top-k, top-p or min-p; at T = 0.05 most of the tiny model's tokens get
    probabilities far below 1e-30 and some underflow to 0 in float32. Counted by hand from the captured logits
    (numpy, float32 as the sampler computes them; float64 for the 99.9 % core)."""
    at = tiny_app.switch_page(pages["sampling"]).run()
    at.number_input(key="smp_n").set_value(5).run()
    at.slider(key="smp_4_temperature").set_value(0.05).run()
    assert not at.exception
    z = (captured_logits(session_of(at.session_state).run, 0) / 0.05).astype(np.float32)
    e = np.exp(z - z.max())
    p = e / e.sum(dtype=np.float32)
    kept, tiny, zero = int((p > 0).sum()), int(((p > 0) & (p < 1e-30)).sum()), int((p == 0).sum())
    assert tiny > 0 and zero > 0 and kept + zero == p.size           # the case the note is for
    summary = find_df(at, "setting", "kept", "kept_tiny").set_index("setting")
    assert (summary.loc["E", "kept"], summary.loc["E", "kept_tiny"]) == (kept, tiny)
    (info,) = [i.value for i in at.info if "The chain runs in this order" in i.value]
    line = next(x for x in info.split("\n") if x.startswith("- **E**"))
    assert f"**{kept:,} tokens** kept in the end" in line
    assert f"of the {kept:,} kept, {tiny:,} have p below 1e-30" in line
    assert f"{zero:,} token{'s' if zero > 1 else ''} underflowed to exactly 0 in float32" in line
    core = int(np.searchsorted(np.cumsum(np.sort(p.astype(np.float64))[::-1]), 0.999) + 1)
    assert f"99.9 % of the probability is on the top {core:,} token" in line
    # A (greedy), B and C cut: no such note on their lines
    assert sum("underflowed" in x for x in info.split("\n")) == 1
