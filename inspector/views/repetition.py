"""The repetition doctor's tables and figures: loops in the generated tokens (engine.inspection.loops), the text with
each repeat highlighted, probability and entropy per step, attention from looping tokens to their earlier
copy, and the same prompt and seed under repetition penalties side by side.

Loop indices are generation steps: token i of the generated text sits at absolute position n_prompt + i.
"""
from __future__ import annotations

import dataclasses
import html
from dataclasses import dataclass
from typing import Callable, Sequence

import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from engine import Probe
from engine.generate import generate
from engine.inspection.loops import Loop, find_loops, has_loop, repeats, tail_loop
from engine.progress import STOP, LayerProgress, OnProgress, tell_units
from engine.tools.loop_verdict import judge, rerun_horizon

from .theme import colorscale
from .tokens import visible

LOOP_COLORS = (("#fde2e4", "#f9c0c7"), ("#dfe7fd", "#b9c9f7"), ("#d7f0d2", "#b0e0a6"), ("#fff1c1", "#ffe08a"))
NEUTRAL = dict(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, no_repeat_ngram=0)
PENALTY_VARIANTS: dict[str, dict] = {
    "repetition penalty 1.3": dict(repetition_penalty=1.3),
    "frequency penalty 0.5": dict(frequency_penalty=0.5),
    "frequency penalty 1.0": dict(frequency_penalty=1.0),
    "presence penalty 1.0": dict(presence_penalty=1.0),
    "no-repeat 3-gram": dict(no_repeat_ngram=3),
}


def loops_frame(loops: Sequence[Loop], steps, n_prompt: int) -> pd.DataFrame:
    """One row per loop: start, period, count, end (generation steps), absolute positions, one period's text."""
    rows = [{"start": lp.start, "period": lp.period, "count": lp.count, "end": lp.end,
             "positions": f"{n_prompt + lp.start}–{n_prompt + lp.end - 1}",
             "repeated text": visible("".join(s.text for s in steps[lp.start:lp.start + lp.period]))}
            for lp in loops]
    return pd.DataFrame(rows, columns=["start", "period", "count", "end", "positions", "repeated text"])


def highlight_html(steps, loops: Sequence[Loop]) -> str:
    """The generated text, one span per token; tokens in a loop are coloured (two shades alternate per repeat,
    one hue per loop) and titled with their loop and repeat. Every piece of text is HTML-escaped."""
    where: dict[int, tuple[int, int]] = {}
    for k, lp in enumerate(loops):
        for r, (a, b) in enumerate(repeats(lp)):
            for i in range(a, b):
                where.setdefault(i, (k, r))
    out = ['<div style="font-family:monospace;line-height:1.9;white-space:pre-wrap;word-break:break-all">']
    for i, s in enumerate(steps):
        text = html.escape(s.text.replace("\n", "⏎\n"), quote=True)
        if i in where:
            k, r = where[i]
            lp = loops[k]
            color = LOOP_COLORS[k % len(LOOP_COLORS)][r % 2]
            tip = html.escape(f"step {i} · loop {k + 1} (start {lp.start}, period {lp.period}) · repeat {r + 1}",
                              quote=True)
            out.append(f'<span class="loop" title="{tip}" style="background:{color};border-radius:3px">{text}</span>')
        else:
            out.append(f"<span>{text}</span>")
    out.append("</div>")
    return "".join(out)


def curves_frame(steps) -> pd.DataFrame:
    return pd.DataFrame([{"step": s.index, "token": visible(s.text), "prob": s.prob, "model_prob": s.model_prob,
                          "entropy": s.entropy} for s in steps],
                        columns=["step", "token", "prob", "model_prob", "entropy"])


def curves_figure(df: pd.DataFrame, loops: Sequence[Loop]) -> go.Figure:
    """Chosen token's probability (sampling and raw model) and the raw entropy per step; loops shaded."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("chosen token's probability", "entropy (nats)"))
    fig.add_scatter(x=df["step"], y=df["model_prob"], name="model prob", mode="lines+markers", text=df["token"],
                    row=1, col=1)
    fig.add_scatter(x=df["step"], y=df["prob"], name="sampling prob", mode="lines", line_dash="dot", row=1, col=1)
    fig.add_scatter(x=df["step"], y=df["entropy"], name="entropy", mode="lines+markers", row=2, col=1)
    for k, lp in enumerate(loops):
        fig.add_vrect(x0=lp.start - 0.5, x1=lp.end - 0.5, fillcolor=LOOP_COLORS[k % len(LOOP_COLORS)][1],
                      opacity=0.35, line_width=0, annotation_text=f"loop {k + 1}", row="all", col=1)
    fig.update_layout(height=480, margin=dict(t=40, b=40), xaxis2_title="step")
    return fig


@dataclass
class CopyAttention:
    queries: list[int]        # absolute positions of looping tokens (from the second repeat on)
    copies: list[int]         # absolute position of each one's earlier copy (query - period)
    to_copy: torch.Tensor     # (layers, heads, Q) attention weight from query to its copy
    to_next: torch.Tensor     # (layers, heads, Q) ... to the token after the copy (what an induction head reads)


def copy_attention(model, ids: Sequence[int], n_prompt: int, loop: Loop, *, on_progress=None) -> CopyAttention:
    """One forward over ids; each layer's pattern is read at (looping token, earlier copy) and dropped.
    on_progress(engine.progress.Progress) hears each block finish (engine.progress)."""
    ids = [int(i) for i in ids]
    queries = [n_prompt + i for i in range(loop.start + loop.period, loop.end) if n_prompt + i < len(ids)]
    copies = [q - loop.period for q in queries]
    L, H = model.config.num_layers, model.config.num_heads
    to_copy, to_next = torch.zeros(L, H, len(queries)), torch.zeros(L, H, len(queries))
    qi, ci = torch.tensor(queries, dtype=torch.long), torch.tensor(copies, dtype=torch.long)

    def grab(x: torch.Tensor, ctx) -> None:                      # x (H, T, S); reads, never replaces
        to_copy[ctx.layer] = x[:, qi, ci].float().cpu()
        to_next[ctx.layer] = x[:, qi, ci + 1].float().cpu()
    if queries:
        probe = Probe().replace("blocks.*.attn.pattern", grab)
        T, tell = len(ids), LayerProgress(on_progress, len(ids), L)
        model.forward(torch.tensor(ids), model.new_cache(T), probe, last_only=True, on_layer=tell.on_layer(0, T))
        tell.chunk_done(0, T)
    return CopyAttention(queries, copies, to_copy, to_next)


def copy_attention_figure(ca: CopyAttention, which: str = "to_copy") -> go.Figure:
    """Layers × heads: mean weight over the looping tokens. The colours run from 0 to the largest mean (a
    head that copies stands out even when no head puts all its weight there)."""
    z = getattr(ca, which).mean(-1).numpy()
    top = max(float(z.max()) if z.size else 0.0, 1e-6)
    fig = go.Figure(go.Heatmap(z=z, x=[f"h{h}" for h in range(z.shape[1])], y=list(range(z.shape[0])),
                               colorscale=colorscale("Magma"), zmin=0, zmax=top, colorbar=dict(title="weight"),
                               hovertemplate="layer %{y} %{x}<br>mean weight %{z:.3f}<extra></extra>"))
    fig.update_layout(yaxis_title="layer", xaxis_title="head", height=460, margin=dict(t=30, b=40),
                      yaxis_autorange="reversed")
    return fig


def copy_attention_table(ca: CopyAttention, labels: Sequence[str]) -> pd.DataFrame:
    """Per looping token: its copy, the (layer, head) attending most to the copy and to the token after it."""
    rows = []
    H = ca.to_copy.shape[1]
    for j, (q, c) in enumerate(zip(ca.queries, ca.copies)):
        a, b = ca.to_copy[:, :, j], ca.to_next[:, :, j]
        ia, ib = int(a.argmax()), int(b.argmax())
        rows.append({"position": q, "token": labels[q], "copy": c, "best → copy": f"L{ia // H} h{ia % H}",
                     "weight → copy": float(a.max()), "mean → copy": float(a.mean()),
                     "best → after copy": f"L{ib // H} h{ib % H}", "weight → after copy": float(b.max()),
                     "uniform": 1.0 / (q + 1)})
    return pd.DataFrame(rows, columns=["position", "token", "copy", "best → copy", "weight → copy", "mean → copy",
                                       "best → after copy", "weight → after copy", "uniform"])


def comparison_horizon(n_new: int, token_ids: Sequence[int] | None) -> int:
    """Tokens each setting's generation may run to: past the run's n_new by twice its loop's span
    (engine.tools.loop_verdict.rerun_horizon), or n_new when the run (token_ids) ends in no loop or is not given."""
    loop = None if token_ids is None else tail_loop(token_ids)
    return n_new if loop is None else rerun_horizon(n_new, loop)


def compare_penalties(model, settings, variants: dict[str, dict] | None = None, *,
                      baseline: tuple[Sequence[int], str] | None = None, on_progress: OnProgress | None = None,
                      on_text: Callable[[str, str], None] | None = None) -> pd.DataFrame:
    """The run's prompt, seed and sampling settings with each penalty setting alone (others neutral).

    settings: an engine.RunSettings; baseline: the run's own (token_ids, text), shown first as "as run". Each
    setting is judged as the why-loop judges its reruns (engine.tools.loop_verdict, the one verdict): when the run
    ends in a loop, each generation runs past the run's length by twice the loop's span (stopping once it ends in a
    loop), and the setting breaks the loop only when the verdict is "loop gone" (a loop that comes back after the
    run's length is "loop delayed"). on_progress (engine.progress): a unit per token of each setting's generation
    (at most that horizon each), told before each generation and after each token; a STOP answer raises
    engine.progress.Stopped there (no table). on_text(label, text so far) after each token (the live text)."""
    variants = PENALTY_VARIANTS if variants is None else variants
    n_new = settings.max_new_tokens
    horizon = comparison_horizon(n_new, None if baseline is None else baseline[0])
    total = len(variants) * horizon
    rows = [] if baseline is None else [variant_row("as run", *baseline, "max_new_tokens", n_new)]
    for n, (label, overrides) in enumerate(variants.items()):
        tell_units(on_progress, n * n_new, total, f"{label} ({n + 1} of {len(variants)})")
        s = dataclasses.replace(settings, params=dataclasses.replace(settings.params, **{**NEUTRAL, **overrides}))
        pieces: list[str] = []
        ids: list[int] = []

        def token(step, label=label, n=n, pieces=pieces, ids=ids):
            pieces.append(step.text)
            ids.append(step.token_id)
            if on_text is not None:
                on_text(label, "".join(pieces))
            tell_units(on_progress, n * horizon + step.index + 1, total,
                       f"{label} ({n + 1} of {len(variants)}): token {step.index + 2} of at most {horizon}")
            return STOP if has_loop(ids) else None      # in a loop: what follows cannot change the verdict
        res = generate(model, s.prompt, on_token=token, **{**s.generation_kwargs(), "max_new_tokens": horizon})
        looped = res.stop_reason == "stopped" and has_loop(res.token_ids)
        rows.append(variant_row(label, res.token_ids, res.text, "loop" if looped else res.stop_reason, n_new))
    tell_units(on_progress, total, total, "done")
    return pd.DataFrame(rows, columns=VARIANT_COLUMNS)


VARIANT_COLUMNS = ["setting", "loops", "tail loop", "breaks the loop", "verdict", "text"]


def variant_row(label: str, token_ids: Sequence[int], text: str, stopped: str, run_len: int) -> dict:
    """One setting's row: its loops, and the verdict (engine.tools.loop_verdict.judge) against the run's length."""
    loops, tail = find_loops(token_ids), tail_loop(token_ids)
    verdict = judge(token_ids, stopped, run_len)
    return {"setting": label, "loops": len(loops),
            "tail loop": "—" if tail is None else f"start {tail.start}, period {tail.period}, ×{tail.count}",
            "breaks the loop": verdict.outcome == "loop gone", "verdict": verdict.words(run_len),
            "text": visible(text)}
