"""Sampling: the run's captured logits at one step under several sampler settings, the chain stage by stage
(with what its order means for these numbers), and seeded draws against the computed probabilities. Every
control here is display-only: nothing re-runs the model, all of it is recomputed from the logits the run
captured. The page body is a fragment (a slider move reruns it alone, not the sidebar) and each setting's
chain and the draws are memoised, so a move recomputes only what it changed."""
import math
import time

import streamlit as st

from engine import SamplingParams
from engine.sampling import sampler_chain
from inspector.session.limits import LimitError, check_int
from inspector.session.memo import content_key, memo, view_store
from inspector.ui.common import on_demand, plain, require_run_and_model, was_stopped
from inspector.ui.demos import lesson
from inspector.ui.frame import ensure_frame
from inspector.ui.state import session
from inspector.ui.widgets import chart, columns, metric_columns, projector, sampling_form, shared, table
from inspector.views import sampling as smp
from inspector.views import softcap as sc

ensure_frame()         # opened alone (a fresh server): into app.py's frame, once per script run

DEFAULTS = [None, *smp.PRESETS]           # A: the run's own settings
LABELS = "ABCDE"
SOFTCAP_AUTO = 512                        # longer prefixes compute the soft cap view only when asked
SEEDS = 200                               # seeds of the pass-rate check
MAX_DRAWS = 100_000                       # draws per check (a forged larger number is refused)

st.header("Sampling")
run, model = require_run_and_model()
lesson("sampling")          # after the Temperature and top-p demo: its lesson on the first screen
result = run.result
tok = model.tokenizer
if not result.steps:
    st.info(f"This run drew no token (stop reason: {plain(result.stop_reason)}), so there is no step to replay.")
    st.stop()
if session().sampling_for != run.created:
    # a new run: setting A follows its settings again, and the step must exist in it
    for k in [k for k in st.session_state if k == "smp_step" or k.startswith("smp_0_")]:
        del st.session_state[k]
    session().sampling_for = run.created
cache = session().memo("smp_cache")


def settings_panels(n: int) -> dict[str, SamplingParams]:
    settings: dict[str, SamplingParams] = {}
    for i, col in enumerate(st.columns(n)):
        default = result.params if DEFAULTS[i] is None else SamplingParams(**DEFAULTS[i])
        with col.container(border=True):
            st.markdown(f"**{LABELS[i]}**" + (" · the run's settings" if DEFAULTS[i] is None else ""))
            params = sampling_form(f"smp_{i}", default)
            if params is not None:
                settings[LABELS[i]] = params
    return settings


def empirical_check(stats: dict, n_draws: int, seed: int, chain_label: str, probs, key: tuple) -> None:
    c = metric_columns(4)
    c[0].metric("Draws", f"{n_draws:,}")
    c[1].metric("Total variation", f"{stats['tv_distance']:.4f}")
    c[2].metric("Chi-square", f"{stats['chi_square']:.2f}", f"dof {stats['dof']:.0f}", delta_color="off")
    p = stats["p_value"]
    c[3].metric("p-value", "—" if p != p else f"{p:.3f}")
    st.caption(f"{n_draws:,} draws with torch.multinomial and a torch.Generator seeded {seed} (as the engine draws), "
               f"against the probabilities of setting {chain_label}; chi-square pools tokens expected fewer than "
               "5 times. **What the p-value means:** if the draws follow the probabilities exactly, p is equally "
               "likely to fall anywhere between 0 and 1, so p < 0.05 still happens at about 1 seed in 20. One "
               "p-value is no verdict on the sampler; the share of seeds below 0.05 is.")
    if p == p and p < 0.05:
        st.info(f"p = {p:.3f} at seed {seed}: a correct sampler gives p below 0.05 at about 5 % of seeds. Check "
                f"the rate over {SEEDS} seeds below before suspecting the sampler.")
    if key in cache or st.button(f"Check over {SEEDS} draw seeds", key="smp_pass_btn"):
        with st.spinner(f"{SEEDS} × {n_draws:,} draws…"):
            r = memo(cache, key, lambda: smp.pass_rate(probs, n_draws, SEEDS), max_entries=32)
        sd = math.sqrt(SEEDS * 0.05 * 0.95)
        lo, hi = max(0, round(SEEDS * 0.05 - 2 * sd)), round(SEEDS * 0.05 + 2 * sd)
        verdict = "as chance predicts" if lo <= r["below"] <= hi else "more than chance explains: look closer"
        st.success(f"{int(r['below'])} of {SEEDS} seeds ({r['share_below']:.1%}) gave p < 0.05; a correct sampler "
                   f"gives about 5 % ({lo}–{hi} of {SEEDS} by chance): {verdict}.")


def derive(step: int, settings: dict, chain_label: str, n_draws: int, seed: int, top_n: int,
           big: bool = False) -> tuple:
    """(the chain setting's final probabilities, smp.redraw's view) at this step; big: the figures laid out for
    a projector (part of the key). Keys start with the run's content key: dropping the run drops them
    (keep_run); a room's run shares them with every student's session (inspector.session.memo), figures
    included; a run of one's own keeps the chains and draws, not figures."""
    logits, (context, generated) = smp.step_logits(run.recording, step), smp.step_context(result, step)
    store, rk = view_store(run, cache), content_key(run, model)
    stages = {label: memo(store, (rk, step, "chain", p), lambda p=p: sampler_chain(logits, p, context, generated),
                          max_entries=32) for label, p in settings.items()}
    probs = stages[chain_label]["sampler.probs"]
    draws = memo(store, (rk, step, "draws", settings[chain_label], n_draws, seed),
                 lambda: smp.empirical(probs, n_draws, seed, lambda i: tok.decode([i])), max_entries=32)
    figures = view_store(run, None)
    view = memo(figures, (rk, step, "view", tuple(settings.items()), chain_label, n_draws, seed, top_n, big),
                lambda: smp.redraw(logits, settings, chain_label, context, generated, lambda i: tok.decode([i]),
                                   chosen=result.token_ids[step], n_draws=n_draws, seed=seed, top_n=top_n,
                                   stages=stages, draws=draws, projector=big), max_entries=32)
    return probs, view


def softcap_section(step: int, top_n: int) -> None:
    """Gemma 2's final soft cap at this step: the logits before it (logits_uncapped) and after (what the run
    sampled from), from one forward over the positions up to this step's (the run kept only the capped ones)."""
    cap, pos = model.config.final_softcap, run.n_prompt - 1 + step
    st.subheader(f"The final soft cap (logits = {cap:g} · tanh(logits / {cap:g}))")
    st.caption("This model squeezes its logits into (−cap, cap) before sampling. tanh keeps the tokens' order, so "
               "the top token never changes, but the large logits are pulled in, which flattens the distribution. "
               f"Computed by one forward over the {pos + 1:,} positions up to this step.")
    what, k = f"the logits before the soft cap over {pos + 1:,} positions", (content_key(run, model), "softcap", step)
    if not (k in cache or pos < SOFTCAP_AUTO or was_stopped(what, k)
            or st.button("Compute the logits before the cap", key="smp_softcap_btn")):
        st.info(f"Step {step}: one forward over {pos + 1:,} positions. Press the button.")
        return
    got = on_demand(cache, k, what, lambda tell: sc.capped_logits(model, run.ids, pos),
                    work=(model, pos + 1, model.config.num_layers), max_entries=16)
    if got is None:
        return
    uncapped, capped = got
    s = sc.softcap_summary(uncapped, capped, cap)
    c = metric_columns(4)
    c[0].metric("Largest |logit| before", f"{s['max_abs_uncapped']:.3f}")
    c[1].metric("Largest |logit| after", f"{s['max_abs_capped']:.3f}", f"cap {cap:g}", delta_color="off")
    c[2].metric("Top logit pulled in by", f"{s['top_pull']:.3f}")
    c[3].metric("Entropy before → after", f"{s['entropy_uncapped']:.3f} → {s['entropy_capped']:.3f}")
    tbl = sc.softcap_table(uncapped, capped, top_n, lambda i: tok.decode([i]))
    chart(sc.softcap_figure(tbl, cap), key="smp_softcap_fig")
    st.caption(f"The top {len(tbl)} tokens; {s['share_bent']:.1%} of the vocabulary moved by more than 1 % of the "
               "cap. Points on the dotted line were left alone; the further right of it, the harder the cap bent.")
    table(tbl, "smp_softcap_table", formats={"uncapped": "%.4f", "capped": "%.4f", "bent": "%.4f",
                                              "prob_uncapped": "%.5f", "prob_capped": "%.5f"}, texts=("token",))


@st.fragment
def summary_table(view: dict) -> None:
    table(view["summary"], "smp_summary",
          formats={"kept": "localized", "kept_tiny": "localized", "entropy": "%.3f", "entropy_before": "%.3f",
                   "mass_kept": "%.4f", "chosen_prob": "%.4f"},
          labels={"kept_tiny": "kept with p < 1e-30", "entropy_before": "entropy before cut",
                  "chosen_prob": "p(run's token)"})
    st.caption("*kept*: tokens with a probability above 0 in the end; a setting that cuts nothing (no top-k, top-p "
               "or min-p) keeps nearly the whole vocabulary, most of it at probabilities no draw will ever hit "
               "(*kept with p < 1e-30*; only those that underflow to exactly 0 in float32 are not counted).")


def chain_section(view: dict, chain_label: str, settings: dict, n_context: int, n_generated: int) -> None:
    st.subheader(f"The chain, stage by stage ({chain_label}: {smp.describe(settings[chain_label])})")
    st.caption("penalties → temperature → top-k → top-p → min-p → probs, via engine.sampling.sampler_chain with "
               f"the {n_context} context ids and {n_generated} generated ids the sampler saw at this step.")
    c1, c2 = columns([3, 2])
    with c1:
        table(view["chain"], "smp_chain_table", formats={"kept": "localized", "entropy": "%.3f"})
    with c2:
        chart(view["chain_fig"], key="smp_chain_fig")


def body() -> None:
    t0 = time.perf_counter()
    big = projector()
    # On the projector the comparison comes first (it was 1,500-1,900 px down, under the step and settings): drawn
    # into this container, above the controls, once they have been read.
    first = st.container() if big else None
    c1, c2 = st.columns([3, 1])
    # the step the debugger stopped at, when this run comes from it; otherwise the first
    default_step = min(int(session().selected_step or 0), len(result.steps) - 1)
    last = len(result.steps) - 1
    try:        # every number a browser sends is checked here, not only by the widget's own bounds
        step = check_int(c1.number_input(f"Step (0 = after the prefill; {len(result.steps)} in this run)", 0,
                                         last, key="smp_step",
                                         **shared("smp_step", allowed=range(len(result.steps)), value=default_step)),
                         0, last, "Step")
        top_n = check_int(c2.number_input("Tokens shown", 5, 60, 20, key="smp_top_n"), 5, 60, "Tokens shown")
    except LimitError as e:
        st.error(str(e))
        return
    chosen = result.token_ids[step]
    context, generated = smp.step_context(result, step)
    st.caption(f"At step {step} the run chose **{plain(repr(tok.decode([chosen])))}** (id {chosen}) with probability "
               f"{result.steps[step].prob:.4f} under its settings ({smp.describe(result.params)}); it is the red "
               "bar below wherever it appears.")
    try:
        n = check_int(st.number_input("Settings side by side", 3, 5, 3, key="smp_n"), 3, 5, "Settings side by side")
    except LimitError as e:
        st.error(str(e))
        return
    settings = settings_panels(n)
    if len(settings) < n:
        return
    c1, c2, c3 = st.columns([2, 1, 1])
    chain_label = c1.radio("Stage by stage, and the draws, for setting", list(settings), horizontal=True,
                           key="smp_chain")
    try:
        n_draws = check_int(c2.number_input("Draws", 100, MAX_DRAWS, 1000, 100, key="smp_draws"), 100, MAX_DRAWS,
                            "Draws")
        seed = check_int(c3.number_input("Draw seed", 0, 2**31 - 1, 0, key="smp_draw_seed"), 0, 2**31 - 1,
                         "Draw seed")
    except LimitError as e:
        st.error(str(e))
        return

    probs, view = derive(step, settings, chain_label, n_draws, seed, top_n, big)

    if first is not None:
        with first:
            st.subheader(f"Side by side: step {step}, settings {', '.join(settings)} (change them below)")
            chart(view["compare_fig"], key="smp_compare_fig")
    else:
        st.subheader("Side by side")
    st.info("**The chain runs in this order: penalties → temperature → top-k → top-p → min-p.** Temperature "
            "reshapes the distribution *before* top-p cuts it, so a higher temperature can leave more tokens under "
            "a smaller top-p. At this step:\n\n" + "\n\n".join(f"- {line}" for line in view["notes"]))
    st.caption("Tokens ranked by their logits after penalties and temperature; bars are probabilities before "
               "top-k/top-p/min-p cut (blue kept, grey cut, red the run's token), black dots the final sampling "
               "probabilities, the dashed line where the kept set ends. Entropy H in nats of the final distribution."
               + (f" On the projector each panel shows the top {min(top_n, smp.PROJECTOR_TOKENS)} tokens, one "
                  "panel per row." if big else ""))
    if first is None:
        chart(view["compare_fig"], key="smp_compare_fig")
    summary_table(view)
    chain_section(view, chain_label, settings, len(context), len(generated))
    st.subheader("Empirical check")
    empirical_check(view["stats"], n_draws, seed, chain_label, probs,
                    (content_key(run, model), step, "pass", settings[chain_label], n_draws))
    table(view["empirical"], "smp_empirical", formats={"token_id": "%d", "count": "localized"}, texts=("token",))
    st.caption(f"Page computed in {1e3 * (time.perf_counter() - t0):.0f} ms from the captured logits (each "
               "setting's chain and the draws memoised); the model was not called.")
    if model.config.final_softcap is not None:
        softcap_section(step, top_n)


body()
