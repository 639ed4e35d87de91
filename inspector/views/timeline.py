"""Where a run's time went: tokenize, prefill, each decode step (forward, sample, detokenize), and per layer.

Step-level times come from GenerationResult.timings and Step.seconds (time.perf_counter around each phase;
the forward's time includes copying the logits to the CPU, so on a GPU it is synchronised too). Per-layer
times come from the probe's marks: on the CPU a clock read after each stage (ops run synchronously; a decode
step in the native call reads its own clock after each layer), on a GPU CUDA events recorded on the stream and
read after the call synchronises.
"""
from __future__ import annotations

import re

import pandas as pd
import plotly.graph_objects as go

from .theme import colorscale

PHASES = ("tokenize", "forward", "sample", "detokenize")
COLOURS = {"tokenize": "#8c6bb1", "forward": "#3b6fb6", "sample": "#e4572e", "detokenize": "#59a14f"}
_BLOCK = re.compile(r"blocks\.(\d+)")


def timing_note(device_type: str) -> str:
    if device_type == "cuda":
        return ("Per-layer times are CUDA events recorded on the GPU stream and read after each call "
                "synchronises; step times are host clocks around calls that end in a synchronising copy.")
    return ("Per-layer times are host clocks read when each layer finished: time.perf_counter after each stage "
            "of the prefill (CPU ops run synchronously), and inside the native decode step (one call per token, "
            "engine/native) its own wall clock after the embedding, each layer and the logits. GPU runs use CUDA "
            "events instead.")


def step_table(result) -> pd.DataFrame:
    """One row per step: what it was, the token it chose, and its forward / sample / detokenize times."""
    rows = [(s.index, "prefill" if s.index == 0 else "decode", s.position, s.token_id, s.text,
             *(1e3 * s.seconds.get(k, 0.0) for k in PHASES[1:])) for s in result.steps]
    df = pd.DataFrame(rows, columns=["step", "kind", "positions_after", "token_id", "text",
                                     "forward_ms", "sample_ms", "detokenize_ms"])
    df["total_ms"] = df["forward_ms"] + df["sample_ms"] + df["detokenize_ms"]
    return df


def phase_table(result) -> pd.DataFrame:
    """Every timed phase in order, laid end to end from the start of the run (a Gantt chart's rows)."""
    rows, t = [], 0.0
    tok = 1e3 * result.timings.get("tokenize", 0.0)
    rows.append((-1, "tokenize", "tokenize", t, tok))
    t += tok
    for s in result.steps:
        for phase in PHASES[1:]:
            ms = 1e3 * s.seconds.get(phase, 0.0)
            name = "prefill" if (s.index == 0 and phase == "forward") else phase
            rows.append((s.index, phase, f"step {s.index} {name}", t, ms))
            t += ms
    return pd.DataFrame(rows, columns=["step", "phase", "label", "start_ms", "ms"])


def totals_table(result) -> pd.DataFrame:
    """Total time by phase, with prefill and decode forwards apart."""
    steps = step_table(result)
    rows = [("tokenize", 1e3 * result.timings.get("tokenize", 0.0)),
            ("prefill (forward, step 0)", float(steps.loc[steps["step"] == 0, "forward_ms"].sum())),
            ("decode (forward, steps ≥ 1)", float(steps.loc[steps["step"] > 0, "forward_ms"].sum())),
            ("sample", float(steps["sample_ms"].sum())),
            ("detokenize", float(steps["detokenize_ms"].sum()))]
    df = pd.DataFrame(rows, columns=["phase", "ms"])
    df["share_pct"] = 100 * df["ms"] / max(df["ms"].sum(), 1e-12)
    return df


def gantt_figure(phases: pd.DataFrame) -> go.Figure:
    """Each phase a horizontal bar from where it started to where it ended; one row per step."""
    fig = go.Figure()
    y = ["tokenize" if s < 0 else f"step {s}" for s in phases["step"]]
    phases = phases.assign(row=y)
    for phase in PHASES:
        d = phases[phases["phase"] == phase]
        if len(d):
            fig.add_trace(go.Bar(y=d["row"], x=d["ms"], base=d["start_ms"], orientation="h", name=phase,
                                 marker_color=COLOURS[phase], customdata=d["label"],
                                 hovertemplate="%{customdata}<br>%{x:.2f} ms<extra></extra>"))
    fig.update_layout(barmode="overlay", xaxis_title="ms since the run began", height=max(260, 22 * len(set(y)) + 80),
                      yaxis=dict(autorange="reversed", categoryorder="array", categoryarray=list(dict.fromkeys(y))),
                      margin=dict(t=30, b=40), legend=dict(orientation="h", y=1.08))
    return fig


def stacked_figure(steps: pd.DataFrame, log_y: bool = False) -> go.Figure:
    """Per step, forward + sample + detokenize stacked."""
    fig = go.Figure([go.Bar(x=steps["step"], y=steps[f"{p}_ms"], name=p, marker_color=COLOURS[p])
                     for p in PHASES[1:]])
    fig.update_layout(barmode="stack", xaxis_title="step (0 = prefill)", yaxis_title="ms", height=320,
                      yaxis_type="log" if log_y else "linear", margin=dict(t=30, b=40),
                      legend=dict(orientation="h", y=1.1))
    return fig


def layer_durations(marks: list[tuple[int, str, float]]) -> pd.DataFrame:
    """Per (step, stage) durations from probe marks (step, label, seconds since that call began).

    A 'start' mark opens each call (the sampler and detokenizer calls too, which have no other marks);
    within a call a stage's duration is its mark minus the previous one: 'embed', 'blocks.{i}' (layer i),
    'logits' (final norm + lm_head). Several forward calls in one step are summed."""
    rows, prev = [], None
    for step, label, t in marks:
        if label == "start":
            prev = (step, t)
            continue
        if prev is None or prev[0] != step:
            raise ValueError(f"mark {label!r} at step {step} has no 'start' mark before it in its call")
        m = _BLOCK.fullmatch(label)
        rows.append((step, label, int(m.group(1)) if m else None, t - prev[1]))
        prev = (step, t)
    df = pd.DataFrame(rows, columns=["step", "stage", "layer", "seconds"])
    df = df.groupby(["step", "stage"], sort=False, as_index=False).agg(layer=("layer", "first"),
                                                                       seconds=("seconds", "sum"))
    df["layer"] = df["layer"].astype("Int64")
    df["ms"] = 1e3 * df["seconds"]
    return df


def layer_matrix(durations: pd.DataFrame) -> pd.DataFrame:
    """step × layer milliseconds (layers only)."""
    d = durations.dropna(subset=["layer"])
    return d.pivot(index="step", columns="layer", values="ms").sort_index()


def layer_heatmap(durations: pd.DataFrame, include_prefill: bool = True) -> go.Figure:
    """step × layer ms. The prefill (many positions) can wash out the decode steps' colours: leave it out."""
    m = layer_matrix(durations)
    if not include_prefill and len(m) > 1:
        m = m.drop(index=0, errors="ignore")
    fig = go.Figure(go.Heatmap(z=m.values, x=[int(c) for c in m.columns], y=[int(i) for i in m.index],
                               colorscale=colorscale("Viridis"), colorbar=dict(title="ms"),
                               hovertemplate="step %{y} · layer %{x}<br>%{z:.3f} ms<extra></extra>"))
    fig.update_layout(xaxis_title="layer", yaxis_title="step (0 = prefill)", yaxis_autorange="reversed",
                      height=max(300, min(900, 14 * len(m) + 120)), margin=dict(t=30, b=40))
    return fig


def stage_means(durations: pd.DataFrame) -> pd.DataFrame:
    """Per stage (embed, each layer, logits): prefill ms and mean ms over the decode steps."""
    order = list(dict.fromkeys(durations["stage"]))
    pre = durations[durations["step"] == 0].groupby("stage")["ms"].sum()
    dec = durations[durations["step"] > 0].groupby("stage")["ms"].mean()
    df = pd.DataFrame({"stage": order})
    df["prefill_ms"] = df["stage"].map(pre)
    df["decode_mean_ms"] = df["stage"].map(dec)
    return df


def stage_means_figure(means: pd.DataFrame) -> go.Figure:
    fig = go.Figure([go.Bar(x=means["stage"], y=means["decode_mean_ms"], name="decode (mean per step)",
                            marker_color=COLOURS["forward"]),
                     go.Bar(x=means["stage"], y=means["prefill_ms"], name="prefill", marker_color="#c7d2e0")])
    fig.update_layout(barmode="group", yaxis_title="ms", height=320, margin=dict(t=30, b=60),
                      legend=dict(orientation="h", y=1.1))
    return fig
