"""Tables and figures for the prescribing doctors: why a generation loops (engine.tools.why_loop), the fp32
rescue set (engine.tools.rescue) and quantization damage per stage (engine.tools.quant).

Pure: reports in, DataFrames and plotly Figures out. Every heatmap names its colorscale and its axes.
"""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from engine.inspection.stages import LAYER_STAGES
from engine.tools.quant import QuantReport
from engine.tools.rescue import RescueReport
from engine.tools.why_loop import WhyLoopReport

from .tokens import visible

GONE, DELAYED, KEPT, STOPPED = "#2ca02c", "#ff7f0e", "#d62728", "#8c8c8c"
OUTCOME_COLORS = {"loop gone": GONE, "loop delayed": DELAYED, "stopped": STOPPED, "loop kept": KEPT}
FORMAT_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
UNIT_PARTS = ("attn", "mlp", "resid")
# rescue map: 0 low precision, 1 fp32 through a resid unit of an earlier layer, 2 in the rescue set
RESCUE_COLORSCALE = [[0.0, "#eeeeee"], [0.33, "#eeeeee"], [0.34, "#f6c89f"], [0.66, "#f6c89f"],
                     [0.67, "#d62728"], [1.0, "#d62728"]]


# ---- why the loop ---------------------------------------------------------------------------------
CAUSE_COLUMNS = ["rank", "kind", "change", "outcome", "loop from step", "verdict", "tokens", "stopped",
                 "text after"]


def causes_frame(report: WhyLoopReport) -> pd.DataFrame:
    """One row per tested cause, in the report's order (loop-breaking first); the verdict is the report's own
    (engine.tools.loop_verdict), and "loop from step" where a kept or delayed loop starts in the rerun."""
    rows = [{"rank": i + 1, "kind": c.kind, "change": c.change, "outcome": c.outcome,
             "loop from step": None if c.loop is None else c.loop["start"], "verdict": c.verdict,
             "tokens": c.tokens, "stopped": c.stopped, "text after": visible(c.text_after)}
            for i, c in enumerate(report.causes)]
    return pd.DataFrame(rows, columns=CAUSE_COLUMNS).astype({"loop from step": "Int64"})


def causes_figure(report: WhyLoopReport) -> go.Figure:
    """Tokens each rerun generated before its loop showed (past the run's length, to the rerun horizon: the
    loop stayed away); green = loop gone, orange = delayed (it came back after the run's length), grey = stopped
    (end-of-text within the run's length, no loop: no fix), red = kept."""
    df = causes_frame(report).iloc[::-1]                   # plotly draws the first row at the bottom
    fig = go.Figure(go.Bar(x=df["tokens"], y=[f"{k}: {c}" for k, c in zip(df["kind"], df["change"])],
                           orientation="h",
                           marker_color=[OUTCOME_COLORS[o] for o in df["outcome"]],
                           customdata=df["text after"],
                           hovertemplate="%{y}<br>%{x} tokens<br>%{customdata}<extra></extra>"))
    fig.add_vline(x=report.horizon, line_dash="dash", line_color="#555",
                  annotation_text=f"your run's {report.horizon}")
    fig.add_vline(x=report.rerun_horizon, line_dash="dot", line_color="#555",
                  annotation_text=f"rerun horizon {report.rerun_horizon}", annotation_position="bottom right")
    fig.update_layout(xaxis_title="tokens generated (before the loop showed, or the text ended; past your run's "
                                  "length with no loop: loop gone)",
                      yaxis_title="change tried", height=max(260, 28 * len(df) + 120), margin=dict(t=30, b=50),
                      showlegend=False)
    return fig


def copy_heads_frame(report: WhyLoopReport) -> pd.DataFrame:
    return pd.DataFrame([{"rank": i + 1, "layer": h["layer"], "head": h["head"], "mass → copy": h["mass"]}
                         for i, h in enumerate(report.copy_heads)], columns=["rank", "layer", "head", "mass → copy"])


# ---- fp32 rescue ----------------------------------------------------------------------------------
TRIAL_COLUMNS = ["rerun", "plan", "units in fp32", "finite", "first non-finite", "top-1 agreement",
                 "logit rel. error"]


def rescue_trials_frame(report: RescueReport) -> pd.DataFrame:
    rows = [{"rerun": i + 1, "plan": t.label, "units in fp32": len(t.units), "finite": t.finite,
             "first non-finite": t.first_nonfinite or "", "top-1 agreement": t.top1_agreement,
             "logit rel. error": t.logit_rel_err} for i, t in enumerate(report.trials)]
    return pd.DataFrame(rows, columns=TRIAL_COLUMNS)


def rescue_grid(units: list[str] | None, num_layers: int) -> pd.DataFrame:
    """layers × (attn, mlp, resid): 2 in the set, 1 fp32 because an earlier layer's resid unit keeps the
    stream in fp32 from there on, 0 low precision. Two extra rows: final_norm and logits (attn column)."""
    chosen = set(units or [])
    resid_from = min((int(u.split(".")[1]) for u in chosen if u.endswith(".resid")), default=None)
    rows = []
    for i in range(num_layers):
        row = {part: 2 if f"blocks.{i}.{part}" in chosen else 0 for part in UNIT_PARTS}
        if row["resid"] == 0 and resid_from is not None and i > resid_from:
            row["resid"] = 1
        rows.append({"row": f"layer {i}", **row})
    for name in ("final_norm", "logits"):
        rows.append({"row": name, "attn": 2 if name in chosen else 0, "mlp": None, "resid": None})
    return pd.DataFrame(rows, columns=["row", *UNIT_PARTS]).set_index("row")


def rescue_figure(report: RescueReport, num_layers: int) -> go.Figure:
    """Where the rescue set sits: red = in fp32 (the set), orange = stream in fp32 through an earlier resid
    unit, grey = the low dtype."""
    grid = rescue_grid(report.fp32, num_layers)
    labels = {0: report.dtype, 1: "fp32 (stream kept from an earlier layer)", 2: "fp32 (in the set)"}
    text = [[labels.get(v, "") if v == v and v is not None else "" for v in row] for row in grid.values.tolist()]
    fig = go.Figure(go.Heatmap(z=grid.values, x=["attn", "mlp", "resid (stream from here on)"], y=list(grid.index),
                               colorscale=RESCUE_COLORSCALE, zmin=0, zmax=2, showscale=False, xgap=2, ygap=1,
                               customdata=text, hovertemplate="%{y} · %{x}<br>%{customdata}<extra></extra>"))
    fig.update_layout(xaxis_title="unit", yaxis_title="layer (final_norm and logits below)",
                      yaxis_autorange="reversed", height=max(320, 14 * len(grid) + 100), margin=dict(t=30, b=50))
    return fig


# ---- quantization ---------------------------------------------------------------------------------
SUMMARY_COLUMNS = ["format", "KL mean (nats)", "same top token", "first layer over", "logits rel. error"]


def quant_summary_frame(report: QuantReport) -> pd.DataFrame:
    rows = [{"format": r.format, "KL mean (nats)": r.kld_mean, "same top token": r.same_top,
             "first layer over": r.first_layer_over,
             "logits rel. error": next((x["rel_err"] for x in r.per_stage if x["stage"] == "logits"), None)}
            for r in report.formats]
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS).astype({"first layer over": "Int64"})   # empty: never


def quant_stage_frame(report: QuantReport) -> pd.DataFrame:
    """Long table: format, stage, layer, stage_in_layer, rel_err (forward order within each format)."""
    return pd.DataFrame([{"format": r.format, **row} for r in report.formats for row in r.per_stage],
                        columns=["format", "stage", "layer", "stage_in_layer", "rel_err"])


def quant_layers_figure(report: QuantReport, stage: str = "resid_post", *, log_y: bool = False) -> go.Figure:
    """The picture for a class: one line per format, the relative error of one stage (by default the
    residual stream after each block) layer by layer, with the threshold as a dashed line."""
    df = quant_stage_frame(report)
    df = df[df["stage_in_layer"] == stage]
    fig = go.Figure()
    for k, r in enumerate(report.formats):
        part = df[df["format"] == r.format]
        y = part["rel_err"].clip(lower=1e-9) if log_y else part["rel_err"]   # an exact 0 has no log
        fig.add_scatter(x=part["layer"], y=y, mode="lines+markers", name=r.format,
                        line_color=FORMAT_COLORS[k % len(FORMAT_COLORS)],
                        hovertemplate=f"{r.format} layer %{{x}}<br>rel. error %{{y:.4g}}<extra></extra>")
    fig.add_hline(y=report.threshold, line_dash="dash", line_color="#555",
                  annotation_text=f"threshold {report.threshold:g}")
    fig.update_layout(xaxis_title="layer", yaxis_title=f"relative error of {stage} vs float32",
                      yaxis_type="log" if log_y else "linear", height=420, margin=dict(t=30, b=50),
                      legend_title_text="format")
    return fig


def quant_heatmap(report: QuantReport, fmt: str) -> go.Figure:
    """One format: stage within the block (rows, forward order) × layer, relative error."""
    df = quant_stage_frame(report)
    df = df[(df["format"] == fmt.upper()) & df["layer"].notna()]
    order = [s for s in LAYER_STAGES if s in set(df["stage_in_layer"])]
    grid = df.pivot_table(index="stage_in_layer", columns="layer", values="rel_err").reindex(order)
    fig = go.Figure(go.Heatmap(z=grid.values, x=[int(c) for c in grid.columns], y=order, colorscale="Viridis",
                               zmin=0, colorbar=dict(title="rel. error"),
                               hovertemplate="layer %{x} · %{y}<br>rel. error %{z:.4g}<extra></extra>"))
    fig.update_layout(xaxis_title="layer", yaxis_title="stage within the block", yaxis_autorange="reversed",
                      height=460, margin=dict(t=30, b=50))
    return fig


def quant_steps_frame(report: QuantReport) -> pd.DataFrame:
    return pd.DataFrame([{"format": r.format, "step": i, "KL (nats)": k, "same top": m}
                         for r in report.formats for i, (k, m) in enumerate(zip(r.kld, r.top_match))],
                        columns=["format", "step", "KL (nats)", "same top"])


def quant_steps_figure(report: QuantReport) -> go.Figure:
    """KL(p_fp32 || p_quant) per generated step, one line per format; a cross where the top token differs."""
    df = quant_steps_frame(report)
    fig = go.Figure()
    for k, r in enumerate(report.formats):
        part = df[df["format"] == r.format]
        color = FORMAT_COLORS[k % len(FORMAT_COLORS)]
        fig.add_scatter(x=part["step"], y=part["KL (nats)"], mode="lines", name=r.format, line_color=color)
        miss = part[~part["same top"]]
        fig.add_scatter(x=miss["step"], y=miss["KL (nats)"], mode="markers", marker_symbol="x", marker_size=9,
                        marker_color=color, name=f"{r.format}: top token differs", showlegend=not miss.empty)
    fig.update_layout(xaxis_title="generated step", yaxis_title="KL divergence from float32 (nats)", height=360,
                      margin=dict(t=30, b=50), legend_title_text="format")
    return fig
