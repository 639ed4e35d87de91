"""Sampling: the run's captured logits at one step under several sampler settings, the chain stage by stage,
and seeded draws against the computed probabilities. Every control here is display-only: nothing re-runs
the model, all of it is recomputed from the logits the run captured."""
import time

import streamlit as st

from engine import SamplingParams
from inspector.views import sampling as smp
from pages.common import require_run_and_model
from pages.widgets import sampling_form

DEFAULTS = [None, *smp.PRESETS]           # A: the run's own settings
LABELS = "ABCDE"

st.header("Sampling")
run, model = require_run_and_model()
result = run.result
tok = model.tokenizer
if st.session_state.get("smp_for_run") != run.created:
    # a new run: setting A follows its settings again, and the step must exist in it
    for k in [k for k in st.session_state if k == "smp_step" or k.startswith("smp_0_")]:
        del st.session_state[k]
    st.session_state["smp_for_run"] = run.created

c1, c2 = st.columns([3, 1])
# the step the debugger stopped at, when this run comes from it; otherwise the first
default_step = min(int(st.session_state.get("selected_step") or 0), len(result.steps) - 1)
step = int(c1.number_input(f"Step (0 = after the prefill; {len(result.steps)} in this run)", 0,
                           len(result.steps) - 1, default_step, key="smp_step"))
top_n = int(c2.number_input("Tokens shown", 5, 60, 20, key="smp_top_n"))
chosen = result.token_ids[step]
context, generated = smp.step_context(result, step)
logits = smp.step_logits(run.probe, step)
st.caption(f"At step {step} the run chose **{tok.decode([chosen])!r}** (id {chosen}) with probability "
           f"{result.steps[step].prob:.4f} under its settings ({smp.describe(result.params)}); it is the red "
           "bar below wherever it appears.")

n = int(st.number_input("Settings side by side", 3, 5, 3, key="smp_n"))
settings: dict[str, SamplingParams] = {}
for i, col in enumerate(st.columns(n)):
    default = result.params if DEFAULTS[i] is None else SamplingParams(**DEFAULTS[i])
    with col.container(border=True):
        st.markdown(f"**{LABELS[i]}**" + (" · the run's settings" if DEFAULTS[i] is None else ""))
        params = sampling_form(f"smp_{i}", default)
        if params is not None:
            settings[LABELS[i]] = params
if len(settings) < n:
    st.stop()

c1, c2, c3 = st.columns([2, 1, 1])
chain_label = c1.radio("Stage by stage, and the draws, for setting", list(settings), horizontal=True,
                       key="smp_chain")
n_draws = int(c2.number_input("Draws", 100, 100_000, 1000, 100, key="smp_draws"))
seed = int(c3.number_input("Draw seed", 0, 2**31 - 1, 0, key="smp_draw_seed"))

t0 = time.perf_counter()
view = smp.redraw(logits, settings, chain_label, context, generated, lambda i: tok.decode([i]), chosen=chosen,
                  n_draws=n_draws, seed=seed, top_n=top_n)
seconds = time.perf_counter() - t0

st.subheader("Side by side")
st.caption("Tokens ranked by their logits after penalties and temperature; bars are probabilities before "
           "top-k/top-p/min-p cut (blue kept, grey cut), dots the final sampling probabilities, the dashed "
           "line where the kept set ends. Entropy H in nats of the final distribution.")
st.plotly_chart(view["compare_fig"], key="smp_compare_fig")
st.dataframe(view["summary"], hide_index=True, key="smp_summary",
             column_config={"entropy": st.column_config.NumberColumn(format="%.3f"),
                            "entropy_before": st.column_config.NumberColumn("entropy before cut", format="%.3f"),
                            "mass_kept": st.column_config.NumberColumn(format="%.4f"),
                            "chosen_prob": st.column_config.NumberColumn("p(run's token)", format="%.4f")})

st.subheader(f"The chain, stage by stage ({chain_label}: {smp.describe(settings[chain_label])})")
st.caption("penalties → temperature → top-k → top-p → min-p → probs, via engine.sampling.sampler_chain with "
           f"the {len(context)} context ids and {len(generated)} generated ids the sampler saw at this step.")
c1, c2 = st.columns([3, 2])
c1.dataframe(view["chain"], hide_index=True, key="smp_chain_table")
c2.plotly_chart(view["chain_fig"], key="smp_chain_fig")

st.subheader("Empirical check")
stats = view["stats"]
c = st.columns(4)
c[0].metric("Draws", f"{n_draws:,}")
c[1].metric("Total variation", f"{stats['tv_distance']:.4f}")
c[2].metric("Chi-square", f"{stats['chi_square']:.2f}", f"dof {stats['dof']:.0f}", delta_color="off")
c[3].metric("p-value", "—" if stats["p_value"] != stats["p_value"] else f"{stats['p_value']:.3f}")
st.caption(f"{n_draws:,} draws with torch.multinomial and a torch.Generator seeded {seed} (as the engine draws), "
           "against the probabilities of setting " + chain_label + ". Chi-square pools tokens expected fewer "
           "than 5 times; a tiny p-value would mean the draws do not follow the distribution.")
st.dataframe(view["empirical"], hide_index=True, key="smp_empirical")
st.caption(f"Page computed in {1e3 * seconds:.0f} ms from the captured logits; the model was not called.")
