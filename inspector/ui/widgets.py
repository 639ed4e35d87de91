"""Widgets several pages share. One builder for the sampler settings: every page that lets a user choose
them (sidebar, debugger, sampling, compare) draws the same widgets and reads one SamplingParams back. One
way to show a figure (chart: the app's style, projector mode), lay out charts (columns) and link pages.
`shared` makes a widget a room shares follow the teacher (inspector.ui.room_sync)."""
from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import streamlit as st
from streamlit.runtime.scriptrunner import get_script_run_ctx

from engine import InputError, SamplingParams
from inspector.session.limits import LimitError, check_chars, check_float, check_int
from inspector.session.memo import styled_once
from inspector.ui.common import plain
from inspector.ui.room_sync import SHARED_KEYS, following, is_teacher, publish_view, room
from inspector.views.theme import PROJECTOR_FONT

PROJECTOR = "sb_projector"          # the sidebar's projector toggle (also ?projector=1)

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


def shared(key: str, allowed=None, **default) -> dict:
    """Keyword arguments for a widget a room shares (inspector.ui.room_sync.SHARED_KEYS). On a following student's
    screen: the room's value (if `allowed` holds it; None: the widget's first option), disabled. On a
    teacher's: a callback that publishes the change at once. Otherwise `default` (value=…, index=…) unless
    the page set the value through session state (a widget given both warns)."""
    imposed = room().widgets if following() else None
    if imposed is not None and key in imposed:
        if imposed[key] is None:            # a selectbox's None option (the first) would read as "no choice"
            st.session_state.pop(key, None)
        elif allowed is None or imposed[key] in allowed:
            st.session_state[key] = imposed[key]
        return {"disabled": True} | ({} if key in st.session_state else default)
    kwargs = {} if key in st.session_state else dict(default)
    if key in SHARED_KEYS and is_teacher():
        kwargs["on_change"] = publish_view
    return kwargs


def sampling_widgets(prefix: str, default: SamplingParams, names=tuple(SAMPLER_WIDGETS), container=None) -> None:
    """Draw the widgets of the named sampler settings, keyed f"{prefix}_{name}", starting at default."""
    box = container or st
    for name in names:
        label, kind, lo, hi, step = SAMPLER_WIDGETS[name]
        key = widget_key(prefix, name)
        value = shared(key, allowed=_Range(lo, hi))
        held = st.session_state.get(key, getattr(default, name))
        if isinstance(held, bool) or not isinstance(held, (int, float)) or not math.isfinite(held):
            held = getattr(default, name)      # a forged value: sampler_problems says what it is
        now = _value(name, held)
        if kind == "slider":
            # Always the value it holds now (a room's, or the default): a slider created without one gets its
            # minimum as its default, and one that mounts late (inside a just-opened expander) has sent that
            # minimum to the server (top-p 0.01, every penalty at its lowest) while showing the right value.
            value["value"] = min(max(now, lo), hi)
            box.slider(label, min_value=lo, max_value=hi, step=step, key=key, **value)
        else:
            # No bounds in the browser: a number typed outside them would only get a red border there while the
            # server kept the old value (Top-k -5 ran as 0). The value reaches the server as typed, and
            # sampler_problems names the setting and its range (the sidebar refuses to run with it).
            value["value"] = now
            box.number_input(label, step=step, key=key, help=f"A whole number from {lo:,} to {hi:,}.", **value)


class _Range:
    def __init__(self, lo, hi) -> None:
        self.lo, self.hi = lo, hi

    def __contains__(self, v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and self.lo <= v <= self.hi


def setting_name(name: str) -> str:
    """The sampler setting's name as its widget says it, without the hint: "Top-k", "No-repeat n-gram"."""
    return SAMPLER_WIDGETS[name][0].split(" (")[0]


def sampler_problems(prefix: str, names=tuple(SAMPLER_WIDGETS)) -> list[str]:
    """One message per setting of prefix's widgets that is outside its widget's range, naming the setting and
    the range (inspector.session.limits.check_int / check_float); empty when every value may run."""
    state, found = st.session_state, []
    for name in names:
        key = widget_key(prefix, name)
        if key in state:
            _, _, lo, hi, _ = SAMPLER_WIDGETS[name]
            try:
                (check_int if name in _INT else check_float)(state[key], lo, hi, setting_name(name))
            except LimitError as e:
                found.append(str(e))
    return found


def sampling_params_from(prefix: str, fallback: SamplingParams | None = None) -> SamplingParams:
    """The SamplingParams the widgets of prefix hold (fallback's value for a widget not drawn).
    InputError names a setting outside its widget's range, or one the engine rejects; nothing is clamped."""
    problems = sampler_problems(prefix)
    if problems:
        raise InputError(problems[0])
    state, base = st.session_state, fallback or SamplingParams()
    values = {name: _value(name, state.get(widget_key(prefix, name), getattr(base, name))) for name in SAMPLER_WIDGETS}
    try:
        return SamplingParams(**values)
    except InputError as e:      # the engine's message ends with the whole SamplingParams(...): say the setting
        raise InputError(str(e).split("; got SamplingParams(")[0]) from None


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


# ---- values a browser sent -----------------------------------------------------------------------------
# A widget's bounds hold an honest browser only: a forged message can carry any value, and some Streamlit
# releases hand it to the script unchecked. Each value that reaches the engine (or indexes a run) is checked
# again on the server; a bad one gets one message naming the field and its range, and the page stops there,
# before any model work.
def checked(value, lo: int, hi: int, what: str) -> int:
    """A whole number within [lo, hi] (inspector.session.limits.check_int), else st.error and st.stop."""
    return _or_stop(check_int, value, lo, hi, what)


def checked_float(value, lo: float, hi: float, what: str) -> float:
    return _or_stop(check_float, value, lo, hi, what)


def checked_text(value, most: int, what: str) -> str:
    """Text of at most `most` characters (a short field: a glob, a token, a list of injections)."""
    return _or_stop(check_chars, value, most, what)


def _or_stop(check, *args):
    try:
        return check(*args)
    except LimitError as e:
        st.error(str(e))
        st.stop()


# ---- figures, layout, links --------------------------------------------------------------------------
def projector() -> bool:
    """Projector mode: big type, thick lines, high contrast, one chart per row."""
    return bool(st.session_state.get(PROJECTOR, False))


def chart(fig, key: str, **kwargs) -> None:
    """st.plotly_chart of the figure in the app's style (inspector.views.theme.styled): every colour drawn as
    itself under the chart theme, whole-number log axes, and the projector style when it is on."""
    st.plotly_chart(styled_once(fig, projector=projector()), key=key, **kwargs)


# st.dataframe draws its cells on a canvas (glide-data-grid) in a 13-px font that no CSS reaches; st.table is
# HTML, so in projector mode tables are drawn with it, in the charts' type (inspector.views.theme.PROJECTOR_FONT).
PROJECTOR_TABLE_CSS = f"""<style>
[data-testid="stMain"] [data-testid="stTable"] :is(th, td),
[data-testid="stMain"] [data-testid="stTable"] :is(th, td) :is(p, div, span) {{
  font-size: {PROJECTOR_FONT}px; line-height: 1.4; }}
</style>"""
PROJECTOR_ROWS = 15         # rows of a table on the projector; all of them in an expander below


def table(df, key: str, formats: dict[str, str] | None = None, labels: dict[str, str] | None = None,
          texts: tuple[str, ...] = ()) -> None:
    """A table of df without its index: st.dataframe with the columns' number formats ("%.3f", "localized")
    and labels; in projector mode an HTML table (st.table) in the projector's type, its first PROJECTOR_ROWS
    rows (the whole table in the usual grid in an expander below). texts: columns of raw text (tokens), shown
    on the projector as repr() so that a leading space or a newline stays visible."""
    formats, labels = formats or {}, labels or {}
    config = {c: st.column_config.NumberColumn(labels.get(c), format=formats[c]) for c in formats}
    config |= {c: st.column_config.Column(label) for c, label in labels.items() if c not in formats}
    if not projector():
        st.dataframe(df, hide_index=True, key=key, column_config=config or None)
        return
    st.html(PROJECTOR_TABLE_CSS)
    st.table(projector_styler(df.head(PROJECTOR_ROWS), formats, labels, texts), hide_index=True)
    if len(df) > PROJECTOR_ROWS:
        with st.expander(f"All {len(df):,} rows"):
            st.dataframe(df, hide_index=True, key=key, column_config=config or None)


def projector_styler(df, formats: dict[str, str], labels: dict[str, str], texts: tuple[str, ...] = ()):
    """df as st.table shows it on a projector: numbers in their formats (other floats to 4 decimals, missing
    values as "—"), text as the characters it is (st.table reads its cells as Markdown), columns labelled."""
    def fmt(f: str):    # "localized": whole numbers with thousands separators, as st.column_config shows them
        return lambda v: "—" if v is None or v != v else f"{v:,}" if f == "localized" else f % v

    def text(raw: bool):
        return lambda v: "—" if v is None else plain(repr(v) if raw else v)
    numbers = {c: fmt(formats.get(c, "%.4f")) for c in df.columns
               if c in formats or (df[c].dtype.kind == "f")}
    strings = {c: text(c in texts) for c in df.columns if df[c].dtype.kind == "O" and c not in numbers}
    return df.rename(columns=labels).style.format({labels.get(c, c): f for c, f in {**numbers, **strings}.items()})


def columns(spec, **kwargs) -> list:
    """st.columns(spec), or in projector mode as many full-width containers one below another: fewer,
    bigger charts per screen."""
    if projector():
        return [st.container() for _ in range(spec if isinstance(spec, int) else len(spec))]
    return st.columns(spec, **kwargs)


def page_path(name: str) -> str | None:
    """The script path of the app's page whose file is `name`.py (however the app lays its pages out)."""
    ctx = get_script_run_ctx()
    if ctx is None:
        return None
    for info in ctx.pages_manager.get_pages().values():
        if Path(info.get("script_path", "")).stem == name:
            return info["script_path"]
    return None


def metric_columns(n: int) -> list:
    """n columns for metrics in one row; in projector mode rows of three, so big numbers are never cut."""
    if not projector():
        return st.columns(n)
    return [c for row in range(0, n, 3) for c in st.columns(3)][:n]


def pages() -> list[dict]:
    """The app's registered pages in order: script_path, page_name (the title), icon."""
    ctx = get_script_run_ctx()
    return [] if ctx is None else list(ctx.pages_manager.get_pages().values())


def navigation_links(app_pages: list | None = None, n_columns: int = 2) -> None:
    """Every page of the app as a link, n_columns to a row (titles only: two fit a row of the sidebar): the
    app's navigation. st.navigation is hidden so that the prompt and Run come first in the sidebar, and no
    page hides behind a "more" menu as it would in a navigation bar across the top. app_pages: the st.Page
    objects app.py registered (a link to one costs no path lookups; by script path, each link resolves every
    page's path again: 14 pages, 196 lookups on every rerun of every session)."""
    links = ([(p, p.title) for p in app_pages] if app_pages else
             [(i["script_path"], i.get("page_name") or Path(i["script_path"]).stem) for i in pages()
              if i.get("script_path")])
    if len(links) < 2:
        return
    cols = st.columns(n_columns, gap="small")
    for i, (page, title) in enumerate(links):
        with cols[i % n_columns]:
            st.page_link(page, label=title, icon=None if isinstance(page, str) else "")   # titles only


def page_link(name: str, label: str, icon: str | None = None) -> None:
    """A link to another page (nothing when the page is not part of this app)."""
    path = page_path(name)
    if path is not None:
        st.page_link(path, label=label, icon=icon)


def switch_to(name: str) -> None:
    path = page_path(name)
    if path is not None:
        st.switch_page(path)
