"""Overview: before any run, what the app is and three demo runs; then what went in, what came out, why it
stopped (loops and non-finite values flagged, with links to the pages that explain them), how long it took,
and every step's choice; a take-home report of the run (one HTML file that opens offline) to download."""
import time

import streamlit as st

from engine.cli.report import reproduce_command
from engine.generate import nonfinite_stop
from engine.report.data import attention_maps, default_layers
from engine.report.html import build_html
from engine.sources import BUNDLED_NAME
from engine.tools.quant_scoreboard import Scoreboard
from engine.tools.quant_stored import StoredReport
from inspector.session.limits import LimitError, check_run_positions, cut_text
from inspector.session.memo import run_key
from inspector.ui import common
from inspector.ui.common import current_run, get_model, on_demand, plain, require_run, server_limits, was_stopped
from inspector.ui.demos import demo_buttons
from inspector.ui.frame import ensure_frame
from inspector.ui.state import session
from inspector.ui.widgets import metric_columns, page_link
from inspector.views.family import family_notes
from inspector.views.tokens import seen_prompt_text, steps_table, token_counts

ensure_frame()         # opened alone (a fresh server): into app.py's frame, once per script run

STOP_HELP = {"eos": "The model chose its end-of-text token.", "stop_string": "The text reached a stop string.",
             "max_new_tokens": "The run generated the number of new tokens asked for.",
             "context": "The sequence filled the model's context window.",
             "non-finite logits": "The logits held NaN or Inf: nothing could be sampled.",
             "stopped": "Stop was pressed."}


def session_tools() -> tuple:
    """What this session's tools computed last (a QK score split, a steering run, a determinism check, a quantization
    scoreboard, a GGUF file as stored vs dequantised, the tuned lens at a position, the head atlas), each as its JSON-able dict or None: the report's Tools
    section (engine.report.tools)."""
    s = session()
    boards, stored = s.memo("qsb_boards"), s.memo("qz_stored")
    board = next(reversed(boards.values()), None) if boards else None
    last_stored = next(reversed(stored.values()), None) if stored else None
    return (s.qk[1] if s.qk else None, s.steered, s.determinism, board, last_stored, s.lens, s.atlas)


def make_report(run, model, on_progress=None, tools=()) -> str:
    """The run's report; with the model it was made with, also token texts and attention maps (first, middle
    and last layer), computed here under this server's limits (on_progress: engine.report.data.attention_maps');
    tools: session_tools(), shown in its Tools section."""
    tools = [t.as_dict() if isinstance(t, (Scoreboard, StoredReport)) else t for t in tools if t is not None]
    if model is None or model.name != run.model_name:
        return build_html(run, command=reproduce_command(run, out="report.html"), tools=tools,
                          notes=["The model this run was made with is not loaded: no attention maps."])
    notes, maps = [], {}
    try:
        check_run_positions(run.ids, model, server_limits(show_error=False))
        maps = attention_maps(model, run.ids, default_layers(model.config.num_layers),
                              injections=run.extra.get("injections") or (), norm_eps=run.extra.get("norm_eps"),
                              on_progress=on_progress)
    except LimitError as e:
        notes.append(f"No attention maps: {e}")
    # the model's folder name, not the server's path to it (nothing of the server's file system reaches a browser)
    source = None if model.name == BUNDLED_NAME else model.path.name
    cmd = reproduce_command(run, out="report.html", model=source, dtype=str(model.dtype).removeprefix("torch."),
                            device=model.device.type)
    return build_html(run, tokenizer=model.tokenizer, attention=maps, command=cmd, notes=notes, tools=tools)


st.header("Overview")
if current_run() is None:
    st.markdown(
        "**LLM Inspector** runs a small language model on this server and lets you look inside while it writes: "
        "how your text becomes tokens, where each layer's attention goes, what every layer computes, how the "
        "sampler turns the model's scores into one chosen word (temperature, top-k, top-p), how the memory of the "
        "KV cache grows, and what goes wrong when it loops or a NaN appears. Type a prompt in the sidebar and "
        "press **Run**, or start with one of these:")
    demo_buttons("ov_demo", disabled=session().live is not None)
    st.caption("Each demo fills the sidebar with its prompt and settings, runs, and opens the page that shows "
               "what it is about. Every page then shows that run; change the prompt and press Run to make your own.")
    common.finish_load()  # a fresh server's first visitors: the sidebar shows the model's load until it is done
    st.stop()
run = require_run()
res = run.result
model = get_model()
tok = model.tokenizer if model is not None and model.name == run.model_name else None

st.caption(f"Model **{plain(run.model_name)}** · {run.n_prompt} prompt tokens · {len(res.token_ids)} generated · "
           f"seed {res.seed} · chat format {'on' if run.settings.chat else 'off'}")

PAGE_TITLES = {"kv_cache": "KV cache", "attention": "Attention", "activations": "Activations: expert routing",
               "sampling": "Sampling: the logits before and after the cap"}
notes = family_notes(model.config) if tok is not None else []
if notes:
    with st.expander(f"This model's family ({plain(model.config.model_type)}): what differs from a plain Llama block",
                     expanded=True):
        for text, target in notes:
            st.markdown(f"- {text}")
            page_link(target, PAGE_TITLES[target], icon=":material/arrow_forward:")

bad_logits, nf = nonfinite_stop(res), run.first_nonfinite
if bad_logits or nf:
    held = "NaN or Inf" if bad_logits is None or bad_logits["nan"] is None else \
        f"{bad_logits['nan']:,} NaN and {bad_logits['inf']:,} Inf"
    where = (f"step {bad_logits['step']}'s logits held {held} values, so no token was drawn from them and the run "
             "stopped there" if bad_logits else "a stage went non-finite")
    first = (f" The first NaN/Inf: {plain(nf['stage'])}, position {plain(nf['position'])}, step {plain(nf['step'])}."
             if nf else "")
    st.error(f"**Non-finite values**: {where}.{first}")
    page_link("nan_doctor", "NaN doctor: where it began, and why", icon=":material/healing:")
    page_link("activations", "Activations: every NaN/Inf cell", icon=":material/monitoring:")
if run.loops:
    lp = run.loops[0]
    tail = " The generation ends inside it." if lp.end == len(res.token_ids) else ""
    st.warning(f"**Repetition loop**: from step {lp.start} the same {lp.period} tokens repeat {lp.count} times"
               + (f" ({len(run.loops)} loops in all)." if len(run.loops) > 1 else ".") + tail)
    page_link("repetition", "Repetition: the loop, the heads that copy it, the penalties that break it",
              icon=":material/repeat:")

left, right = st.columns(2)
with left:
    st.subheader("Prompt (as the model saw it)")
    if tok is not None:
        prompt, typed = seen_prompt_text(tok, res.prompt_ids)
        if typed:
            st.caption(f"[typed text: …] marks text in the prompt that spells a special token ({typed} in all): "
                       "the model read it as ordinary characters, not as that control token (the sidebar's toggle "
                       "'Special-token text in the prompt acts as control tokens' makes it one).")
    else:      # the file's own prompt: any type, any length (a trace's settings are its writer's)
        prompt, cut = cut_text(run.settings.prompt, server_limits(show_error=False).max_prompt_chars)
        if cut:
            st.caption(f"The run's prompt: {cut}.")
    st.code(prompt.replace("\n", "⏎\n"), language=None, wrap_lines=True)      # ⏎: each newline, the last too
with right:
    st.subheader("Generated text")
    st.code(res.text or "(nothing)", language=None, wrap_lines=True)

t = res.timings
# The stop reason is a word ("max_new_tokens", "non-finite logits"), as wide as three numbers: it gets a wide
# column of its own, the times a row beneath, so neither is cut off at 1280-1440 px (nor in projector mode).
c = st.columns([3, 2])
c[0].metric("Stop reason", res.stop_reason, help=STOP_HELP.get(res.stop_reason))
c[1].metric("Run (with inspection)", f"{run.seconds:.2f} s")
c = metric_columns(4)
c[0].metric("Tokenize", f"{t.get('tokenize', 0) * 1e3:.1f} ms")
c[1].metric("Prefill", f"{t.get('prefill', 0) * 1e3:.0f} ms")
c[2].metric("Decode (total)", f"{t.get('decode', 0):.2f} s")
c[3].metric("Per decoded token", f"{t.get('per_token_decode', 0) * 1e3:.1f} ms")
if len(res.token_ids) > 1 and t.get("decode"):
    st.caption(f"Decode speed {(len(res.token_ids) - 1) / t['decode']:.1f} tokens/s · KV cache "
               f"{res.cache['bytes_used'] / 2**20:.2f} MiB used of {res.cache['bytes_allocated'] / 2**20:.2f} MiB")
if tok is not None:
    n = token_counts(tok, res.prompt_ids)
    st.caption(f"Prompt: {n['characters']} characters, {n['tokens']} tokens ({n['special']} special), "
               f"{n['bytes_per_token']:.2f} bytes per token")

st.subheader("Steps")
st.caption("prob: under the sampling distribution (after penalties, temperature, top-k/p, min-p); "
           "model prob and entropy (nats): the raw softmax; kept: tokens left with p > 0.")
st.dataframe(steps_table(res.steps, tok), key="ov_steps", hide_index=True,
             column_config={"prob": st.column_config.NumberColumn(format="%.4f"),
                            "model_prob": st.column_config.NumberColumn(format="%.4f"),
                            "entropy": st.column_config.NumberColumn(format="%.3f")})

st.subheader("Take-home report")
st.caption("One HTML file with this run: overview, token splits, every step, attention maps (first, middle and "
           "last layer), activation statistics, sampling distributions, NaN/loop findings and the command line "
           "that reproduces it. It opens in any browser with no network and no Python.")
reports = session().memo("ov_report")
tools = session_tools()
key = (run_key(run), *map(id, tools))        # a tool computed since makes a new report
if key not in reports and (was_stopped("the report", key) or st.button("Make a report (HTML)", key="ov_report_make")):
    maps_too = model is not None and model.name == run.model_name      # else the report has no attention maps
    on_demand(reports, key, "the report", lambda tell: make_report(run, model, tell, tools),
              work=(model, len(run.ids), model.config.num_layers) if maps_too else None, max_entries=1)
if key in reports:
    st.download_button("Download report (HTML)", data=reports[key], mime="text/html", key="ov_report_download",
                       file_name=time.strftime("llm-inspector-%Y%m%d-%H%M%S.html", time.localtime(run.created)))
