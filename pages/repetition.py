"""Repetition doctor: loops in the generated tokens (start, period, count), the text with each repeat
highlighted, the chosen token's probability and the entropy per step, attention from each looping token to
its earlier copy, and the same prompt and seed under repetition penalties side by side (on a button)."""
import streamlit as st

from engine.inspection.loops import MIN_COUNT, MIN_TOKENS, find_loops
from inspector.session.limits import LimitError, check_int
from inspector.session.memo import run_key
from inspector.session.run import check_settings
from inspector.ui.common import get_model, on_demand, plain, require_run, server_limits, was_stopped
from inspector.ui.demos import lesson
from inspector.ui.frame import ensure_frame
from inspector.ui.prescriptions import why_loop_section
from inspector.ui.state import session
from inspector.ui.widgets import chart
from inspector.views import repetition as rv
from inspector.views.tokens import token_labels

ensure_frame()         # opened alone (a fresh server): into app.py's frame, once per script run

st.header("Repetition")
run = require_run()
lesson("repetition")          # after a demo that opens this page: its lesson on the first screen
res, key = run.result, run_key(run)

c1, c2 = st.columns(2)
try:       # the widgets' bounds, checked here too: a forged message could send anything
    min_count = check_int(c1.number_input("Minimum full repeats", 2, 20, MIN_COUNT, key="rep_min_count"), 2, 20,
                          "Minimum full repeats")
    min_tokens = check_int(c2.number_input("Minimum tokens in a loop", 1, 200, MIN_TOKENS, key="rep_min_tokens"),
                           1, 200, "Minimum tokens in a loop")
except LimitError as e:
    st.error(str(e))
    st.stop()
loops = find_loops(res.token_ids, min_count=min_count, min_tokens=min_tokens)
st.caption(f"A loop is a degenerate repeat: the generated tokens repeat with a period p (each token equals the one "
           f"p steps earlier) **to the end of the run**, at least {MIN_COUNT} full times and over at least "
           f"{MIN_TOKENS} tokens. A pattern seen twice (a clock time, a date) or one the text moves on from is "
           "ordinary text, not a loop. Start and end are generation steps; positions are absolute.")
if not loops:
    st.success(f"No loop in the {len(res.token_ids)} generated tokens.")
else:
    st.warning(f"The generation ends in a loop: {len(loops)} loop(s) in {len(res.token_ids)} generated tokens.")
    st.dataframe(rv.loops_frame(loops, res.steps, run.n_prompt), key="rep_loops", hide_index=True)
st.html(rv.highlight_html(res.steps, loops))

st.subheader("Probability and entropy per step")
chart(rv.curves_figure(rv.curves_frame(res.steps), loops), key="rep_curves")
st.caption("A model stuck in a loop usually grows more and more certain: the chosen token's probability climbs "
           "towards 1 and the entropy falls with each repeat.")

model = get_model()
if model is None or model.name != run.model_name:
    st.warning(f"This run was made with **{plain(run.model_name)}**; choose that model in the sidebar to see attention "
               "and to compare penalty settings.")
    st.stop()

if loops:
    st.subheader("Attention to the earlier copy")
    k = st.selectbox("Loop", list(range(len(loops))), key="rep_loop",
                     format_func=lambda i: f"loop {i + 1}: start {loops[i].start}, period {loops[i].period}")
    lp = loops[k]
    store = session().memo("rep_attn")                            # (run_key, loop) -> CopyAttention
    ca = on_demand(store, (key, lp), f"the attention over {len(run.ids):,} positions",
                   lambda tell: rv.copy_attention(model, run.ids, run.n_prompt, lp, on_progress=tell),
                   work=(model, len(run.ids), model.config.num_layers), max_entries=4)
    if ca is not None and not ca.queries:     # (None: stopped, and on_demand offers to compute it again)
        st.info("This loop has no token after its first repeat to look back from.")
    elif ca is not None:
        which = st.radio("Attention from each looping token to", ["to_copy", "to_next"], horizontal=True,
                         key="rep_attn_which", format_func=lambda w: {"to_copy": "its earlier copy (p back)",
                                                                      "to_next": "the token after its copy"}[w])
        chart(rv.copy_attention_figure(ca, which), key="rep_attn_heat")
        st.caption("Mean attention weight over the looping tokens, per layer and head. Heads reading the token "
                   "after the earlier copy are induction heads: they are what lets a loop continue itself.")
        st.dataframe(rv.copy_attention_table(ca, token_labels(model.tokenizer, run.ids)), key="rep_attn_table",
                     hide_index=True)

st.subheader("Which settings break the loop?")
st.caption("The same prompt, seed and sampling settings, each penalty alone (the others off), judged as the "
           "diagnosis below judges its reruns: each generation runs past the run's length by twice the loop's span, "
           "and a setting breaks the loop only when it holds no loop and no repeat heading into one there; a loop "
           "that comes back after the run's length is only delayed.")
chosen = st.multiselect("Settings to try", list(rv.PENALTY_VARIANTS), default=list(rv.PENALTY_VARIANTS),
                        key="rep_variants")
tables = session().memo("rep_tables")                         # run_key -> the comparison table
variants_key, variants_what = (key, tuple(chosen)), "the penalty comparison"
if st.button("Generate with each setting", key="rep_compare", disabled=not chosen) \
        or (chosen and was_stopped(variants_what, variants_key)):
    text = st.empty()

    def compare(tell):      # the one progress protocol: a unit per token of each setting's generation
        settings = check_settings(model, run.settings, server_limits(show_error=False)).settings
        return rv.compare_penalties(model, settings, {c: rv.PENALTY_VARIANTS[c] for c in chosen},
                                    baseline=(res.token_ids, res.text), on_progress=tell,
                                    on_text=lambda label, t: text.caption(f"{label}: {rv.visible(t)[-240:]}"))
    n_tokens = len(chosen) * rv.comparison_horizon(run.settings.max_new_tokens, res.token_ids)
    # a fresh store: the button always recomputes; the page keeps the run's last table in tables
    if (computed := on_demand({}, variants_key, variants_what, compare, stop_on_error=False,
                              work=(model, n_tokens, 1))) is not None:
        tables[key] = computed
    text.empty()
if key in tables:
    st.dataframe(tables[key], key="rep_table_view", hide_index=True)

why_loop_section(run, model)
