"""A GGUF file as stored against its dequantised self (engine.tools.quant_stored.StoredReport) as tables and figures:
every stage's difference over the run and at each generated step, and the next-token distributions step by step."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from engine.tools.quant_stored import StoredReport

FLOOR = 1e-12          # an exact 0 has no logarithm: drawn at this floor (the tables keep the 0)


def stored_stage_frame(report: StoredReport) -> pd.DataFrame:
    """One row per stage, forward order: max |Δ| and relative L2 over the run, whether it is over the tolerance,
    and the generated step where its relative L2 is largest."""
    rows = []
    for order, r in enumerate(report.per_stage):
        steps = r["rel_l2_steps"]
        worst = max(range(len(steps)), key=steps.__getitem__) if steps else None
        rows.append({"order": order, "stage": r["stage"], "layer": r["layer"], "max_abs_diff": r["max_abs"],
                     "rel_l2": r["rel_l2"], "over_tolerance": r["over"], "worst_step": worst})
    return pd.DataFrame(rows, columns=["order", "stage", "layer", "max_abs_diff", "rel_l2", "over_tolerance",
                                       "worst_step"])


def stored_steps_frame(report: StoredReport) -> pd.DataFrame:
    """One row per generated step: KL(p_dequantised || p_stored), the same top token, the logits' max |Δ|."""
    return pd.DataFrame([{"step": s["step"], "KL (nats)": s["kl"], "same top": s["same_top"],
                          "logits max |Δ|": s["logits_max_abs"]} for s in report.per_step],
                        columns=["step", "KL (nats)", "same top", "logits max |Δ|"])


def stored_stage_figure(report: StoredReport) -> go.Figure:
    """Every stage in forward order: relative L2 and max |Δ| (log axis), the tolerance dashed."""
    df = stored_stage_frame(report)
    fig = go.Figure()
    for col, name, color in (("rel_l2", "relative L2", "#1f77b4"), ("max_abs_diff", "max |Δ|", "#ff7f0e")):
        fig.add_scatter(x=df["order"], y=df[col].clip(lower=FLOOR), mode="lines", name=name, line_color=color,
                        customdata=df[["stage", col]].values,
                        hovertemplate="%{customdata[0]}<br>" + name + " %{customdata[1]:.3g}<extra></extra>")
    fig.add_hline(y=report.tolerance, line_dash="dash", line_color="#555",
                  annotation_text=f"tolerance {report.tolerance:g} (relative L2)")
    fig.update_layout(xaxis_title="stage (forward order: embed … logits)", yaxis_title="stored vs dequantised",
                      yaxis_type="log", height=400, margin=dict(t=30, b=50))
    return fig


def stored_steps_heatmap(report: StoredReport) -> go.Figure:
    """Relative L2 of every stage (rows, forward order) at every generated step's position (columns)."""
    rows = [r for r in report.per_stage if r["rel_l2_steps"]]
    fig = go.Figure(go.Heatmap(z=[[max(v, FLOOR) for v in r["rel_l2_steps"]] for r in rows],
                               x=list(range(report.steps)), y=[r["stage"] for r in rows], colorscale="Viridis",
                               colorbar=dict(title="rel. L2"),
                               hovertemplate="step %{x} · %{y}<br>relative L2 %{z:.3g}<extra></extra>"))
    fig.update_layout(xaxis_title="generated step", yaxis_title="stage", yaxis_autorange="reversed",
                      yaxis_showticklabels=len(rows) <= 60, height=460, margin=dict(t=30, b=50))
    return fig
