"""Widgets several pages share. One builder for the sampler settings: every page that lets a user choose
them (sidebar, debugger, sampling, compare) draws the same widgets and reads one SamplingParams back."""
from __future__ import annotations

from dataclasses import fields

import streamlit as st

from engine import InputError, SamplingParams

# field: (label, kind, lowest, highest, step); the same bounds everywhere (the engine checks them too)
SAMPLER_WIDGETS = {
    "temperature": ("Temperature", "slider", 0.0, 2.0, 0.05),
    "top_k": ("Top-k (0 = off)", "number", 0, 1000, 1),
    "top_p": ("Top-p", "slider", 0.01, 1.0, 0.01),
    "min_p": ("Min-p", "slider", 0.0, 1.0, 0.01),
    "repetition_penalty": ("Repetition penalty", "slider", 0.5, 2.0, 0.05),
    "frequency_penalty": ("Frequency penalty", "slider", -2.0, 2.0, 0.1),
    "presence_penalty": ("Presence penalty", "slider", -2.0, 2.0, 0.1),
    "no_repeat_ngram": ("No-repeat n-gram (0 = off)", "number", 0, 10, 1),
}
FILTERS = ("temperature", "top_k", "top_p", "min_p")
PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty", "no_repeat_ngram")
_INT = {f.name for f in fields(SamplingParams) if f.type in ("int", int)}


def widget_key(prefix: str, name: str) -> str:
    return f"{prefix}_{name}"


def _value(name: str, v) -> int | float:
    return int(v) if name in _INT else float(v)


def sampling_widgets(prefix: str, default: SamplingParams, names=tuple(SAMPLER_WIDGETS), container=None) -> None:
    """Draw the widgets of the named sampler settings, keyed f"{prefix}_{name}", starting at default."""
    box = container or st
    for name in names:
        label, kind, lo, hi, step = SAMPLER_WIDGETS[name]
        key = widget_key(prefix, name)
        # a widget whose value the page set through session state must not also get a default
        value = {} if key in st.session_state else {"value": min(max(_value(name, getattr(default, name)), lo), hi)}
        draw = box.slider if kind == "slider" else box.number_input
        draw(label, min_value=lo, max_value=hi, step=step, key=key, **value)


def sampling_params_from(prefix: str, fallback: SamplingParams | None = None) -> SamplingParams:
    """The SamplingParams the widgets of prefix hold (fallback's value for a widget not drawn).
    InputError names a setting the engine rejects."""
    state, base = st.session_state, fallback or SamplingParams()
    values = {name: _value(name, state.get(widget_key(prefix, name), getattr(base, name))) for name in SAMPLER_WIDGETS}
    return SamplingParams(**values)


def set_sampling_widgets(prefix: str, params: SamplingParams) -> None:
    """Make the widgets of prefix show params (before they are drawn in this script run)."""
    for name in SAMPLER_WIDGETS:
        st.session_state[widget_key(prefix, name)] = _value(name, getattr(params, name))


def sampling_form(prefix: str, default: SamplingParams, container=None) -> SamplingParams | None:
    """Filters, then penalties in an expander; the chosen SamplingParams, or None after showing the error."""
    box = container or st
    sampling_widgets(prefix, default, FILTERS, box)
    with box.expander("Penalties"):
        sampling_widgets(prefix, default, PENALTIES)
    try:
        return sampling_params_from(prefix, default)
    except InputError as e:
        box.error(str(e))
        return None
