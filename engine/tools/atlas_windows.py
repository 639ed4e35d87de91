"""Per-position head scores and each head's top-scoring windows, for the head atlas (engine.tools.head_atlas).

A head's atlas score is a mean over query positions; the positions themselves say why: for previous-token, the
query positions where the head puts most weight on the token before. position_scores gives, for one layer's
(heads, T, T) pattern, every query position's score and the key position it is about (the attended token);
TopWindows keeps, for every score, layer and head, the TOP_K best (sequence, query, key, score) seen so far and
merges each new pattern into them at once, so memory stays (scores, layers, heads, TOP_K) however long the corpus.

The order is total, so the top entries do not depend on the order sequences are offered in: the score (highest
first; entropy lowest first, the sharpest rows), then the sequence index, then the query position, both ascending.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.errors import InputError

TOP_K = 5                       # windows kept per head and score
LOWEST_FIRST = ("entropy",)     # scores whose best windows are the lowest


def position_scores(pattern: torch.Tensor, ids: list[int]) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Each text score of one (heads, T, T) causal pattern over tokens ids, per query position:
    {name: (scores (heads, n), queries (n,), keys (heads, n))}. Query positions 1 .. T-1 (position 0 can attend only
    to itself); duplicate-token only those with an earlier copy of their token, its key the copy it attends most;
    entropy's key the row's most attended position."""
    p = pattern.detach().double().cpu()
    H, T = p.shape[0], p.shape[1]
    if p.dim() != 3 or p.shape[2] != T or len(ids) != T:
        raise InputError(f"position_scores wants a (heads, T, T) pattern over T = len(ids) tokens; got "
                         f"{tuple(p.shape)} over {len(ids)} tokens")
    i = torch.arange(1, T)
    keys = lambda k: np.broadcast_to(k.numpy(), (H, T - 1)).copy()     # noqa: E731 - one key per query, every head
    rows = p[:, 1:, :]                                                  # (H, T-1, T)
    out = {"previous-token": (p[:, i, i - 1].numpy(), i.numpy(), keys(i - 1)),
           "first-token": (p[:, i, 0].numpy(), i.numpy(), keys(torch.zeros_like(i))),
           "self": (p[:, i, i].numpy(), i.numpy(), keys(i)),
           "entropy": (-(rows * rows.clamp_min(1e-300).log()).sum(-1).numpy(), i.numpy(),
                       rows.argmax(-1).numpy())}
    t = torch.tensor(ids)
    same = (t[:, None] == t[None, :]) & torch.ones(T, T, dtype=torch.bool).tril(-1)    # j < i, ids[j] == ids[i]
    has = same.any(1)
    copies = (p * same)[:, has]                                                          # (H, n, T)
    on_copies = torch.where(same, p, -1.0)[:, has]          # argmax among the copies even where all weigh 0
    out["duplicate-token"] = (copies.sum(-1).numpy(), torch.nonzero(has).flatten().numpy(),
                              on_copies.argmax(-1).numpy())
    return out


def induction_positions(pattern: torch.Tensor, length: int, start: int = 0) -> tuple[np.ndarray, np.ndarray,
                                                                                     np.ndarray]:
    """The induction score per query position of the second copy (start+length .. start+2*length-1) of a sequence
    written twice: (scores (heads, length), queries (length,), keys (heads, length)), the key i - length + 1 (the
    token after i's earlier copy)."""
    p = pattern.detach().double().cpu()
    if length < 2 or p.dim() != 3 or p.shape[1] < start + 2 * length:
        raise InputError(f"induction_score wants two copies of length >= 2 tokens from position {start}; the pattern "
                         f"has {p.shape[1] if p.dim() == 3 else tuple(p.shape)} positions for length {length}")
    i = torch.arange(start + length, start + 2 * length)
    k = np.broadcast_to((i - length + 1).numpy(), (p.shape[0], length)).copy()
    return p[:, i, i - length + 1].numpy(), i.numpy(), k


class TopWindows:
    """The TOP_K best windows of every (score, layer, head): value (layers, heads, TOP_K) float64 and at
    (layers, heads, TOP_K, 3) int64 of (sequence, query, key); an empty slot is value NaN, at -1."""

    def __init__(self, names, layers: int, heads: int, k: int = TOP_K) -> None:
        self.k = k
        self.value = {n: np.full((layers, heads, k), np.nan) for n in names}
        self.at = {n: np.full((layers, heads, k, 3), -1, dtype=np.int64) for n in names}

    def offer(self, name: str, layer: int, seq: int, scores: np.ndarray, queries: np.ndarray,
              keys: np.ndarray) -> None:
        """Merge one sequence's per-position scores (heads, n) of one layer into that layer's top entries."""
        H, n = scores.shape
        if n == 0:
            return
        old_v, old_at = self.value[name][layer], self.at[name][layer]                     # (H, k), (H, k, 3)
        new_at = np.stack([np.full((H, n), seq), np.broadcast_to(queries, (H, n)), keys], -1).astype(np.int64)
        v = np.concatenate([old_v, scores], 1)                                             # (H, k + n)
        at = np.concatenate([old_at, new_at], 1)                                           # (H, k + n, 3)
        empty = at[..., 0] < 0
        sign = 1.0 if name in LOWEST_FIRST else -1.0
        primary = np.where(empty, np.inf, sign * np.nan_to_num(v, nan=np.inf))
        big = np.iinfo(np.int64).max
        order = np.lexsort((np.where(empty, big, at[..., 1]), np.where(empty, big, at[..., 0]), primary), axis=-1)
        top = order[:, :self.k]
        self.value[name][layer] = np.take_along_axis(v, top, 1)
        self.at[name][layer] = np.take_along_axis(at, top[..., None], 1)
        self.value[name][layer][np.take_along_axis(empty, top, 1)] = np.nan
