"""Explain a token: why the model chose A and not B at one step (direct logit attribution through the frozen
final norm, then what each sampler stage did to A and B), which activations carry the answer (activation
patching from a clean into a corrupted prompt, and every head zeroed), and which prompt tokens it rests on
(occlusion and gradient × input, each checked by a deletion curve). The attribution is computed when the
step or tokens change (one forward); patching and input attribution only on a button press. Everything is
kept per run in this session."""

import pandas as pd
import streamlit as st

from engine import EngineError, InputError
from engine.tools.attribution import attribute_inputs, neutral_token
from engine.tools.explain import explain_step, single_token
from engine.tools.patching import patching_grid, replace_span
from inspector.session.memo import memo, run_key
from inspector.ui.common import device_slot, on_demand, plain, require_run_and_model, was_stopped
from inspector.ui.frame import ensure_frame
from inspector.ui.state import session
from inspector.ui.widgets import chart, checked, checked_text, columns, table
from inspector.views import explain as xv
from inspector.views.tokens import token_labels

ensure_frame()         # opened alone (a fresh server): into app.py's frame, once per script run

MAX_PATCH_TOKENS = 128       # the grid's cost grows with positions² x layers; beyond this it takes minutes
MAX_ATTRIBUTION_TOKENS = 128
MAX_RANDOM_ORDERS = 8
MAX_REPLACEMENT_CHARS = 2_000   # tokenized on every rerun; the span it must match is at most a context's tokens
MAX_B_CHARS = 200               # one token's text (the longest SmolLM2 token is far shorter)
STORE = "explain_memo"


def cached(k, what: str, compute):
    """The memoised result for k, computing it (in a device slot, with a spinner) on a miss: the one-forward
    attribution. The long jobs (patching, input attribution) go through long_job."""
    store = session().memo(STORE)
    if k in store:
        return memo(store, k, compute)
    try:
        with device_slot(what):
            with st.spinner(f"Computing {what}…"):
                return memo(store, k, compute, max_entries=12)
    except EngineError as e:
        st.error(str(e))
        st.stop()


def long_job(k, what: str, compute):
    """compute(on_progress) memoised for k, with a progress bar and Stop (inspector.ui.common.on_demand); None while
    stopped (the page then shows "Stopped" and a button to compute again)."""
    return on_demand(session().memo(STORE), k, what, compute, max_entries=12)


def has(k, what: str) -> bool:
    """Computed for k, or stopped (on_demand then shows "Stopped" and a button to compute again)."""
    return k in session().memo(STORE) or was_stopped(what, k)


def show_attribution(e) -> None:
    c = st.columns(4)
    c[0].metric("logit(A) − logit(B)", f"{e.logit_diff:.6f}")
    c[1].metric("Sum of contributions", f"{e.total:.6f}")
    c[2].metric("Residual error", f"{e.residual_error:.1e}")
    c[3].metric("Final-norm scale (frozen)", f"{e.norm_scale:.4g}")
    st.caption(f"Decomposition {e.exactness}.")
    if e.experts:
        st.markdown("**Each chosen expert's share** of its layer's MLP part (the expert's gated output at this "
                    "position, through the layer's norms as frozen above)")
        table(xv.expert_frame(e), key="explain_experts")
    st.caption(f"logit({plain(repr(e.target_text))}) = {e.logit_a:.4f}, "
               f"logit({plain(repr(e.versus_text))}) = {e.logit_b:.4f}. The "
               "final residual stream is the embedding plus every attention and MLP output; with the final "
               "norm's scale frozen at its value for this position, each part's share of the logit difference "
               "is exact, and the parts add up to it (the residual error is the forward's float rounding). "
               "Through a LayerNorm each part is centred first, and the norm's bias (as a head's bias, a learned "
               "position and each layer's attention output bias) is a term of its own: no head owns it.")
    chart(xv.layer_figure(e), key="ex_layers")
    left, right = columns([3, 2])
    with left:
        chart(xv.head_heatmap(e), key="ex_heads")
    right.markdown("**Largest components**")
    with right:
        table(xv.top_components(e, 15), "ex_top")
    st.subheader("The sampler")
    lines = xv.sampler_summary(e)
    st.markdown("\n".join(f"- {s}" for s in lines) if lines else
                "No sampler stage changed A's or B's probability or order with this run's settings.")
    table(xv.sampler_frame(e), "ex_sampler")
    st.caption("Each row: A and B after that stage (probabilities: softmax of that stage's logits; the last row "
               "is the distribution actually sampled). Temperature 0 samples greedily, so its final row is one-hot.")


def corrupted_prompt(model, ids: list[int], labels: list[str], neutral: int) -> list[int] | None:
    """Widgets for the corrupted prompt: a span of the clean context replaced by text or by neutral tokens."""
    n = len(ids)
    mid = max(0, n // 2 - 1)
    span = st.select_slider("Tokens to corrupt", options=list(range(n)), value=(mid, mid),
                            format_func=lambda p: labels[p], key="ex_span")
    if not (isinstance(span, (tuple, list)) and len(span) == 2):
        st.error(f"Tokens to corrupt must be two positions between 0 and {n - 1:,} (a first and a last)")
        st.stop()
    first = checked(span[0], 0, n - 1, "Tokens to corrupt (first)")
    start, end = first, checked(span[1], first, n - 1, "Tokens to corrupt (last)") + 1
    text = checked_text(st.text_input("Replace them with (empty: a neutral token each)", "", key="ex_replacement",
                                      max_chars=MAX_REPLACEMENT_CHARS,
                                      help="The replacement must be as many tokens as the span: patching compares "
                                           "the two prompts position by position."),
                        MAX_REPLACEMENT_CHARS, "The replacement")
    repl = model.tokenizer.encode(text) if text else [neutral] * (end - start)
    try:
        corrupt = replace_span(ids, start, end, repl)
    except EngineError as err:
        st.error(str(err))
        return None
    st.caption("Corrupted context: " + " ".join(plain(t) for t in token_labels(model.tokenizer, corrupt)[start:end])
               + f" at positions {start}–{end - 1}")
    return corrupt


def show_patching(r, labels: list[str]) -> None:
    c = st.columns(3)
    c[0].metric("p_clean", f"{r.p_clean:.6g}")
    c[1].metric("p_corrupt", f"{r.p_corrupt:.6g}")
    c[2].metric("Partial runs", f"{r.runs:,} in {r.seconds['total']:.1f} s")
    site = st.radio("Site", list(r.grid), horizontal=True, key="ex_site")
    chart(xv.patching_heatmap(r, site, labels), key="ex_grid")
    with st.expander("The grid as a table (rows: layers; columns: positions)"):
        st.dataframe(pd.DataFrame(r.grid[site], columns=labels), key="ex_grid_table")
    table(xv.patching_top(r, labels), "ex_patch_top")
    if r.head_scan is not None:
        chart(xv.head_scan_heatmap(r), key="ex_head_scan")
        st.caption("Each head zeroed (its attention output at every position) in the clean run: the change in the "
                   "target's logit. Blue: the head pushes against the target; red: the target needs it.")


def show_inputs(a, labels: list[str]) -> None:
    best = a.faithful
    c = st.columns(3)
    for col, m in zip(c, ("occlusion", "grad_x_input", "random")):
        col.metric(f"Deletion area: {xv.METHOD_LABELS[m]}", f"{a.areas[m]:.3f}")
    verdict = "beats" if a.areas[best] < a.areas["random"] else "does not beat"
    st.markdown(f"**{xv.METHOD_LABELS[best]}** is the more faithful method here: its deletion curve falls "
                f"fastest, and it {verdict} random orders (lower area = the prediction fell sooner).")
    chart(xv.attribution_figure(a, labels), key="ex_attr_bars")
    chart(xv.deletion_figure(a), key="ex_deletion")
    table(xv.attribution_frame(a, labels), "ex_attr_table")


# ---- the page ------------------------------------------------------------------------------------------
st.header("Explain a token")
run, model = require_run_and_model("explain it")
res, tok = run.result, model.tokenizer
if not res.token_ids:
    st.info("This run generated no tokens, so there is nothing to explain.")
    st.stop()
rk = run_key(run)

step = st.selectbox("Step", list(range(len(res.token_ids))), key="ex_step",
                    format_func=lambda s: f"{s} · {tok.decode([res.token_ids[s]])!r}")
chosen = res.token_ids[step]
ids = list(res.prompt_ids) + list(res.token_ids[:step])
cands = list(dict.fromkeys([chosen] + [c.id for c in res.steps[step].top]))
name = {i: f"{tok.decode([i])!r} ({i})" + (" · chosen" if i == chosen else "") for i in cands}
c1, c2 = st.columns(2)
a = c1.selectbox("A (why this token…)", cands, key="ex_a", format_func=name.get)
b = c2.selectbox("B (…and not this one)", [None] + [i for i in cands if i != a], key="ex_b",
                 format_func=lambda i: "the runner-up" if i is None else name[i])
typed_b = checked_text(c2.text_input("…or type any token as B (e.g. ' London')", "", key="ex_b_text",
                                     max_chars=MAX_B_CHARS,
                                     help="The text of exactly one token, a leading space included; it need not "
                                          "be among the candidates above (one forward computes its logit)."),
                       MAX_B_CHARS, "B")
if typed_b:
    try:
        b = single_token(model, typed_b, "B")
    except InputError as err:
        st.error(f"{err}. B stays unset until it is one token.")
        st.stop()

tab_why, tab_patch, tab_inputs = st.tabs(["Why A and not B", "Activation patching", "Prompt tokens"])
with tab_why:
    e = cached((rk, "dla", step, a, b), "the logit attribution",
               lambda: explain_step(model, res.prompt_ids, res.token_ids, step, target=a, versus=b,
                                    params=res.params))
    st.caption(f"Step {step}: the logits at position {len(ids) - 1}, from the prompt and the {step} tokens "
               f"generated before. A = {plain(repr(e.target_text))}, B = {plain(repr(e.versus_text))}.")
    show_attribution(e)

neutral = neutral_token(model)
labels = token_labels(tok, ids)
with tab_patch:
    st.caption(f"Clean: this step's context ({len(ids)} tokens), target A = {plain(repr(tok.decode([a])))}. Each cell "
               "restores one activation of the clean run into the corrupted run and shows p(target) at the last "
               "position.")
    corrupt = corrupted_prompt(model, ids, labels, neutral) if len(ids) > 1 else None
    if len(ids) < 2:
        st.info("Patching needs a context of at least two tokens.")
    if corrupt is not None:
        pk = (rk, "patch", tuple(ids), tuple(corrupt), a)
        if len(ids) > MAX_PATCH_TOKENS:
            st.warning(f"Patching is offered for contexts of up to {MAX_PATCH_TOKENS} tokens; this one has "
                       f"{len(ids)}.")
        elif corrupt == ids:
            st.info("The corrupted prompt is the same as the clean one; choose other tokens or another replacement.")
        elif has(pk, "activation patching") or st.button("Run patching", key="ex_patch_run", type="primary"):
            r = long_job(pk, "activation patching",
                         lambda tell: patching_grid(model, ids, corrupt, a, on_progress=tell))
            if r is not None:
                show_patching(r, labels)

with tab_inputs:
    st.caption(f"How much log p({plain(repr(tok.decode([a])))}) at step {step} rests on each of the {len(ids)} "
               f"context tokens. Occlusion replaces one token by {plain(repr(tok.decode([neutral])))}; "
               "gradient × input "
               "takes the embedding times the gradient. The deletion curves remove tokens in each method's order.")
    orders = checked(st.slider("Random orders for the baseline", 1, MAX_RANDOM_ORDERS, 3, key="ex_random_orders"), 1,
                     MAX_RANDOM_ORDERS, "Random orders for the baseline")
    ak = (rk, "inputs", tuple(ids), a, orders)
    if len(ids) > MAX_ATTRIBUTION_TOKENS:
        st.warning(f"Input attribution is offered for contexts of up to {MAX_ATTRIBUTION_TOKENS} tokens; this one "
                   f"has {len(ids)}.")
    elif has(ak, "input attribution") or st.button("Attribute", key="ex_attr_run", type="primary"):
        attr = long_job(ak, "input attribution",
                        lambda tell: attribute_inputs(model, ids, a, random_orders=orders, on_progress=tell))
        if attr is not None:
            show_inputs(attr, labels)
