"""Mixture-of-experts routing (Mixtral, Qwen3-MoE): which experts each token went to at each experts layer, the
router's probabilities, and the load per expert over the run.

The routing costs one forward over the run's tokens with a fresh cache that keeps two stages of each experts layer:
blocks.{i}.mlp.router (T, E) router logits and blocks.{i}.mlp.experts (T, E) the gate weight of each row's top-k
experts, 0 for the others (engine.moe.route). Everything after that forward is arithmetic on those tensors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from engine import Probe
from engine.progress import LayerProgress

from .theme import colorscale


@dataclass(frozen=True)
class Routing:
    """One run's routing: per experts layer (layers[j]), router logits and gates, float32 CPU (T, E) each."""
    layers: tuple[int, ...]
    router: torch.Tensor          # (L, T, E) router logits
    gates: torch.Tensor           # (L, T, E) gate weights: nonzero exactly at each row's chosen experts

    @property
    def probs(self) -> torch.Tensor:
        """The router's probabilities, softmax over the experts (before top-k): (L, T, E)."""
        return torch.softmax(self.router, dim=-1)

    @property
    def num_experts(self) -> int:
        return self.router.shape[-1]


def moe_layers(cfg) -> list[int]:
    return [i for i, moe in enumerate(cfg.layer_moe) if moe]


def expert_routing(model, ids: Sequence[int], *, on_progress=None) -> Routing:
    """The routing of every experts layer over all positions of ids (one forward; on_progress hears each layer)."""
    layers = moe_layers(model.config)
    if not layers:
        raise ValueError("this model has no mixture-of-experts layer")
    probe = Probe().capture(["blocks.*.mlp.router", "blocks.*.mlp.experts"], layers=layers)
    ids_t = torch.as_tensor([int(i) for i in ids], dtype=torch.long)
    T, L = len(ids_t), model.config.num_layers
    tell = LayerProgress(on_progress, T, L)
    model.forward(ids_t, model.new_cache(T), probe, last_only=True, on_layer=tell.on_layer(0, T))
    tell.chunk_done(0, T)

    def stack(stage: str) -> torch.Tensor:
        return torch.stack([probe.recording.captured(f"blocks.{i}.mlp.{stage}")[0].value.float() for i in layers])
    return Routing(tuple(layers), stack("router"), stack("experts"))


def routing_table(routing: Routing, labels: Sequence[str], layers: Sequence[int] | None = None) -> pd.DataFrame:
    """Long table, one row per (layer, position, chosen expert) of the given layers (default: all): its rank among
    that row's chosen experts (0 = the largest gate), the gate weight and the router's probability."""
    probs, parts = routing.probs, []
    for j, layer in enumerate(routing.layers):
        if layers is not None and layer not in layers:
            continue
        idx = torch.nonzero(routing.gates[j])                                  # (n, 2): position, expert
        pos, e = idx[:, 0], idx[:, 1]
        df = pd.DataFrame({"layer": layer, "position": pos.numpy(), "token": [labels[i] for i in pos.tolist()],
                           "expert": e.numpy(), "gate": routing.gates[j, pos, e].double().numpy(),
                           "router_prob": probs[j, pos, e].double().numpy()})
        df.insert(4, "rank", (df.groupby("position")["gate"].rank(ascending=False, method="first") - 1).astype(int))
        parts.append(df.sort_values(["position", "rank"]))
    cols = ["layer", "position", "token", "expert", "rank", "gate", "router_prob"]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=cols)


def expert_load(routing: Routing) -> pd.DataFrame:
    """Per (layer, expert): tokens routed to it, its share of the layer's routings (k per token), the gate weight
    it received in total, and the router's mean probability for it."""
    chosen = routing.gates.ne(0)                                               # (L, T, E)
    tokens = chosen.sum(1)                                                     # (L, E)
    rows = [(layer, e, int(tokens[j, e]), float(tokens[j, e] / max(1, int(tokens[j].sum()))),
             float(routing.gates[j, :, e].sum()), float(routing.probs[j, :, e].mean()))
            for j, layer in enumerate(routing.layers) for e in range(routing.num_experts)]
    return pd.DataFrame(rows, columns=["layer", "expert", "tokens", "share", "gate_total", "mean_router_prob"])


def load_figure(load: pd.DataFrame) -> go.Figure:
    """Layers × experts heatmap of the tokens each expert took (a balanced router: every cell near T·k/E)."""
    z = load.pivot(index="layer", columns="expert", values="tokens")
    fig = go.Figure(go.Heatmap(z=z.to_numpy(), x=[f"expert {e}" for e in z.columns],
                               y=[f"layer {i}" for i in z.index], colorscale=colorscale(),
                               colorbar=dict(title="tokens"), texttemplate="%{z}",
                               hovertemplate="%{y}, %{x}: %{z} tokens<extra></extra>"))
    fig.update_layout(height=120 + 30 * len(z), margin=dict(t=30, b=40), yaxis_autorange="reversed")
    return fig


def layer_matrix(routing: Routing, layer: int, what: str = "gates") -> np.ndarray:
    """(T, E) of one experts layer: its gates (0 off the chosen experts) or the router's probabilities."""
    j = routing.layers.index(layer)
    return (routing.gates if what == "gates" else routing.probs)[j].double().numpy()


def routing_figure(m: np.ndarray, labels: Sequence[str], title: str, start: int = 0) -> go.Figure:
    """Positions × experts heatmap of a layer_matrix (rows start..start + len(m) of the run)."""
    y = [f"{start + i}: {labels[start + i]}" for i in range(len(m))]
    fig = go.Figure(go.Heatmap(z=m, x=[f"expert {e}" for e in range(m.shape[1])], y=y, zmin=0, zmax=1,
                               colorscale=colorscale(), colorbar=dict(title="weight"),
                               hovertemplate="%{y}<br>%{x}: %{z:.3f}<extra></extra>"))
    fig.update_layout(title=title, height=min(900, 140 + 18 * len(m)), margin=dict(t=40, b=40),
                      yaxis_autorange="reversed")
    return fig


def top_expert_figure(routing: Routing, labels: Sequence[str], start: int = 0, size: int = 64) -> go.Figure:
    """Every experts layer × positions: the expert with the largest gate at each (layer, position)."""
    top = routing.gates[:, start:start + size].argmax(-1).numpy()              # (L, n)
    x = [f"{start + i}: {labels[start + i]}" for i in range(top.shape[1])]
    fig = go.Figure(go.Heatmap(z=top, x=x, y=[f"layer {i}" for i in routing.layers], zmin=0,
                               zmax=max(1, routing.num_experts - 1), colorscale=colorscale("Turbo"),
                               colorbar=dict(title="expert"), texttemplate="%{z}",
                               hovertemplate="%{y}, %{x}<br>top expert %{z}<extra></extra>"))
    fig.update_layout(height=120 + 30 * len(routing.layers), margin=dict(t=30, b=80), yaxis_autorange="reversed")
    return fig
