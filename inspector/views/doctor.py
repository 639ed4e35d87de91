"""Tables and figures for the NaN/Inf doctor page.

Everything here reads what the engine recorded (probe statistics, a DoctorReport, a PrecisionReport); the
model is only run by the engine functions the page calls (engine.tools.doctor.run_doctor, precision_compare).
"""
from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go

from engine import STAT_NAMES, InputError
from engine.family.slots import SLOTS
from engine.inspection.nonfinite import FirstNonFinite, stage_profile
from engine.inspection.stages import GLOBAL_STAGES, LAYER_STAGES, global_stages, layer_stages
from engine.tools.doctor import FP16_MAX, PRESETS, Injection, is_weight

from .theme import colorscale

VALUE_STATS = ("min", "max", "mean", "std", "absmax")
WINDOW = 12        # stages shown each side of the first non-finite one: one readable column per stage
WEIGHTS = tuple(s.probe for s in SLOTS)    # every block weight a fault can be planted in (engine.family.slots)


# ---- injections -------------------------------------------------------------------------------------
def target_choices(cfg=None) -> list[str]:
    """Stage and weight names (layer-relative) a custom injection can aim at: with a model's config, those its
    family's layers have (engine.inspection.stages.layer_stages, its weight slots)."""
    if cfg is None:
        stages, weights = LAYER_STAGES, WEIGHTS
    else:
        have = {s for i in range(cfg.num_layers) for s in layer_stages(cfg, i)}
        stages = [s for s in LAYER_STAGES if s in have]
        slots = {f for i in range(cfg.num_layers) for f in cfg.family.slots(cfg.layer_moe[i], cfg.attention_bias)}
        weights = [s.probe for s in SLOTS if s.field in slots]
    before, after = global_stages(cfg)
    return [*before, *stages, *after, *(f"weight: {w}" for w in weights)]


def injection_spec(kind: str, target: str, layer: int, position: int | None, factor: float = 1.0) -> str:
    """'nan', 'mlp.act', 17, 3 -> 'nan@blocks.17.mlp.act:3' (weights: position is the element index)."""
    name = target.removeprefix("weight: ")
    full = name if name in GLOBAL_STAGES else f"blocks.{layer}.{name}"
    head = f"scale={factor:g}" if kind == "scale" else kind
    return f"{head}@{full}" + ("" if position is None else f":{position}")


def preset_label(name: str) -> str:
    return f"{name} — {PRESETS[name].description}" if name in PRESETS else name


# ---- the first non-finite value -------------------------------------------------------------------
def nonfinite_headline(nf: FirstNonFinite) -> str:
    what = ", ".join(f"{int(nf.stats[k])} {'NaN' if k == 'nan' else 'Inf'}" for k in ("nan", "inf") if nf.stats[k])
    where = "the prompt's prefill" if nf.step == 0 else f"decode step {nf.step}"
    layer = "" if nf.layer is None else f", layer **{nf.layer}**"
    return (f"First non-finite value: stage **`{nf.stage}`**{layer}, position **{nf.position}**, step **{nf.step}** "
            f"({where}): {what} at that position.")


def fault_outcome(specs, nf: FirstNonFinite | None, prof: pd.DataFrame | None, fp16: bool = False) -> str | None:
    """What a fault run found, said against what was planted: the first NaN/Inf can appear stages after the
    planted one (a ×4 activation that fits float16 whose down projection overflows), and the page must not
    suggest the planted stage itself went non-finite when it did not."""
    targets = []
    for s in specs if isinstance(specs, (list, tuple)) else ():     # a trace file's notes may hold anything
        try:
            targets.append(Injection.parse(s).target)
        except (InputError, AttributeError, TypeError):
            continue
    if nf is None or not targets:
        return None
    if nf.stage in targets:
        return f"The first NaN/Inf is at the planted stage `{nf.stage}` itself."
    stages = [] if prof is None else list(prof["stage"])
    planted = [t for t in targets if t in stages and stages.index(t) < stages.index(nf.stage)]
    if planted:
        row = prof[prof["stage"] == planted[-1]].iloc[0]
        later = stages.index(nf.stage) - stages.index(planted[-1])
        fits = f", below float16's largest value {FP16_MAX:,.0f}" if fp16 and row["absmax"] <= FP16_MAX else ""
        return (f"The fault was planted at `{planted[-1]}`, which stayed finite there (|x| max "
                f"{row['absmax']:,.0f}{fits}); the first NaN/Inf appeared {later} stage{'s' * (later != 1)} later, "
                f"at `{nf.stage}`.")
    weights = [t for t in targets if is_weight(t)]
    if weights:
        return f"The fault changed the weight `{weights[0]}`; the first NaN/Inf appeared at stage `{nf.stage}`."
    return f"The first NaN/Inf appeared at stage `{nf.stage}`, not at a planted stage ({', '.join(targets)})."


def profile_frame(recording, step: int, position: int) -> pd.DataFrame:
    """Every stage's statistics at one position of one step, forward order (the lead-up and what follows)."""
    df = pd.DataFrame(stage_profile(recording, step, position), columns=["step", "stage", "layer", *STAT_NAMES])
    df["order"] = range(len(df))
    df["finite"] = (df["nan"] + df["inf"]) == 0
    return df


def shown_value(v: float) -> str:
    """A statistic as a table shows it: NaN as NaN and Inf as Inf (not "None" or "Infinity")."""
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "Inf" if v > 0 else "-Inf"
    if v == 0:        # -0.0 too: a row of zeros (and a NaN) read "min −0, max −0", the sign of zero being arbitrary
        return "0"
    return f"{v:.4g}"


def lead_up_frame(prof: pd.DataFrame, stage: str, before: int = 6, after: int = 2) -> pd.DataFrame:
    """The stages just before the first non-finite one, that stage, and a few after it (the order column
    dropped), with a "where" column pointing at the offending row. Short enough to show whole: the row
    that matters is never below the table's fold. Statistics are text so that NaN reads NaN: the engine's
    min and max leave NaN out (a row of NaN only has min +Inf > max -Inf) and its mean and std cover finite
    values only, so such a row's value statistics are all NaN. The counts are whole numbers."""
    i = int(prof.index[prof["stage"] == stage][0])
    out = prof.iloc[max(0, i - before): i + after + 1].drop(columns=["order"]).copy()
    out.insert(0, "where", ["◀ first NaN/Inf" if s == stage else "" for s in out["stage"]])
    only_nan = ~(out["min"] <= out["max"])
    for col in VALUE_STATS:
        out[col] = [("NaN" if gone else shown_value(float(v))) for v, gone in zip(out[col], only_nan)]
    for col in ("nan", "inf"):
        out[col] = out[col].astype("int64")
    out["layer"] = ["—" if v is None or v != v else str(int(v)) for v in out["layer"]]
    return out


def short_stage(name: str) -> str:
    return name.removeprefix("blocks.")


def profile_figure(df: pd.DataFrame, first: str | None, *, fp16_line: bool = True) -> go.Figure:
    """Absmax per stage (log scale) at one position; stages holding a NaN drawn as red crosses, stages holding
    only Inf as orange triangles, each at the top. With many stages the x axis opens on the WINDOW stages
    each side of the first non-finite one, one labelled column per stage, so every marker downstream stands
    apart (the whole forward, 500 stages in 1,000 px, would merge them into one bar); double-click zooms out."""
    fin = df[df["finite"]]
    bad = df[~df["finite"]]
    top = max([float(fin["absmax"].max()) if len(fin) else 1.0, FP16_MAX if fp16_line else 1.0]) * 4
    fig = go.Figure()
    fig.add_scatter(x=fin["order"], y=fin["absmax"].clip(lower=1e-6), mode="lines+markers", name="absmax",
                    text=fin["stage"], hovertemplate="%{text}<br>absmax %{y:.4g}<extra></extra>")
    for part, name, symbol, color in ((bad[bad["nan"] > 0], "holds NaN", "x", "red"),
                                      (bad[bad["nan"] == 0], "holds Inf", "triangle-up", "darkorange")):
        if len(part):
            fig.add_scatter(x=part["order"], y=[top] * len(part), mode="markers", name=name,
                            marker=dict(symbol=symbol, color=color, size=11, line=dict(width=1, color="white")),
                            text=part["stage"], customdata=part[["nan", "inf"]].astype(int).values,
                            hovertemplate="%{text}: %{customdata[0]} NaN, %{customdata[1]} Inf<extra></extra>")
    if fp16_line:
        fig.add_hline(y=FP16_MAX, line_dash="dot", annotation_text="float16 max 65504")
    if first is not None and (df["stage"] == first).any():
        i = int(df.loc[df["stage"] == first, "order"].iloc[0])
        fig.add_vline(x=i, line_color="red", line_width=1, annotation_text=first)
        if len(df) > 2 * WINDOW + 1:
            lo, hi = max(0, i - WINDOW), min(len(df) - 1, i + WINDOW)
            fig.update_xaxes(range=[lo - 0.5, hi + 0.5], tickmode="array", tickvals=list(df["order"]),
                             ticktext=[short_stage(s) for s in df["stage"]], tickangle=-60)
    fig.update_layout(yaxis_type="log", xaxis_title="stage (forward order)", yaxis_title="|x| max at this position",
                      height=400, margin=dict(t=30, b=40))
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
