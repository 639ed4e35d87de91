"""The Attention page's head atlas: every head of the model scored on the classic patterns (engine.tools.head_atlas)
over the project's own docs and repeated random tokens. Computed once per model on the button and kept on disk
beside its imports (engine.tools.atlas_store): a later page load, in any session, reads the file at once. A click
on a point of its scatter opens that head in the page's own Layer / Head controls (att_layer, att_head), so the
page's map shows the head's pattern over the current run; below, the head's best windows in the atlas corpus."""
from __future__ import annotations

import streamlit as st

from engine import InputError
from engine.tools.atlas_store import kept_head_atlas, stored_head_atlas
from engine.tools.head_atlas import CORPUS_TOKENS, SCORE_NAMES
from inspector.session.memo import memo
from inspector.ui.common import on_demand, plain, was_stopped
from inspector.ui.state import session
from inspector.ui.widgets import chart, table
from inspector.views.head_atlas import atlas_figure, atlas_table, head_of_point, strongest_kind, window_pieces

MAP_KEY = "att_atlas_map"
LAYER_KEY, HEAD_KEY = "att_layer", "att_head"      # the Attention page's own Layer / Head selectboxes
MARK = {"": "{}", "query": "**{}**", "key": ":orange-background[{}]", "query key": "**:orange-background[{}]**"}


def open_clicked_head(atlas) -> None:
    """on_select of the scatter, run before the page's script: the clicked head into the page's Layer and Head
    controls. The event is the browser's: a point that is not one of the atlas's heads is refused with a message."""
    try:
        picked = head_of_point(atlas, st.session_state.get(MAP_KEY))
    except InputError as e:
        session().atlas_refused = str(e)          # said on the rerun the click causes
        return
    if picked is not None:
        st.session_state[LAYER_KEY], st.session_state[HEAD_KEY] = picked


def _found_on_disk(model, store, key, what: str) -> None:
    """The atlas kept on disk for this model into this session's memo, when it is there and valid."""
    if key in store or was_stopped(what, key):
        return
    found = stored_head_atlas(model)
    if found.atlas is not None:
        memo(store, key, lambda: found, max_entries=2)
    elif found.note:
        st.warning(plain(found.note))


def windows_section(atlas, model, layer: int, head: int | None, axes: tuple[str, str]) -> None:
    st.markdown("**Where does a head do it?** Its best windows in the atlas's texts (induction: in the repeated "
                "random tokens): **the position scored** and :orange-background[the position it attends].")
    if head is None:
        st.info("Pick a head above (or click its point in the scatter) to see its best windows.")
        return
    kind = st.selectbox(f"Layer {layer}, head {head}: windows by", SCORE_NAMES,
                        key=f"att_atlas_kind_{layer}_{head}_{axes[0]}_{axes[1]}",
                        index=SCORE_NAMES.index(strongest_kind(atlas, layer, head, among=axes)),
                        help="Opens on the scatter's axis this head stands out on most among all heads.")
    rows = window_pieces(atlas, model.tokenizer, kind, layer, head)
    if not rows:
        st.caption(f"No position of the atlas's sequences has a {kind} score.")
    for r in rows:
        text = "".join(MARK[role].format(plain(t)) for t, role in r["pieces"])
        st.markdown(f"{r['rank']}. `{r['score']:.3f}` {plain(r['where'])}: {text}")


def atlas_section(model, layer: int = 0, head: int | None = None) -> None:
    """layer, head: the page's current Layer / Head choice (their windows are shown)."""
    st.subheader("Head atlas: what kind of head is each one?")
    st.caption("Every head scored, TransformerLens-style: previous-token (attention from a position to the one "
               "before it), first-token (to position 0, the sink), self (to itself), duplicate-token (to earlier "
               "copies of its own token) and entropy (nats) over prose paragraphs of this project's docs; "
               "induction over random tokens repeated twice (from the second copy, attention to the token after "
               "the earlier copy). Computed for the model, not the run: one forward per text, once; kept on disk.")
    store, key = session().memo("att_atlas"), (model.name, str(model.dtype), model.device.type)
    what = "the head atlas"
    _found_on_disk(model, store, key, what)
    if not (key in store or was_stopped(what, key) or st.button("Compute the head atlas", key="att_atlas_btn")):
        st.info("About ten forwards of a few hundred tokens, once for this model (it is kept on disk): press the "
                "button to score every head.")
        return
    kept = on_demand(store, key, what, lambda tell: kept_head_atlas(model, on_progress=tell),
                     work=(model, CORPUS_TOKENS, model.config.num_layers), max_entries=2)
    if kept is None:
        return
    atlas = kept.atlas
    session().atlas = atlas.as_dict()       # the report's Tools section (pages/overview.py)
    if kept.note:
        st.warning(plain(kept.note))
    refused, session().atlas_refused = session().atlas_refused, None
    if refused:
        st.warning(f"That click was ignored: {plain(refused)}.")
    df = atlas_table(atlas)
    c1, c2 = st.columns(2)
    x = c1.selectbox("x", SCORE_NAMES, index=0, key="att_atlas_x")
    y = c2.selectbox("y", SCORE_NAMES, index=SCORE_NAMES.index("induction"), key="att_atlas_y")
    chart(atlas_figure(df, x, y), key=MAP_KEY, on_select=lambda: open_clicked_head(atlas), selection_mode="points")
    kept_where = ("no folder to keep it beside" if kept.path is None else
                  f"read from {kept.path.name} in {kept.seconds:.2f} s" if kept.source == "disk" else
                  f"computed in {kept.seconds:.1f} s and kept as {kept.path.name}")
    st.caption(f"{atlas.layers} layers × {atlas.heads} heads over {len(atlas.texts)} texts ({atlas.tokens:,} "
               f"tokens) and {atlas.repeats} × 2 × {atlas.length} repeated random tokens (seed {atlas.seed}); "
               f"{plain(kept_where)}. Click a point to open that head in the Layer and Head controls above.")
    windows_section(atlas, model, layer, head, (x, y))
    sort = st.selectbox("Sort the table by", SCORE_NAMES, index=SCORE_NAMES.index("induction"),
                        key="att_atlas_sort")
    table(df.sort_values(sort, ascending=sort == "entropy"), "att_atlas_table",
          formats={n: "%.3f" for n in SCORE_NAMES}, texts=("top text (previous-token)",))
