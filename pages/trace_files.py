"""Trace files: save the current run (tokens, per-step sampling records, per-stage statistics, logits, timing
marks, cache memory, loops, first non-finite value) to one file, or open one as the current run.

A reopened trace is the app's run like any other: Overview, Tokens, Sampling, Timeline, Activations'
statistics, Repetition and the NaN doctor's "This run" read only what the trace holds. Pages that run the
model again (Attention, the logit lens, fault injection, precision, penalty comparison) need the model the
trace was made with chosen in the sidebar. Files are safetensors + JSON: nothing is unpickled."""
import hashlib

import streamlit as st
from streamlit.runtime.scriptrunner import get_script_run_ctx

from engine import EngineError
from engine.inspection.trace import from_bytes, summary, to_bytes
from inspector.session.budget import trace_file_limit
from inspector.session.limits import trace_bounds
from inspector.session.memo import run_key
from inspector.session.run import track
from inspector.ui.common import current_run, get_model, plain, server_limits
from inspector.ui.frame import ensure_frame
from inspector.ui.sidebar import keep_run
from inspector.ui.state import session

ensure_frame()         # opened alone (a fresh server): into app.py's frame, once per script run


def take_upload(up) -> None:
    """Parse the uploaded file once (validated against this server's limits and the loaded model), keep the
    result in OPENED, and give the upload's bytes back: the server keeps no second copy of a file it has read,
    and what it keeps is counted in the session's budget (inspector.session.budget)."""
    limits, model = server_limits(show_error=False), get_model()
    most = trace_file_limit(limits)
    if up.size > most:
        result = (f"the file is {up.size / 2**20:,.1f} MiB; this server opens trace files of at most "
                  f"{most / 2**20:,.1f} MiB (half of a session's memory budget, LLM_INSPECTOR_MAX_SESSION_MB)")
        digest = None
    else:
        data = up.getvalue()
        digest = hashlib.sha256(data).hexdigest()
        try:
            result = from_bytes(data, trace_bounds(limits, model, max_bytes=most))
        except EngineError as e:
            result = str(e)
        except Exception as e:     # a parser failure the checks did not foresee: still one clear message
            result = f"the file could not be read ({type(e).__name__})"
        del data
    session().opened = (str(up.name)[:200], digest, result)
    ctx = get_script_run_ctx()
    if ctx is not None:
        ctx.uploaded_file_mgr.remove_file(ctx.session_id, up.file_id)
    session().uploads += 1         # the uploader's key: a taken file leaves the widget


st.header("Trace files")

st.subheader("Save the current run")
run = current_run()
if run is None:
    st.info("Enter a prompt in the sidebar and press **Run** to make a run to save (or open a trace below).")
else:
    files = session().memo("tf_bytes")                               # run_key -> the file's bytes
    if run_key(run) not in files:
        files.clear()                                                # one file kept: the current run's
        files[run_key(run)] = to_bytes(run)
    data = files[run_key(run)]
    st.caption(f"{plain(run.model_name)} · {run.n_prompt} prompt + {len(run.result.token_ids)} generated tokens · "
               f"{len(run.recording.stats)} statistics blocks · {len(run.recording.captures)} captures · "
               f"{len(data) / 2**20:.2f} MiB")
    st.download_button("Download trace", data=data, file_name=f"run-{int(run.created)}.trace",
                       mime="application/octet-stream", key="tf_download")
    st.caption("Headless: `python -m engine trace \"prompt\" [generation flags] --out run.trace` writes the same "
               "format.")

st.subheader("Open a trace")
up = st.file_uploader("Trace file (.trace / .safetensors)", type=["trace", "safetensors"],
                      key=f"tf_upload_{session().uploads}",
                      max_upload_size=max(1, trace_file_limit(server_limits(show_error=False)) >> 20))
if up is not None:
    take_upload(up)
    st.rerun()
opened = session().opened      # (file name, sha256, the parsed trace or the error)
if opened is not None and isinstance(opened[2], str):
    st.error(f"Could not open {plain(opened[0])}: {plain(opened[2])}")
elif opened is not None:
    name, _, trace = opened
    st.text(f"File: {name}")
    info = summary(trace)
    c = st.columns(4)
    c[0].metric("Prompt tokens", info["prompt_tokens"])
    c[1].metric("Generated tokens", info["generated_tokens"])
    c[2].metric("Stop reason", info["stop_reason"])
    c[3].metric("Loops", info["loops"])
    nf = trace.first_nonfinite
    # strings from the file are shown as text, never as Markdown (no links, images or HTML from a stranger)
    st.text(f"Model: {trace.model_name} · KV cache {info['cache'].get('bytes_used', 0) / 2**20:.2f} MiB used")
    st.markdown("every stage finite" if nf is None else
                f"first non-finite: `{nf['stage']}` layer {nf['layer']}, position {nf['position']}, "
                f"step {nf['step']}")
    for lp in trace.loops:
        st.markdown(f"- loop: start {lp.start}, period {lp.period}, count {lp.count}")
    made_with = trace.extra.get("injections") or trace.interventions
    if made_with:
        st.text(f"Made with: {', '.join(map(str, made_with))}")
    st.code(trace.result.text or "(nothing)", language=None, wrap_lines=True)
    if st.button("Open as the current run", key="tf_open", type="primary"):
        session().opened = None               # the run list holds it from now on: one copy, counted once
        keep_run(track(trace), server_limits(show_error=False).max_runs_kept)
        st.toast("Opened the file: every page now shows this run.")
        st.rerun()
