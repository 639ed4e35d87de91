"""What every page shares: the one model loader, the sidebar (model, prompt, settings, Run), the current run.

The model is loaded once per process (st.cache_resource) and shared by every browser session; a run and
everything derived from it lives in that session's st.session_state only.
"""
from __future__ import annotations

import os
from pathlib import Path

import streamlit as st
import torch

from engine import EngineError, Model, load_model
from engine.sources import find_in_hub_cache, hub_cache_dirs
from inspector.run import RunRecord, RunSettings, inspect_run

BUNDLED = "SmolLM2-135M-Instruct (bundled)"
RUN_KEY = "run"


def model_roots() -> list[Path]:
    """Folders whose models the browser may choose from ($LLM_INSPECTOR_MODEL_ROOTS, os.pathsep separated)."""
    raw = os.environ.get("LLM_INSPECTOR_MODEL_ROOTS", "")
    return [Path(p).expanduser() for p in raw.split(os.pathsep) if p.strip()]


@st.cache_data(ttl=60, show_spinner=False)
def model_choices() -> dict[str, str | None]:
    """Display label -> source, for the bundled model, models under the roots and the hub cache."""
    choices: dict[str, str | None] = {}
    default = os.environ.get("LLM_INSPECTOR_MODEL")
    if default:
        choices[f"{Path(default).name} (server default)"] = default
    choices[BUNDLED] = None
    for root in model_roots():
        if not root.is_dir():
            continue
        for p in sorted(root.iterdir()):
            if (p / "config.json").is_file() or p.suffix == ".gguf":
                choices[f"{p.name} ({root})"] = str(p)
    for hub in hub_cache_dirs():
        if hub.is_dir():
            for repo in sorted(hub.glob("models--*--*")):
                repo_id = repo.name.removeprefix("models--").replace("--", "/", 1)
                snap = find_in_hub_cache(repo_id)
                if snap is not None and (snap / "config.json").is_file():
                    choices[f"{repo_id} (hub cache)"] = repo_id
    return choices


@st.cache_resource(show_spinner=False, max_entries=4)
def shared_model(source: str | None, device: str, dtype: str, _progress=None) -> Model:
    return load_model(source, device=device, dtype=None if dtype == "auto" else dtype, progress=_progress)


def get_model() -> Model | None:
    """The model chosen in the sidebar, loading it (with a progress bar) the first time in this process."""
    label = st.session_state.get("sb_model")
    choices = model_choices()
    source = choices.get(label, next(iter(choices.values())))
    device = st.session_state.get("sb_device", "auto")
    device = "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    dtype = st.session_state.get("sb_dtype", "auto")
    bar = st.sidebar.empty()
    try:
        model = shared_model(source, device, dtype,
                             _progress=lambda f, msg: bar.progress(min(max(f, 0.0), 1.0), text=msg))
    except EngineError as e:
        st.sidebar.error(f"Could not load the model: {e}")
        return None
    finally:
        bar.empty()
    return model


def sidebar() -> Model | None:
    sb = st.sidebar
    sb.title("LLM Inspector")
    sb.selectbox("Model", list(model_choices()), key="sb_model")
    c1, c2 = sb.columns(2)
    c1.selectbox("Device", ["auto", "cpu"] + (["cuda"] if torch.cuda.is_available() else []), key="sb_device")
    c2.selectbox("Dtype", ["auto", "float32", "bfloat16", "float16"], key="sb_dtype")
    model = get_model()
    if model is not None:
        sb.caption(f"{model.name} · {model.config.num_layers} layers · {model.device.type} · "
                   f"{str(model.dtype).removeprefix('torch.')}")
    sb.text_area("Prompt", "What is the capital of France?", key="sb_prompt", height=100)
    sb.toggle("Chat format", value=True, key="sb_chat")
    with sb.expander("Generation settings"):
        st.number_input("Max new tokens", 1, 1024, 32, key="sb_max_new")
        st.slider("Temperature", 0.0, 2.0, 0.0, 0.05, key="sb_temperature")
        st.number_input("Top-k (0 = off)", 0, 1000, 0, key="sb_top_k")
        st.slider("Top-p", 0.01, 1.0, 1.0, 0.01, key="sb_top_p")
        st.slider("Min-p", 0.0, 1.0, 0.0, 0.01, key="sb_min_p")
        st.slider("Repetition penalty", 0.5, 2.0, 1.0, 0.05, key="sb_rep")
        st.slider("Frequency penalty", -2.0, 2.0, 0.0, 0.1, key="sb_freq")
        st.slider("Presence penalty", -2.0, 2.0, 0.0, 0.1, key="sb_pres")
        st.number_input("No-repeat n-gram (0 = off)", 0, 10, 0, key="sb_ngram")
        st.number_input("Seed", 0, 2**31 - 1, 0, key="sb_seed")
        st.toggle("Special-token text in the prompt acts as control tokens", value=False, key="sb_allow_special")
    if sb.button("Run", type="primary", key="sb_run", disabled=model is None, use_container_width=True):
        run_model(model, settings_from_sidebar())
    return model


def settings_from_sidebar() -> RunSettings:
    s = st.session_state
    return RunSettings(prompt=s["sb_prompt"], chat=s["sb_chat"], max_new_tokens=int(s["sb_max_new"]),
                       temperature=float(s["sb_temperature"]), top_k=int(s["sb_top_k"]), top_p=float(s["sb_top_p"]),
                       min_p=float(s["sb_min_p"]), repetition_penalty=float(s["sb_rep"]),
                       frequency_penalty=float(s["sb_freq"]), presence_penalty=float(s["sb_pres"]),
                       no_repeat_ngram=int(s["sb_ngram"]), seed=int(s["sb_seed"]),
                       allow_special=bool(s["sb_allow_special"]))


def run_model(model: Model, settings: RunSettings) -> RunRecord | None:
    """Generate with full inspection, streaming the text into the sidebar; keep the run in this session."""
    box = st.sidebar.empty()
    bar = st.sidebar.progress(0.0, text="generating")
    text: list[str] = []

    def on_token(step) -> None:
        text.append(step.text)
        box.markdown(f"```\n{''.join(text)}\n```")
        bar.progress(min(1.0, (step.index + 1) / settings.max_new_tokens), text=f"token {step.index + 1}")

    try:
        record = inspect_run(model, settings, on_token=on_token)
    except EngineError as e:
        st.sidebar.error(str(e))
        return None
    finally:
        bar.empty()
        box.empty()
    st.session_state[RUN_KEY] = record
    return record


def current_run() -> RunRecord | None:
    return st.session_state.get(RUN_KEY)


def require_run() -> RunRecord:
    """The session's current run, or a hint to press Run (and the page stops there)."""
    run = current_run()
    if run is None:
        st.info("Enter a prompt in the sidebar and press **Run** to inspect a generation.")
        st.stop()
    return run
