"""KV-cache memory: the formula, the engine's own numbers, growth over a run, GQA savings, projections.

    bytes = 2 (K and V) · layers · kv_heads · head_dim · positions · batch · bytes_per_element

A sliding-window (local) layer keeps only its window, a ring of W rows (engine.kv_cache), so it counts
min(positions, W) instead of positions: its memory stops growing at the window while a global layer's grows on.

Everything here is arithmetic over a config and a run's result; no Streamlit, no model calls.
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go
import torch

# Bytes per stored element. fp8/int8 caches are what vLLM/TensorRT-LLM call "kv_cache_dtype=fp8".
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8 / int8": 1}


@dataclass(frozen=True)
class KVShape:
    """What a KV cache's size depends on: layers, KV heads, head size (and query heads, for the MHA comparison),
    and each layer's sliding window (None: global; () = every layer global)."""
    layers: int
    kv_heads: int
    head_dim: int
    num_heads: int
    windows: tuple[int | None, ...] = ()

    @classmethod
    def from_config(cls, cfg) -> "KVShape":
        """From an engine ModelConfig."""
        windows = tuple(cfg.layer_window) if any(w is not None for w in cfg.layer_window) else ()
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads, windows)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return self.windows or (None,) * self.layers

    def rows(self, positions: int) -> int:
        """Cache rows over all layers: positions for a global layer, min(positions, window) for a local one."""
        return sum(positions if w is None else min(positions, w) for w in self.layer_windows)

    def bytes(self, positions: int, batch: int = 1, bytes_per_element: int = 2) -> int:
        return 2 * self.kv_heads * self.head_dim * self.rows(positions) * batch * bytes_per_element

    def mha_bytes(self, positions: int, batch: int = 1, bytes_per_element: int = 2) -> int:
        """The same cache if every query head had its own K and V (full multi-head attention)."""
        return 2 * self.num_heads * self.head_dim * self.rows(positions) * batch * bytes_per_element


# Published configs (config.json of each model): layers, num_key_value_heads, head_dim, num_attention_heads.
KNOWN_MODELS: dict[str, KVShape] = {
    "Llama-3-8B": KVShape(32, 8, 128, 32),
    "Llama-3-70B": KVShape(80, 8, 128, 64),
    "Llama-2-7B": KVShape(32, 32, 128, 32),
    "Mistral-7B": KVShape(32, 8, 128, 32),
    "Qwen2-7B": KVShape(28, 4, 128, 28),
    "SmolLM2-135M": KVShape(30, 3, 64, 9),
}
# With sliding-window layers (config.json's sliding_window and layer pattern): Gemma 2 alternates a 4,096-position
# window (even layers) with global attention.
WINDOWED_MODELS: dict[str, KVShape] = {
    "Gemma-2-9B": KVShape(42, 8, 256, 16, (4096, None) * 21),
    "Gemma-2-2B": KVShape(26, 4, 256, 8, (4096, None) * 13),
}


def kv_bytes(layers: int, kv_heads: int, head_dim: int, positions: int, batch: int = 1,
             bytes_per_element: int = 2) -> int:
    return 2 * layers * kv_heads * head_dim * positions * batch * bytes_per_element


def bytes_per_element(dtype: torch.dtype | str) -> int:
    if isinstance(dtype, str):
        if dtype in DTYPE_BYTES:
            return DTYPE_BYTES[dtype]
        dtype = getattr(torch, dtype.removeprefix("torch."))
    return torch.empty((), dtype=dtype).element_size()


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def weights_table(by_dtype: dict) -> pd.DataFrame:
    """A model's weights per dtype (engine Weights.nbytes_by_dtype): dtype, bytes, share of the whole."""
    total = max(1, sum(by_dtype.values()))
    return pd.DataFrame({"dtype": [dtype_name(d) for d in by_dtype], "weight_bytes": list(by_dtype.values()),
                         "share": [n / total for n in by_dtype.values()]})


def run_positions(cache: dict[str, int], shape: KVShape | None = None,
                  hints: tuple[int | None, int | None] = (None, None)) -> tuple[int, int]:
    """(allocated, used) positions of a run, from its result.cache byte counts. With window layers the bytes
    are rows (global layers count every position, local ones at most their window): the positions are the
    fewest that give those rows, unless hints (the run's cache length and last position, from its settings and
    steps) give the same bytes: where every layer is local and its ring full, any longer cache would."""
    bpt = cache["bytes_per_token"]
    if shape is None or not shape.windows:
        return cache["bytes_allocated"] // bpt, cache["bytes_used"] // bpt
    per_row = bpt // shape.layers
    out = []
    for n_bytes, hint in zip((cache["bytes_allocated"], cache["bytes_used"]), hints):
        rows = n_bytes // per_row
        out.append(hint if hint is not None and shape.rows(hint) == rows else positions_for_rows(shape, rows))
    return out[0], out[1]


def positions_for_rows(shape: KVShape, rows: int) -> int:
    """The fewest positions whose cache holds `rows` rows over all layers (rows(n) never falls as n grows)."""
    lo, hi = 0, max(1, rows)
    while lo < hi:
        mid = (lo + hi) // 2
        if shape.rows(mid) < rows:
            lo = mid + 1
        else:
            hi = mid
    return lo


def formula_vs_engine(shape: KVShape, bpe: int, cache: dict[str, int],
                      hints: tuple[int | None, int | None] = (None, None)) -> pd.DataFrame:
    """The formula next to the engine's measured KVCache numbers for this run (they must agree); hints as in
    run_positions."""
    allocated, used = run_positions(cache, shape, hints)
    rows = [("bytes per token", 1, shape.bytes(1, 1, bpe), cache["bytes_per_token"]),
            ("allocated", allocated, shape.bytes(allocated, 1, bpe), cache["bytes_allocated"]),
            ("used", used, shape.bytes(used, 1, bpe), cache["bytes_used"])]
    df = pd.DataFrame(rows, columns=["quantity", "positions", "formula_bytes", "engine_bytes"])
    df["match"] = df["formula_bytes"] == df["engine_bytes"]
    return df


def layer_kind(window: int | None) -> str:
    return "global" if window is None else f"local (window {window:,})"


def per_layer_table(shape: KVShape, bpe: int, allocated_positions: int, used_positions: int) -> pd.DataFrame:
    """Each layer's K and V slabs, (kv_heads, rows, head_dim) each: a global layer's rows are the positions, a
    local layer's at most its window (a ring)."""
    per_pos = 2 * shape.kv_heads * shape.head_dim * bpe
    windows = shape.layer_windows
    df = pd.DataFrame({"layer": range(shape.layers), "kind": [layer_kind(w) for w in windows],
                       "window": pd.array(windows, dtype="Int64")})
    df["allocated_rows"] = [allocated_positions if w is None else min(allocated_positions, w) for w in windows]
    df["used_rows"] = [used_positions if w is None else min(used_positions, w) for w in windows]
    df["allocated_bytes"] = per_pos * df["allocated_rows"]
    df["used_bytes"] = per_pos * df["used_rows"]
    df["used_pct"] = 100.0 * df["used_rows"] / df["allocated_rows"].clip(lower=1)
    return df


def kind_table(layers: pd.DataFrame, bytes_per_row: int) -> pd.DataFrame:
    """per_layer_table summed per kind of layer (global, each window): layers, bytes allocated and used, and
    what one more position would add (a local layer whose ring is full adds nothing)."""
    df = layers.assign(full=layers["window"].notna() & (layers["used_rows"] >= layers["window"].fillna(0)))
    out = df.groupby("kind", sort=False).agg(layers=("layer", "size"), window=("window", "first"),
                                             allocated_bytes=("allocated_bytes", "sum"),
                                             used_bytes=("used_bytes", "sum"), full=("full", "all"))
    out["next_token_bytes"] = [0 if full else n * bytes_per_row for n, full in zip(out["layers"], out["full"])]
    out["growing"] = ~out["full"]
    return out.drop(columns="full").reset_index()


def per_layer_figure(df: pd.DataFrame) -> go.Figure:
    """Allocated and used bytes per layer; a local (window) layer's used bar in orange, a global one's in blue."""
    kinds = df["kind"] if "kind" in df else pd.Series(["global"] * len(df))
    used_colours = ["#3b6fb6" if k == "global" else "#d9822b" for k in kinds]
    hover = "layer %{x} · %{customdata}<br>%{y:,} B<extra></extra>"
    fig = go.Figure([go.Bar(x=df["layer"], y=df["allocated_bytes"], name="allocated", marker_color="#c7d2e0",
                            customdata=kinds, hovertemplate="allocated: " + hover),
                     go.Bar(x=df["layer"], y=df["used_bytes"], name="used (orange: local layers)"
                            if (kinds != "global").any() else "used", marker_color=used_colours,
                            customdata=kinds, hovertemplate="used: " + hover)])
    fig.update_layout(barmode="overlay", xaxis_title="layer", yaxis_title="bytes", height=300,
                      margin=dict(t=30, b=40), legend=dict(orientation="h", y=1.12))
    return fig


def growth_table(result, shape: KVShape | None = None) -> pd.DataFrame:
    """Cache use after each step of a GenerationResult.

    Step s's forward writes its positions, so afterwards the cache holds Step.position positions
    (the prompt after the prefill, one more per decode step; the last chosen token is never written).
    With a windowed shape the used bytes are split into global and local layers (local ones stop at the window)."""
    bpt, allocated = result.cache["bytes_per_token"], result.cache["bytes_allocated"]
    df = pd.DataFrame({"step": [s.index for s in result.steps],
                       "positions": [s.position for s in result.steps]}, dtype="int64")
    if shape is None or not shape.windows:
        df["used_bytes"] = df["positions"] * bpt
    else:
        per_row = bpt // shape.layers
        local = [w for w in shape.windows if w is not None]
        n_global = shape.layers - len(local)
        df["global_used_bytes"] = df["positions"] * per_row * n_global
        df["local_used_bytes"] = [per_row * sum(min(n, w) for w in local) for n in df["positions"]]
        df["used_bytes"] = df["global_used_bytes"] + df["local_used_bytes"]
    df["allocated_bytes"] = allocated
    return df


def growth_figure(df: pd.DataFrame) -> go.Figure:
    fig = go.Figure([go.Scatter(x=df["step"], y=df["used_bytes"], mode="lines+markers", name="used",
                                customdata=df["positions"],
                                hovertemplate="step %{x}<br>%{customdata} positions<br>%{y:,} B<extra></extra>"),
                     go.Scatter(x=df["step"], y=df["allocated_bytes"], mode="lines", name="allocated",
                                line=dict(dash="dash", color="#888"))])
    if "local_used_bytes" in df:
        for col, name, colour in (("global_used_bytes", "used: global layers", "#3b6fb6"),
                                  ("local_used_bytes", "used: local (window) layers", "#d9822b")):
            fig.add_trace(go.Scatter(x=df["step"], y=df[col], mode="lines+markers", name=name,
                                     line=dict(color=colour, width=1.5), marker=dict(size=5),
                                     hovertemplate=name + "<br>step %{x}<br>%{y:,} B<extra></extra>"))
    fig.update_layout(xaxis_title="step (0 = prefill)", yaxis_title="bytes", yaxis_rangemode="tozero",
                      height=320, margin=dict(t=30, b=40), legend=dict(orientation="h", y=1.12))
    return fig


def gqa_table(shape: KVShape, bpe: int, positions: dict[str, int]) -> pd.DataFrame:
    """Grouped-query attention against full multi-head attention (kv_heads = num_heads), same formula."""
    rows = []
    for label, n in positions.items():
        gqa, mha = shape.bytes(n, 1, bpe), shape.mha_bytes(n, 1, bpe)
        rows.append((label, n, gqa, mha, mha - gqa, mha / gqa if gqa else float("nan")))
    return pd.DataFrame(rows, columns=["cache", "positions", "gqa_bytes", "mha_bytes", "saved_bytes", "mha_over_gqa"])


def cuda_memory_table(device: torch.device | str) -> pd.DataFrame | None:
    """torch's CUDA allocator counters for the model's device; None when it is not a CUDA device."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    rows = [("memory_allocated", torch.cuda.memory_allocated(device)),
            ("max_memory_allocated", torch.cuda.max_memory_allocated(device)),
            ("memory_reserved", torch.cuda.memory_reserved(device))]
    df = pd.DataFrame(rows, columns=["counter", "bytes"])
    df["readable"] = df["bytes"].map(human_bytes)
    return df


def projection_table(shapes: dict[str, KVShape], context_lengths: list[int], batch: int = 1,
                     dtype: str = "bfloat16") -> pd.DataFrame:
    """Long table: model × context length -> cache bytes (and what full MHA would need); a local (window) layer
    counts min(context, window) positions."""
    bpe = bytes_per_element(dtype)
    rows = [(name, s.layers, sum(w is not None for w in s.layer_windows), s.kv_heads, s.head_dim, n, batch, dtype,
             s.bytes(n, batch, bpe), s.mha_bytes(n, batch, bpe))
            for name, s in shapes.items() for n in context_lengths]
    df = pd.DataFrame(rows, columns=["model", "layers", "local_layers", "kv_heads", "head_dim", "context", "batch",
                                     "dtype", "bytes", "mha_bytes"])
    df["GiB"] = df["bytes"] / 2 ** 30
    return df


def projection_pivot(df: pd.DataFrame) -> pd.DataFrame:
    """Models as rows, context lengths as columns, GiB in the cells."""
    return df.pivot(index="model", columns="context", values="GiB").reindex(df["model"].unique())


def projection_figure(df: pd.DataFrame) -> go.Figure:
    """GiB per context length, one line per distinct cache shape: models whose caches are the same size
    (e.g. Llama-3-8B and Mistral-7B: 32 layers, 8 KV heads of 128) share one line named after all of them,
    instead of two lines drawn exactly on top of each other."""
    fig = go.Figure()
    groups: dict[tuple, list[str]] = {}
    for name, g in df.groupby("model", sort=False):
        groups.setdefault(tuple(g["bytes"]), []).append(name)
    symbols = ("circle", "square", "diamond", "triangle-up", "x", "star", "cross", "hexagon")
    for k, names in enumerate(groups.values()):
        g = df[df["model"] == names[0]]
        label = " = ".join(names) + (" (same cache size)" if len(names) > 1 else "")
        fig.add_trace(go.Scatter(x=g["context"], y=g["GiB"], mode="lines+markers", name=label,
                                 marker=dict(symbol=symbols[k % len(symbols)], size=8),
                                 hovertemplate=label + "<br>%{x:,} positions<br>%{y:.3f} GiB<extra></extra>"))
    fig.update_layout(xaxis_type="log", yaxis_type="log", xaxis_title="context length (positions)",
                      yaxis_title="KV cache (GiB)", height=420, margin=dict(t=30, b=40),
                      legend=dict(orientation="h", y=-0.25))
    return fig
