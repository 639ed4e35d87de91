"""The statistics columns, defined once: every stage's statistics are rows of STAT_NAMES (min, max, mean, std,
absmax, nan, inf) per position, and everything that reads them indexes by `Col` and pools them with `pool`.

Pooling over positions is exact because every position of a stage has the same number of elements: mean =
mean of the means, RMS = sqrt(mean over positions of mean² + std²), std = sqrt(RMS² - mean²). Positions whose
mean or std is not finite are left out of those three (their NaN / Inf counts say why); min / max / absmax skip
rows that hold only NaN, and are NaN where nothing finite is left. (For masked stages, attn.scores and
sampler.*, the masked entries are left out per position and positions are weighted equally.)"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import torch


class Col(IntEnum):
    MIN = 0
    MAX = 1
    MEAN = 2
    STD = 3
    ABSMAX = 4
    NAN = 5
    INF = 6


STAT_NAMES = tuple(c.name.lower() for c in Col)


def nonfinite(values: torch.Tensor) -> torch.Tensor:
    """values (..., 7) -> (...) True where the row counted a NaN or an Inf."""
    return (values[..., Col.NAN] + values[..., Col.INF]) > 0


@dataclass
class Pooled:
    """Per stage name (in first-seen forward order): its statistics pooled over every row it has."""
    names: list[str]
    positions: torch.Tensor       # (G,) rows pooled (int64)
    cols: dict[str, torch.Tensor]   # mean, std, rms, min, max, absmax (float64, NaN where unknown); nan, inf (int64)


def pool(parts) -> Pooled:
    """parts: (names, values (G, T, 7)) pairs, e.g. a probe's StatsBlocks as (b.names, b.values); rows of the
    same name in several parts are pooled together."""
    parts = list(parts)
    index: dict[str, int] = {}
    for names, _ in parts:
        for name in names:
            index.setdefault(name, len(index))
    G, f64 = len(index), torch.float64
    acc = {k: torch.zeros(G, dtype=f64) for k in ("n", "s_mean", "s_sq", "nan", "inf", "positions")}
    ext = {"min": torch.full((G,), math.inf, dtype=f64), "max": torch.full((G,), -math.inf, dtype=f64),
           "absmax": torch.full((G,), -math.inf, dtype=f64)}
    seen = {k: torch.zeros(G, dtype=f64) for k in ext}
    for names, values in parts:
        idx = torch.tensor([index[n] for n in names], dtype=torch.long)
        v = values.double()                                                    # (g, T, 7)
        mean, std = v[..., Col.MEAN], v[..., Col.STD]
        ok = torch.isfinite(mean) & torch.isfinite(std)
        for k, x in (("n", ok.sum(1).double()), ("s_mean", torch.where(ok, mean, 0.0).sum(1)),
                     ("s_sq", torch.where(ok, mean ** 2 + std ** 2, 0.0).sum(1)),
                     ("nan", v[..., Col.NAN].sum(1)), ("inf", v[..., Col.INF].sum(1)),
                     ("positions", torch.full((len(idx),), float(v.shape[1]), dtype=f64))):
            acc[k].index_add_(0, idx, x)
        for k, col in (("min", Col.MIN), ("max", Col.MAX), ("absmax", Col.ABSMAX)):
            x = v[..., col].amin(1) if k == "min" else v[..., col].amax(1)
            known = ~torch.isnan(x)
            seen[k].index_add_(0, idx, known.double())
            ext[k].scatter_reduce_(0, idx, torch.where(known, x, ext[k][idx]), "amin" if k == "min" else "amax")
    n = acc["n"]
    mean = torch.where(n > 0, acc["s_mean"] / n, math.nan)
    sq = torch.where(n > 0, acc["s_sq"] / n, math.nan)
    cols = {"mean": mean, "std": (sq - mean ** 2).clamp(min=0).sqrt(), "rms": sq.sqrt(),
            **{k: torch.where(seen[k] > 0, x, math.nan) for k, x in ext.items()},
            "nan": acc["nan"].long(), "inf": acc["inf"].long()}
    return Pooled(list(index), acc["positions"].long(), cols)
