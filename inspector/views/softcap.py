"""The final logit soft cap (Gemma 2: logits = cap · tanh(logits / cap)): the logits of one step before the cap
(stage logits_uncapped) and after it (logits), and where the cap bent them.

tanh keeps the order of the tokens, so the cap never changes which token is top; it squeezes the large logits
towards ±cap, which flattens the distribution the sampler draws from."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from engine import Probe


def capped_logits(model, ids: Sequence[int], pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(uncapped, capped) logits (V,) float32 at position pos of ids: one forward over ids[:pos + 1] that keeps the
    stages logits_uncapped and logits of its last position."""
    if model.config.final_softcap is None:
        raise ValueError("this model has no final logit soft cap")
    probe = Probe().capture(["logits_uncapped", "logits"])
    ids_t = torch.as_tensor([int(i) for i in ids[:pos + 1]], dtype=torch.long)
    model.forward(ids_t, model.new_cache(len(ids_t)), probe, last_only=True)
    return tuple(probe.recording.captured(name)[0].value[-1].float() for name in ("logits_uncapped", "logits"))


def softcap_table(uncapped: torch.Tensor, capped: torch.Tensor, k: int,
                  decode: Callable[[int], str]) -> pd.DataFrame:
    """The top k tokens by logit: each one's logit before and after the cap, how far the cap pulled it in
    (bent = uncapped - capped), and its probability (softmax over the whole vocabulary) before and after."""
    top = torch.topk(uncapped, min(k, uncapped.numel())).indices
    p_before, p_after = torch.softmax(uncapped.double(), -1), torch.softmax(capped.double(), -1)
    df = pd.DataFrame({"rank": range(len(top)), "token_id": top.numpy(), "token": [decode(int(i)) for i in top],
                       "uncapped": uncapped[top].double().numpy(), "capped": capped[top].double().numpy()})
    df["bent"] = df["uncapped"] - df["capped"]
    df["prob_uncapped"] = p_before[top].numpy()
    df["prob_capped"] = p_after[top].numpy()
    return df


def softcap_summary(uncapped: torch.Tensor, capped: torch.Tensor, cap: float) -> dict:
    """How hard the cap worked at this step: the largest |logit| before and after, the top logit's pull, the
    share of the vocabulary whose logit moved by more than 1 % of the cap, and the entropy (nats) before / after."""
    def entropy(x: torch.Tensor) -> float:
        return float(torch.special.entr(torch.softmax(x.double(), -1)).sum())
    bent = (uncapped - capped).abs()
    return {"cap": cap, "max_abs_uncapped": float(uncapped.abs().max()), "max_abs_capped": float(capped.abs().max()),
            "top_pull": float(uncapped.max() - capped.max()), "share_bent": float((bent > 0.01 * cap).double().mean()),
            "entropy_uncapped": entropy(uncapped), "entropy_capped": entropy(capped)}


def softcap_figure(table: pd.DataFrame, cap: float) -> go.Figure:
    """Capped against uncapped logit for the top tokens, over the curve cap · tanh(x / cap) and the line y = x:
    a token far right of the line's end is where the cap bent hardest."""
    lo = min(float(table["uncapped"].min()), -0.2 * cap)
    hi = max(float(table["uncapped"].max()), 0.2 * cap)
    xs = np.linspace(lo, hi, 200)
    fig = go.Figure([
        go.Scatter(x=xs, y=xs, mode="lines", name="no cap (y = x)", line=dict(dash="dot", color="#888")),
        go.Scatter(x=xs, y=cap * np.tanh(xs / cap), mode="lines", name=f"{cap:g} · tanh(x / {cap:g})",
                   line=dict(color="#3b6fb6")),
        go.Scatter(x=table["uncapped"], y=table["capped"], mode="markers+text", name="top tokens",
                   text=[repr(t) for t in table["token"]], textposition="top left",
                   marker=dict(size=9, color="#c0392b"),
                   customdata=np.stack([table["rank"], table["bent"]], axis=-1),
                   hovertemplate="%{text} (rank %{customdata[0]})<br>uncapped %{x:.3f}<br>capped %{y:.3f}"
                                 "<br>pulled in by %{customdata[1]:.3f}<extra></extra>")])
    fig.add_hline(y=cap, line=dict(dash="dash", color="#bbb"))
    fig.add_hline(y=-cap, line=dict(dash="dash", color="#bbb"))
    fig.update_layout(xaxis_title="logit before the cap (logits_uncapped)", yaxis_title="logit after the cap (logits)",
                      height=420, margin=dict(t=30, b=40), legend=dict(orientation="h", y=1.12))
    return fig
