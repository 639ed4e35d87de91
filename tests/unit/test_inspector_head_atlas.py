"""The head atlas's views (inspector.views.head_atlas) on a hand-made atlas: a scatter point's index names the head
at that place of atlas.rows() (and its hover label), anything else a browser could send is refused by name; the
head's strongest kind among the plotted scores is the one it ranks highest on; a window's pieces mark the scored
and the attended token, the key put first when it lies before the context shown."""
from __future__ import annotations

import numpy as np
import pytest

from engine import InputError
from engine.tools.atlas_windows import TOP_K
from engine.tools.head_atlas import SCORE_NAMES, HeadAtlas
from inspector.views.head_atlas import BEFORE, atlas_figure, atlas_table, head_of_point, strongest_kind, window_pieces

pytestmark = pytest.mark.unit
L, H = 3, 2


class Letters:
    """A tokenizer whose token i is the letter chr(97 + i)."""

    def token_bytes(self, i: int) -> bytes:
        return bytes([97 + i])


def hand_atlas() -> HeadAtlas:
    scores = {n: np.full((L, H), 0.1) for n in SCORE_NAMES}
    scores["previous-token"][2, 1] = 0.9          # L2H1: the previous-token head
    scores["induction"][2, 1] = 0.2               # above the others' 0.1, but by less of the heads
    scores["induction"][1, 0] = 0.8
    value = {n: np.full((L, H, TOP_K), np.nan) for n in SCORE_NAMES}
    at = {n: np.full((L, H, TOP_K, 3), -1, dtype=np.int64) for n in SCORE_NAMES}
    value["previous-token"][2, 1, :2] = [0.95, 0.9]
    at["previous-token"][2, 1, :2] = [[0, 3, 2], [1, 20, 0]]
    ids = [list(range(5)), list(range(22))]
    return HeadAtlas(L, H, scores, ["t0", "t1"], {"previous-token": np.zeros((L, H), int),
                                                 "duplicate-token": np.zeros((L, H), int)},
                     27, 1, 4, 0, [], ids, value, at)


def sel(*points) -> dict:
    return {"selection": {"points": list(points), "point_indices": [], "box": [], "lasso": []}}


def test_a_points_index_names_the_head_its_hover_label_names():
    atlas = hand_atlas()
    fig = atlas_figure(atlas_table(atlas), "previous-token", "induction")
    for i in range(L * H):
        assert fig.data[0].text[i] == "L{}H{}".format(*head_of_point(atlas, sel({"point_index": i, "curve_number": 0})))
    assert head_of_point(atlas, sel()) is None


@pytest.mark.parametrize("event, named", [
    (sel({"point_index": L * H}), "is not one of the atlas's 6 heads"),
    (sel({"point_index": -1}), "is not one of"),
    (sel({"point_index": True}), "is not one of"),
    (sel({"point_index": "2"}), "is not one of"),
    (sel({"point_index": 1, "curve_number": 3}), "on trace 3"),
    (sel("L1H0"), "is not one of"),
    ({"selection": {"points": "L1H0"}}, "no list of points"),
    ("{}", "not a plotly selection event"),
    (None, "not a plotly selection event"),
])
def test_anything_else_a_browser_sends_is_refused_by_name(event, named):
    with pytest.raises(InputError, match=named):
        head_of_point(hand_atlas(), event)


def test_the_strongest_kind_is_the_score_the_head_ranks_highest_on():
    atlas = hand_atlas()
    assert strongest_kind(atlas, 2, 1, among=("induction", "previous-token")) == "previous-token"
    assert strongest_kind(atlas, 1, 0, among=("previous-token", "induction")) == "induction"
    assert strongest_kind(atlas, 0, 0, among=("self", "induction")) == "self"     # a tie: the first


def test_a_windows_pieces_mark_the_scored_and_the_attended_token():
    rows = window_pieces(hand_atlas(), Letters(), "previous-token", 2, 1)
    assert [r["rank"] for r in rows] == [1, 2] and rows[0]["score"] == 0.95
    assert rows[0]["pieces"] == [("a", ""), ("b", ""), ("c", "key"), ("d", "query"), ("e", "")]
    assert rows[0]["where"] == "text 1, position 3 → 2"
    first = rows[1]["pieces"]
    assert first[:2] == [("a", "key"), ("…", "")]                 # key 0 before the context from 20 - BEFORE
    assert [t for t, _ in first[2:]] == [chr(97 + p) for p in range(20 - BEFORE, 22)]
    assert dict((t, r) for t, r in first[2:])["u"] == "query"
    assert window_pieces(hand_atlas(), Letters(), "self", 2, 1) == []
