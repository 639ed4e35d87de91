"""The Activations page's tuned lens beside the logit lens (engine.tools.tuned_lens, engine.tools.lens_file): the
lens shipped or kept for the model's weights, else "not fitted yet" and a button that fits one (progress and Stop,
then kept in the cache for next time); at the page's lens position both lenses' top tokens side by side, and each
layer's KL to the model's final distribution, both curves on one chart."""
from __future__ import annotations

import streamlit as st

from engine.tools.lens_file import LensFileError, find_lens, keep_lens, read_lens
from engine.tools.tuned_lens import DEFAULT_TOKENS, fit_tuned_lens, lenses_at
from inspector.session.memo import memo
from inspector.ui.common import on_demand, plain, was_stopped
from inspector.ui.state import session
from inspector.ui.widgets import chart, table
from inspector.views.activations import logit_lens_figure
from inspector.views.tuned_lens import LENSES, kl_figure, kl_table, lens_tops


def _fit_and_keep(model, tell):
    """Fit, keep, and show the lens as kept (U, V in float16): what this page draws is what the next session reads."""
    return read_lens(keep_lens(model, fit_tuned_lens(model, on_progress=tell)), model)


def _the_lens(model, store, mkey):
    """The shipped or kept lens (None: not fitted yet, and the page shows the fit button) or one fitted here."""
    try:
        lens = memo(store, (mkey, "found"), lambda: find_lens(model), max_entries=4)
    except LensFileError as e:
        st.error(f"The tuned lens on disk cannot be used: {plain(e)}")
        return None
    if lens is not None:
        return lens
    what = "the tuned lens fit"
    if not ((mkey, "fit") in store or was_stopped(what, (mkey, "fit"))
            or st.button("Fit the tuned lens", key="act_tuned_fit")):
        st.info("Not fitted yet for this model's weights: fit it (one forward per docstring of Python's standard "
                f"library, up to {DEFAULT_TOKENS:,} tokens, then least squares per layer and a few Adam steps on "
                "the KL to the final distribution; kept in the cache for next time).")
        return None
    return on_demand(store, (mkey, "fit"), what, lambda tell: _fit_and_keep(model, tell),
                     work=(model, DEFAULT_TOKENS, model.config.num_layers), max_entries=2)


def tuned_lens_section(model, run_key, ids, pos: int, k: int, top_k: int, auto: bool) -> None:
    """Both lenses at position pos of ids (top_k tokens computed, k shown); auto: compute without a click."""
    st.subheader("Logit lens and tuned lens")
    st.caption("The tuned lens (Belrose et al. 2023) translates each layer's residual stream with its own affine map "
               "(h + A h + b, fitted to agree with the final layer) before the final norm and unembedding; the logit "
               "lens reads the stream as it is. KL is to the model's own final distribution at this position.")
    store, mkey = session().memo("act_tuned"), (model.name, str(model.dtype), model.device.type)
    lens = _the_lens(model, store, mkey)
    if lens is None:
        return
    r = lens.recipe
    st.caption(f"Lens: rank {r.get('rank')}, fitted on {r.get('tokens'):,} tokens of {plain(r.get('corpus'))} "
               f"(Python {plain(r.get('python'))}) by {plain(r.get('script'))}; weights "
               f"{plain(lens.weights_checksum[:28])}….")
    what = f"both lenses over {pos + 1:,} positions"
    key = (run_key, "tuned", pos, lens.weights_checksum, lens.recipe.get("sha256"))
    if not (key in store or auto or was_stopped(what, key) or st.button("Compute both lenses", key="act_tuned_btn")):
        st.info(f"Position {pos}: one forward over {pos + 1} positions. Press the button.")
        return
    got = on_demand(store, key, what, lambda tell: lenses_at(model, ids, pos, lens, top_k, on_progress=tell),
                    work=(model, pos + 1, model.config.num_layers), max_entries=16)
    if got is None:
        return
    tops, kl = got
    # the report's Tools section (pages/overview.py, engine.report.tools): this position's KL, layer by layer
    session().lens = {"kind": "tuned-lens", "kl": kl, "weights_checksum": lens.weights_checksum, "recipe": r,
                      "rank": r.get("rank"), "position": pos}
    for col, name in zip(st.columns(2), LENSES):
        with col:
            st.markdown(f"**{name}**")
            chart(logit_lens_figure(lens_tops(tops, name), k), key=f"act_tuned_top_{name.split()[0]}")
    kls = kl_table(kl)
    chart(kl_figure(kls), key="act_tuned_kl")
    table(kls, "act_tuned_kl_table", formats={n: "%.4f" for n in LENSES})
