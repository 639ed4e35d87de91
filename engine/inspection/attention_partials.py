"""The causal fast path of attention statistics: per (head, row) partial results of each query block (Partials),
combined over heads for all layers of a call at once (finish_partials), and a layer's partial results waiting for
the statistics batcher's flush (PendingAttention, a source of statistics: engine.inspection.stats). See
engine.inspection.attention_stats for the closed forms and when the exact path takes over."""
from __future__ import annotations

import torch

from engine.attention_math import scaled_queries, softmax_pattern_
from engine.inspection.attention_blocks import (
    BLOCK_ELEMENTS,
    MIN_ROWS,
    AttentionResult,
    AttentionView,
    Keep,
    diagonal_tiles,
    exact_block,
    pad_rows,
    query_blocks,
    scores_block,
    workspace,
)
from engine.inspection.reference_stats import CANCELLATION


class Partials:
    """Per (head, row) partial results of the causal fast path, (H, T) each, combined by finish_partials."""

    def __init__(self, H: int, T: int, S: int, off: int, device, X_buf: torch.Tensor, W_buf: torch.Tensor) -> None:
        self.H, self.T, self.S, self.off = H, T, S, off
        self.X_buf, self.W_buf = X_buf, W_buf
        self.z = torch.zeros(6, H, T, device=device)
        self.lo, self.hi, self.s1, self.s2, self.pmax, self.r = self.z
        self.n = torch.arange(off + 1, off + T + 1, device=device, dtype=torch.float32)    # keys each row sees
        self.unseen = torch.zeros(T, device=device)          # keys after the row's block (never computed)
        self._tiles: tuple = ()

    def make_tiles(self, rows: int, device) -> None:
        self._tiles = diagonal_tiles(rows, device)

    def block(self, q, kT, t0: int, t1: int, keep: Keep, pattern: bool) -> None:
        """Query rows t0..t1 against keys 0..off+t1: the scores' partial min, max, Σx and Σx², then the pattern
        (softmax in place) and its largest value (1/l) and ‖p - 1/S‖."""
        H, S = self.H, self.S
        Tb, P, Sc = t1 - t0, self.off + t0, self.off + t1     # rows, keys every row sees, keys any row sees
        X = scores_block(q, kT, t0, t1, Sc, self.X_buf)                   # (H, Tb, Sc)
        plus_inf, keep01, minus_inf = (t[:Tb, :Tb] for t in self._tiles)
        D, past = X[:, :, P:], X[:, :, :P]                                 # diagonal (H, Tb, Tb), (H, Tb, P)
        W = torch.mul(D, keep01, out=self.W_buf[:H * Tb * Tb].view(H, Tb, Tb))   # masked keys -> 0
        lo, hi, s1, s2 = self.lo[:, t0:t1], self.hi[:, t0:t1], self.s1[:, t0:t1], self.s2[:, t0:t1]
        torch.sum(W, -1, out=s1)
        torch.linalg.vector_norm(W, dim=-1, out=s2)
        torch.amin(W.add_(plus_inf), -1, out=lo)                           # masked keys -> +inf
        s2.square_()
        if P:
            torch.minimum(lo, past.amin(-1), out=lo)
            s1 += past.sum(-1)
            s2 += torch.linalg.vector_norm(past, dim=-1).square_()
        self.unseen[t0:t1] = S - Sc
        D.add_(minus_inf)                                                  # the mask, as the scores stage has it
        if keep.sel_s:
            keep.kept_s[keep.b] = pad_rows(X[:, keep.sel_s], S, float("-inf"))
        torch.amax(X, -1, out=hi)
        if not (pattern or keep.sel_p):
            return
        p = softmax_pattern_(X)                                            # in place: the block is contiguous
        if keep.sel_p:
            keep.kept_p[keep.b] = pad_rows(p[:, keep.sel_p], S, 0.0)
        torch.amax(p, -1, out=self.pmax[:, t0:t1])                         # = exp(0) / l: 1/l
        torch.linalg.vector_norm(p.sub_(1.0 / S), dim=-1, out=self.r[:, t0:t1])


def run_blocks(q, kT, H: int, T: int, S: int, off: int, blocks, keep: "Keep", pattern: bool) -> "Partials":
    """The causal fast path over every query block: per (head, row) partial results, no host round trip."""
    size = max((t1 - t0) * (off + t1) for t0, t1 in blocks) * H
    tile = max(t1 - t0 for t0, t1 in blocks) ** 2 * H
    acc = Partials(H, T, S, off, q.device, *workspace(size, tile, q.device, torch.float32))
    acc.make_tiles(max(t1 - t0 for t0, t1 in blocks), q.device)
    for b, (t0, t1) in enumerate(blocks):
        acc.block(q, kT, t0, t1, keep.block(b, t0, t1), pattern)
    return acc


class PendingAttention:
    """One layer's attention statistics as partial results, combined later with other layers' (resolve): a source
    of statistics for the batcher's one door (engine.inspection.stats.StatsBatcher.add), giving the stages
    `want` asks statistics of. Keeps the scaled queries and the keys (a view of the cache, which the rest of the
    call does not change) for the exact path (rows with a NaN or Inf among their scores, or cancellation),
    decided once for all layers together."""

    def __init__(self, acc: "Partials", q, keys, blocks, want: AttentionView) -> None:
        self.acc, self.q, self.keys, self.blocks, self.want = acc, q, keys, blocks, want
        self.rows = acc.T
        self.device = q.device
        self.elements = q.numel()          # what it holds until resolved (the batcher bounds its queue by it)
        self.values: tuple = (None, None)  # (scores (T, 7), pattern (T, 7)) once resolved

    @property
    def wanted(self) -> tuple[bool, bool]:
        return self.want.scores_stats, self.want.pattern_stats

    def stage_values(self) -> list[torch.Tensor]:
        """The (T, 7) statistics of the stages it gives, in forward order (once resolved)."""
        return [v for v, w in zip(self.values, self.wanted) if w]

    @staticmethod
    def resolve(pending: list["PendingAttention"]) -> None:
        """Statistics of every pending layer not yet resolved (sharing T, S and heads, as the layers of one call
        do) in a few ops, one host round trip for all of them, then the exact path for the layers that need it."""
        groups: dict[tuple, list[PendingAttention]] = {}
        for pa in pending:
            if pa.values[0] is None and pa.values[1] is None:
                groups.setdefault((pa.acc.H, pa.acc.T, pa.acc.S, pa.acc.off) + pa.wanted, []).append(pa)
        for group in groups.values():
            scores, pattern, bad = finish_partials([pa.acc for pa in group], *group[0].wanted)
            for i, pa in enumerate(group):
                pa.values = (None if scores is None else scores[i], None if pattern is None else pattern[i])
            for i in bad.any(1).nonzero().flatten().tolist():
                group[i].redo(bad[i])

    def redo(self, bad: torch.Tensor) -> None:
        """The exact path for the blocks holding a row in bad (T,), written into this layer's values."""
        out, keep = AttentionResult(*self.values), Keep(AttentionView(), 0, self.rows)
        kT = self.keys.float().transpose(1, 2)
        S, off, dev = kT.shape[2], self.acc.off, self.q.device
        for b, (t0, t1) in enumerate(self.blocks):
            if bool(bad[t0:t1].any()):
                allowed = torch.arange(S, device=dev)[None, :] <= (off + torch.arange(t0, t1, device=dev))[:, None]
                exact_block(self.q, kT, allowed, t0, t1, out, keep.block(b, t0, t1))


def pending_attention(qh, keys, off: int, want: AttentionView) -> PendingAttention:
    """A statistics-only layer under the causal mask (query t sees keys s <= off + t), computed up to its
    partial results."""
    (H, T, hd), K, S = qh.shape, keys.shape[0], keys.shape[1]
    blocks = query_blocks(T, S, H, off, BLOCK_ELEMENTS, MIN_ROWS)
    q = scaled_queries(qh).reshape(K, -1, T, hd)                            # (K, G, T, hd)
    kT = keys.float().transpose(1, 2)                                      # (K, hd, S)
    acc = run_blocks(q, kT, H, T, S, off, blocks, Keep(AttentionView(), 0, T), want.pattern_stats)
    return PendingAttention(acc, q, keys, blocks, want)


def finish_partials(accs: list["Partials"], scores: bool, pattern: bool) -> tuple:
    """Partial results of L layers (same H, T, S, off) -> statistics (L, T, 7) of the scores and of the pattern
    (None where not wanted) and the rows the partial results cannot give exactly, (L, T): a NaN or Inf among
    the scores, or a mean that dwarfs their spread (for the exact path)."""
    a = accs[0]
    H, S, n = a.H, a.S, a.n
    Z = torch.stack([x.z for x in accs]) if len(accs) > 1 else a.z[None]   # (L, 6, H, T): lo hi s1 s2 pmax r
    sums = Z[:, 2:4].sum(2)                                                # (L, 2, T)
    lo, top = Z[:, 0].amin(1), Z[:, 1::3].amax(2)                          # (L, T); (L, 2, T) max score, max p
    mean = sums[:, 0] / (H * n)
    var = sums[:, 1] / (H * n) - mean * mean
    zero = torch.zeros_like(mean)
    out_s = out_p = None
    if scores:
        hi = top[:, 0]
        out_s = torch.stack([lo, hi, mean, var.clamp(min=0).sqrt(), torch.maximum(lo.abs(), hi.abs()), zero, zero], -1)
    if pattern:
        c, pmax = 1.0 / S, top[:, 1]
        pmin = (torch.exp(Z[:, 0] - Z[:, 1]) * Z[:, 4]).amin(1).masked_fill_(n < S, 0.0)
        m2 = Z[:, 5].square().sum(1) + (H * c * c) * a.unseen
        out_p = torch.stack([pmin, pmax, torch.full_like(pmax, c), (m2 / (H * S)).sqrt(), pmax, zero, zero], -1)
    return out_s, out_p, ~((var >= CANCELLATION * mean * mean) & (var < float("inf")))
