"""Three one-click demo runs for a first visit: each fills the sidebar (prompt, settings), runs, and opens the
page that shows what it demonstrates, which says the demo's lesson at its top (lesson()): at 1280x720 the rest of
a page's first screen is controls. The buttons' callbacks run before the next script run, so the sidebar
widgets can still be set; the sidebar then starts the run and, once it is kept, calls after_run."""
from __future__ import annotations

from dataclasses import dataclass, field

import streamlit as st

from engine import SamplingParams
from inspector.ui.state import session
from inspector.ui.widgets import set_sampling_widgets, switch_to


@dataclass(frozen=True)
class Demo:
    label: str
    blurb: str
    prompt: str
    page: str                               # the page that shows the phenomenon (a pages/ file's name)
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new: int = 24
    seed: int = 0
    chat: bool = True
    page_state: tuple[tuple[str, object], ...] = ()   # widget values of that page
    autorun: bool = False                   # that page runs its computation at once (the NaN doctor's fault run)
    lesson: str = ""                        # what to look at on that page (Markdown); the blurb if empty


DEMOS = {
    "sampling": Demo(
        "Temperature and top-p", "Samples a story opening at T=1, top-p 0.9, then compares it on Sampling with "
        "T=1.5, top-p 0.5 (more tokens survive!) and T=0.7, top-p 0.9.",
        "Write the first sentence of a story about a lighthouse keeper.", "sampling",
        SamplingParams(temperature=1.0, top_p=0.9), max_new=24, seed=0,
        page_state=(("smp_1_temperature", 1.5), ("smp_1_top_p", 0.5), ("smp_1_top_k", 0), ("smp_1_min_p", 0.0),
                    ("smp_2_temperature", 0.7), ("smp_2_top_p", 0.9), ("smp_2_top_k", 0), ("smp_2_min_p", 0.0)),
        lesson="**The lesson: temperature reshapes the distribution before top-p cuts it.** This run sampled at "
               "T=1, top-p 0.9 (setting A). B is hotter, T=1.5, with a *smaller* top-p, 0.5; C is cooler, T=0.7, "
               "top-p 0.9. Compare how many tokens each keeps (each panel's title, the list and the table below): "
               "a higher temperature flattens the probabilities, so top-p needs more tokens to reach its share, "
               "and B can keep more than C although its top-p is smaller."),
    "loop": Demo(
        "A repetition loop", "Greedy decoding of a repetitive prompt falls into a loop; Repetition finds it, shows "
        "the heads that copy it, and tries the penalties that break it.",
        "I like apples. I like apples. I like", "repetition", SamplingParams(), max_new=40, chat=False),
    "nan": Demo(
        "A NaN fault", "Plants a NaN in layer 17's MLP at position 3; the NaN doctor finds the first stage that "
        "went non-finite, and the run stops with 'non-finite logits' instead of sampling from NaN.",
        "The quick brown fox jumps over the lazy dog", "nan_doctor", SamplingParams(), max_new=8, chat=False,
        page_state=(("nd_preset", "nan-activation"),), autorun=True),
}


def start(name: str) -> None:
    """Button callback: fill the sidebar with the demo's prompt and settings; the sidebar runs it."""
    d, s = DEMOS[name], st.session_state
    s["sb_prompt"], s["sb_chat"], s["sb_max_new"], s["sb_seed"] = d.prompt, d.chat, d.max_new, d.seed
    s["sb_allow_special"] = False
    set_sampling_widgets("sb", d.params)
    session().demo = name


def after_run(name: str) -> None:
    """The demo's run is kept (the session's current run): set its page's widgets, remember that its page
    says the lesson for this run, and open the page."""
    ss = session()
    for key, value in DEMOS[name].page_state:
        st.session_state[key] = value
    ss.autorun = ss.autorun or DEMOS[name].autorun
    ss.lesson = (name, getattr(ss.run, "created", None))
    switch_to(DEMOS[name].page)


def lesson(page: str) -> None:
    """At the top of a demo's page, while the session's run is the demo's run: what the demo teaches and where
    to look, on the first screen (above the controls)."""
    name, created = session().lesson or (None, None)
    run = session().run
    if name in DEMOS and DEMOS[name].page == page and run is not None and getattr(run, "created", None) == created:
        d = DEMOS[name]
        st.info(f"**Demo: {d.label}.** " + (d.lesson or d.blurb))


def demo_buttons(key: str, columns: bool = True, disabled: bool = False) -> None:
    """One button per demo (keys f"{key}_{name}"), each with its one-line explanation."""
    cols = st.columns(len(DEMOS)) if columns else [st.container() for _ in DEMOS]
    for col, (name, d) in zip(cols, DEMOS.items()):
        with col:
            st.button(d.label, key=f"{key}_{name}", on_click=start, args=(name,), use_container_width=True,
                      type="primary" if columns else "secondary", disabled=disabled, help=d.blurb)
            if columns:
                st.caption(d.blurb)
