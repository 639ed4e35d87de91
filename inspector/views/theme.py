"""Colours and styles every figure of the inspector shares: colour scales that survive the app's chart theme,
log axes labelled with whole numbers, and the projector style (big type, thick lines, high contrast).

Why colour scales are written out here: the app's plotly theme marks colours it will fill in later with the
placeholder strings "#000001" to "#000040" and the browser swaps every such string in a figure for a theme
colour. Magma's lowest colour is "#000004", so the lowest values of a Magma heatmap were drawn pink
(#ffabab) and looked high. Every scale here is an explicit [[position, colour], ...] list with no colour
that collides with a placeholder (a collision moves by one step of red: invisible, and left alone).
"""
from __future__ import annotations

import math
import re
from typing import Iterable

import plotly.colors as pc
import plotly.graph_objects as go

# Placeholder colours of the app's plotly theme (the browser replaces these strings wherever they appear).
PLACEHOLDERS = frozenset(f"#0000{i:02d}" for i in range(1, 41))
SEQUENTIAL, DIVERGING = "Viridis", "RdBu_r"
# High-contrast, colour-blind-safe (Okabe & Ito) colours for the projector; black first for the main line.
PROJECTOR_COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442")
PROJECTOR_FONT, PROJECTOR_TICKS, PROJECTOR_LINE = 20, 18, 4
BASE_TICKS = 12                       # no tick label smaller than this, projector or not
_HEX = re.compile(r"#[0-9a-fA-F]{6}")


def _hex(colour: str) -> str:
    if _HEX.fullmatch(colour):
        return colour.lower()
    r, g, b = (int(round(float(v))) for v in pc.unlabel_rgb(colour))
    return f"#{r:02x}{g:02x}{b:02x}"


def safe_colour(colour: str) -> str:
    """The colour, moved off the theme's placeholder strings ("#000004" -> "#010004")."""
    h = _hex(colour) if isinstance(colour, str) and (colour.startswith("#") or colour.startswith("rgb")) else colour
    return "#01" + h[3:] if h in PLACEHOLDERS else h


def colorscale(name: str = SEQUENTIAL) -> list[list]:
    """A named plotly scale ("Magma", "Viridis", "RdBu_r", ...) as an explicit list whose every colour,
    the lowest first of all, is drawn as itself under the app's theme."""
    return [[float(pos), safe_colour(c)] for pos, c in pc.get_colorscale(name)]


def placeholder_colours(fig: go.Figure | dict) -> list[str]:
    """Every colour string in the figure (a Figure or its JSON) that the app's theme would replace: should be
    none outside layout.template (the theme's own template is made of them)."""
    found: list[str] = []

    def walk(v) -> None:
        if isinstance(v, str):
            if v.lower() in PLACEHOLDERS:
                found.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
    spec = fig if isinstance(fig, dict) else fig.to_plotly_json()
    walk({**spec, "layout": {k: v for k, v in spec.get("layout", {}).items() if k != "template"}})
    return found


def robust_range(values: Iterable[float], q: float = 0.995) -> tuple[float, float]:
    """(low, high) of the finite values between quantiles 1 - q and q: a few extreme cells (an attention
    sink, a massive activation) no longer wash the rest of a heatmap into one colour."""
    import numpy as np
    v = np.asarray(list(values) if not hasattr(values, "__array__") else values, dtype=float).ravel()
    v = v[np.isfinite(v)]
    if not v.size:
        return 0.0, 1.0
    lo, hi = float(np.quantile(v, 1 - q)), float(np.quantile(v, q))
    return (lo, hi) if hi > lo else (float(v.min()), float(v.max()) if v.max() > v.min() else float(v.min()) + 1.0)


# ---- log axes ------------------------------------------------------------------------------------------
def log_ticks(lo: float, hi: float) -> tuple[list[float], list[str]]:
    """Tick values and labels for a log axis over [lo, hi]: 1-2-5 steps over up to four decades, else powers
    of ten only; every label is a whole number ("0.5", "5", "50"), never plotly's bare "5" or "2"."""
    lo, hi = max(lo, 1e-300), max(hi, lo)
    d0, d1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    mantissas = (1, 2, 5) if d1 - d0 <= 4 else (1,)
    vals = [m * 10.0 ** d for d in range(d0, d1 + 1) for m in mantissas if lo / 1.001 <= m * 10.0 ** d <= hi * 1.001]
    if len(vals) < 2:                                   # less than one step apart: the ends themselves
        vals = sorted({lo, hi})
    return vals, [_num(v) for v in vals]


def _num(v: float) -> str:
    if v == 0:
        return "0"
    if 1e-3 <= abs(v) < 1e6:
        return f"{v:.6g}"
    return f"{v:.0e}".replace("e-0", "e-").replace("e+0", "e").replace("e+", "e")


def _axis_values(fig: go.Figure, axis: str) -> list[float]:
    """The positive numbers the traces plot on a layout axis ('xaxis', 'yaxis2', ...)."""
    letter, ref = axis[0], axis[0] + axis[5:]
    out: list[float] = []
    for tr in fig.data:
        if (getattr(tr, f"{letter}axis", None) or letter) != ref or getattr(tr, letter, None) is None:
            continue
        for v in getattr(tr, letter):
            try:
                f = float(v)
            except (TypeError, ValueError):
                continue
            if math.isfinite(f) and f > 0:
                out.append(f)
    return out


def label_log_axes(fig: go.Figure, source: go.Figure | None = None) -> go.Figure:
    """Give every log axis explicit whole-number tick labels (see log_ticks), from the values the traces of
    `source` (default: fig itself) plot on it."""
    layout = fig.layout.to_plotly_json()
    for name, ax in layout.items():
        if re.fullmatch(r"[xy]axis\d*", name) and isinstance(ax, dict) and ax.get("type") == "log":
            vals = _axis_values(source or fig, name)
            if vals:
                tv, tt = log_ticks(min(vals), max(vals))
                fig.layout[name].update(tickmode="array", tickvals=tv, ticktext=tt)
    return fig


# ---- the style the app shows every figure in ------------------------------------------------------------
# Pale colours of the views that wash out on a projector, and what they become there.
PROJECTOR_DARKER = {"#c7d2e0": "#8a94a6", "#888": "#444444", "#888888": "#444444", "#6c8ebf": "#0072b2"}


def _recolour(v, mapping: dict[str, str]):
    """A copy of a figure's JSON with colour strings mapped (placeholders always moved off)."""
    if isinstance(v, str):
        low = v.lower()
        if low in mapping:
            return mapping[low]
        return "#01" + low[3:] if low in PLACEHOLDERS else v
    if isinstance(v, dict):
        return {k: _recolour(x, mapping) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_recolour(x, mapping) for x in v]
    return v


def styled(fig: go.Figure, *, projector: bool = False) -> go.Figure:
    """The figure as the app shows it (a new figure; the given one is left as it was): no colour the theme
    would replace, whole-number log axes, tick labels of at least BASE_TICKS px. With projector: type of
    PROJECTOR_FONT px (ticks PROJECTOR_TICKS), lines PROJECTOR_LINE px, markers bigger, the Okabe-Ito
    palette, pale colours darkened, and the figure a third taller (up to 1,200 px, never shorter than it was)."""
    spec = fig.to_plotly_json()
    template = spec.get("layout", {}).pop("template", None)   # the theme's own placeholders are meant to be there
    spec = _recolour(spec, PROJECTOR_DARKER if projector else {})
    if template is not None:
        spec["layout"]["template"] = template
    out = go.Figure(spec)
    label_log_axes(out, fig)           # the copy's arrays are packed; the original's are readable
    ticks = PROJECTOR_TICKS if projector else BASE_TICKS
    # every axis, the default pair too even when the figure never named them (the theme's ticks are 12 px)
    named = {k for k in out.layout.to_plotly_json() if re.fullmatch(r"[xy]axis\d*", k)}
    for name in sorted(named | {"xaxis", "yaxis"}):
        ax = out.layout[name]
        size = ax.tickfont.size if ax.tickfont and ax.tickfont.size else 0
        ax.update(tickfont=dict(size=max(size, ticks)))
        if projector:
            ax.update(title_font=dict(size=PROJECTOR_FONT + 2), automargin=True)
    if not projector:
        return out
    out.update_layout(font=dict(size=PROJECTOR_FONT), colorway=list(PROJECTOR_COLOURS),
                      legend=dict(font=dict(size=PROJECTOR_FONT)), title_font=dict(size=PROJECTOR_FONT + 4),
                      hoverlabel=dict(font_size=PROJECTOR_FONT))
    if out.layout.height:        # a third taller up to 1,200 px; never shorter (a figure of stacked panels)
        out.layout.height = max(out.layout.height, min(1200, int(out.layout.height * 1.35)))
    for tr in out.data:
        kind = tr.type
        if kind == "scatter":
            tr.update(line=dict(width=max(PROJECTOR_LINE, (tr.line.width or 0) if tr.line else 0)))
            if tr.marker is not None:
                tr.update(marker=dict(size=max(10, tr.marker.size or 0) if not isinstance(tr.marker.size, tuple)
                                      else tr.marker.size))
        if kind == "heatmap":
            tr.update(colorbar=dict(tickfont=dict(size=PROJECTOR_TICKS)))
            if tr.texttemplate:
                tr.update(textfont=dict(size=PROJECTOR_TICKS))
    for ann in out.layout.annotations or ():
        ann.update(font=dict(size=PROJECTOR_FONT))
    for shape in out.layout.shapes or ():
        if shape.type == "line":
            shape.update(line=dict(width=max(3, shape.line.width or 0)))
    return out

