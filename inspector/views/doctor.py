"""Tables and figures for the NaN/Inf doctor page.

Everything here reads what the engine recorded (probe statistics, a DoctorReport, a PrecisionReport); the
model is only run by the engine functions the page calls (engine.doctor.run_doctor, precision_compare).
"""
from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go

from engine import STAT_NAMES
from engine.doctor import FP16_MAX, PRESETS, NonFinite, stage_profile
from engine.stages import LAYER_STAGES

from .theme import colorscale

GLOBAL_STAGES = ("embed", "final_norm", "logits")
WEIGHTS = ("attn_norm.weight", "attn.wqkv", "attn.wo", "mlp_norm.weight", "mlp.w_gate_up", "mlp.w_down")


# ---- injections -------------------------------------------------------------------------------------
def target_choices() -> list[str]:
    """Stage and weight names (layer-relative) a custom injection can aim at."""
    return [*GLOBAL_STAGES[:1], *LAYER_STAGES, *GLOBAL_STAGES[1:], *(f"weight: {w}" for w in WEIGHTS)]


def injection_spec(kind: str, target: str, layer: int, position: int | None, factor: float = 1.0) -> str:
    """'nan', 'mlp.act', 17, 3 -> 'nan@blocks.17.mlp.act:3' (weights: position is the element index)."""
    name = target.removeprefix("weight: ")
    full = name if name in GLOBAL_STAGES else f"blocks.{layer}.{name}"
    head = f"scale={factor:g}" if kind == "scale" else kind
    return f"{head}@{full}" + ("" if position is None else f":{position}")


def preset_label(name: str) -> str:
    return f"{name} — {PRESETS[name].description}" if name in PRESETS else name


# ---- the first non-finite value -------------------------------------------------------------------
def nonfinite_headline(nf: NonFinite) -> str:
    what = ", ".join(f"{int(nf.stats[k])} {'NaN' if k == 'nan' else 'Inf'}" for k in ("nan", "inf") if nf.stats[k])
    where = "the prompt (prefill)" if nf.step == 0 else f"decode step {nf.step}"
    layer = "" if nf.layer is None else f", layer **{nf.layer}**"
    return (f"First non-finite value: stage **`{nf.stage}`**{layer}, position **{nf.position}**, step **{nf.step}** "
            f"({where}): {what} at that position.")


def profile_frame(probe, step: int, position: int) -> pd.DataFrame:
    """Every stage's statistics at one position of one step, forward order (the lead-up and what follows)."""
    df = pd.DataFrame(stage_profile(probe, step, position), columns=["step", "stage", "layer", *STAT_NAMES])
    df["order"] = range(len(df))
    df["finite"] = (df["nan"] + df["inf"]) == 0
    return df


def lead_up_frame(prof: pd.DataFrame, stage: str, before: int = 6, after: int = 2) -> pd.DataFrame:
    """The stages just before the first non-finite one, that stage, and a few after it (the order column
    dropped), with a "where" column pointing at the offending row. Short enough to show whole: the row
    that matters is never below the table's fold."""
    i = int(prof.index[prof["stage"] == stage][0])
    out = prof.iloc[max(0, i - before): i + after + 1].drop(columns=["order"]).copy()
    out.insert(0, "where", ["◀ first NaN/Inf" if s == stage else "" for s in out["stage"]])
    return out


def profile_figure(df: pd.DataFrame, first: str | None, *, fp16_line: bool = True) -> go.Figure:
    """Absmax per stage (log scale) at one position; non-finite stages drawn as red crosses at the top."""
    fin = df[df["finite"]]
    bad = df[~df["finite"]]
    top = max([float(fin["absmax"].max()) if len(fin) else 1.0, FP16_MAX if fp16_line else 1.0]) * 4
    fig = go.Figure()
    fig.add_scatter(x=fin["order"], y=fin["absmax"].clip(lower=1e-6), mode="lines+markers", name="absmax",
                    text=fin["stage"], hovertemplate="%{text}<br>absmax %{y:.4g}<extra></extra>")
    if len(bad):
        fig.add_scatter(x=bad["order"], y=[top] * len(bad), mode="markers", name="NaN / Inf",
                        marker=dict(symbol="x", color="red", size=9), text=bad["stage"],
                        hovertemplate="%{text}: non-finite<extra></extra>")
    if fp16_line:
        fig.add_hline(y=FP16_MAX, line_dash="dot", annotation_text="float16 max 65504")
    if first is not None and (df["stage"] == first).any():
        fig.add_vline(x=int(df.loc[df["stage"] == first, "order"].iloc[0]), line_color="red",
                      annotation_text=first)
    fig.update_layout(yaxis_type="log", xaxis_title="stage (forward order)", yaxis_title="|x| max at this position",
                      height=360, margin=dict(t=30, b=40))
    return fig


# ---- precision comparison -------------------------------------------------------------------------
def precision_frame(report) -> pd.DataFrame:
    df = pd.DataFrame(report.rows, columns=["stage", "layer", "stage_in_layer", "rel_err", "max_abs_err", "ref_absmax"])
    df["order"] = range(len(df))
    return df


def precision_figure(df: pd.DataFrame, threshold: float, divergence: dict | None) -> go.Figure:
    y = df["rel_err"].map(lambda v: v if math.isfinite(v) and v > 0 else (1e3 if not math.isfinite(v) else 1e-9))
    fig = go.Figure(go.Scatter(x=df["order"], y=y, mode="lines", text=df["stage"], name="relative error",
                               hovertemplate="%{text}<br>rel. error %{y:.3g}<extra></extra>"))
    fig.add_hline(y=threshold, line_dash="dot", annotation_text=f"threshold {threshold:.3g}")
    if divergence is not None:
        fig.add_vline(x=int(df.loc[df["stage"] == divergence["stage"], "order"].iloc[0]), line_color="red",
                      annotation_text=divergence["stage"])
    fig.update_layout(yaxis_type="log", xaxis_title="stage (forward order)", yaxis_title="‖low − fp32‖ / ‖fp32‖",
                      height=340, margin=dict(t=30, b=40))
    return fig


def precision_heatmap(df: pd.DataFrame) -> go.Figure:
    """Layers × stage-in-layer grid of relative errors (log10)."""
    blocks = df[df["layer"].notna()]
    grid = blocks.pivot_table(index="layer", columns="stage_in_layer", values="rel_err", aggfunc="first")
    grid = grid[[s for s in LAYER_STAGES if s in grid.columns]]
    z = grid.map(lambda v: math.log10(v) if v > 0 and math.isfinite(v) else (3.0 if v > 0 else -9.0))
    fig = go.Figure(go.Heatmap(z=z.values, x=list(grid.columns), y=[int(i) for i in grid.index],
                               colorscale=colorscale("Viridis"), colorbar=dict(title="log10 rel. err"),
                               customdata=grid.values,
                               hovertemplate="layer %{y} %{x}<br>%{customdata:.3g}<extra></extra>"))
    fig.update_layout(yaxis_title="layer", xaxis_title="stage within the layer", height=420, margin=dict(t=30, b=40),
                      yaxis_autorange="reversed")
    return fig
