"""Statistics (and chosen rows) of attention scores and pattern without materialising [heads, T, S].

A full inspection wants, for every layer, the 7 statistics of each query position's scores row and pattern
row over (heads × S), as for any heads-first stage. Materialising both (H, T, S) tensors costs O(T²) memory
(2.3 GB per tensor per layer at 8,000 tokens) and as many slow passes through memory. Here a block of query
rows meets every key (flash-attention style): its scores are computed into a fixed workspace, reduced, turned
into the pattern in place, reduced again, and dropped. The output z still comes from the fused kernel (the
caller's); this only computes what the probe asked to see.

The fast path (causal mask) uses the structure: keys after a block's last query are masked for every row
of the block and never computed; masked entries add nothing to the score statistics and exactly zero to the
pattern, whose statistics they still enter (as in the materialised tensor) through closed forms: per (head,
row) max p = 1/l (l the softmax denominator), min p = 0 when the row has a masked key, the row mean is 1/S,
and Σ(p - 1/S)² = Σ over computed keys + (masked keys)·(1/S)². Each block only writes per (head, row)
partial results into (H, T) accumulators (a few large reductions, no host round trip); they are combined
over heads (min of mins, sums of sums; the second moment about the row's own mean, as the materialised
statistics take it) for all layers at once at the probe's flush (PendingAttention). Rows whose scores hold a
NaN or Inf (found once per flush), and masks that are not causal, take the exact path (the block materialised,
engine.inspection.reference_stats.dense_stats). Each equals the materialised statistics to fp32 rounding.
offer_pending is the PyTorch statistics backend's attention method, offer_exact the reference's (row_stats; the
native backend's runs in engine/native/inspect.c)."""
from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass

import torch

from engine.inspection.reference_stats import CANCELLATION, dense_stats
from engine.inspection.stages import ATTENTION_MAPS

BLOCK_ELEMENTS = 1 << 19      # score elements per query block (2 MiB fp32): the working set is two of these
MIN_ROWS = 16                 # ... but at least this many query rows (long contexts: fewer, larger ops)
_local = threading.local()    # per-thread workspace, reused across layers and calls


@dataclass
class AttentionView:
    """What a probe asked of one layer's attention: statistics and/or some rows of each stage."""
    scores_stats: bool = False
    pattern_stats: bool = False
    scores_rows: list[int] | None = None       # absolute query positions to keep in full
    pattern_rows: list[int] | None = None

    def __bool__(self) -> bool:
        return self.scores_stats or self.pattern_stats or self.scores_rows is not None or self.pattern_rows is not None


@dataclass
class AttentionResult:
    scores_stats: torch.Tensor | None = None   # (T, 7)
    pattern_stats: torch.Tensor | None = None  # (T, 7)
    scores_rows: torch.Tensor | None = None    # (H, len(rows), S)
    pattern_rows: torch.Tensor | None = None


def release_workspace() -> None:
    """Free this thread's workspace (the next inspected call allocates it again)."""
    _local.ws = _local.tiles = _local.mask = None


def workspace_elements() -> int:
    """Elements in this thread's workspace now (0 when none): the peak extra memory of blocked statistics."""
    ws, tiles = getattr(_local, "ws", None), getattr(_local, "tiles", None)
    return (0 if ws is None else ws[0].numel() + ws[1].numel()) + (0 if tiles is None else 3 * tiles[0].numel())


def _workspace(n: int, m: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat buffers of at least n (a block's scores) and m (its diagonal tile) elements, kept per thread so
    no layer allocates its own."""
    ws = getattr(_local, "ws", None)
    if ws is None or ws[0].numel() < n or ws[1].numel() < m or ws[0].device != device or ws[0].dtype != dtype:
        n, m = max(n, 0 if ws is None else ws[0].numel()), max(m, 0 if ws is None else ws[1].numel())
        with torch.inference_mode(False):        # ordinary tensors: usable inside and outside inference mode
            ws = _local.ws = (torch.empty(n, device=device, dtype=dtype), torch.empty(m, device=device, dtype=dtype))
    return ws


def inspect_attention(p, qh: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, values=None) -> None:
    """Offer a layer's attention scores and pattern to its probe view p as statistics and/or captured rows,
    as far as p needs them short of the whole tensors (engine.inspection.probe_views: STATS or ROWS). Statistics
    alone: the probe's statistics backend (engine.inspection.row_stats), or the reference's (offer_exact) when it
    declines; with captured rows, attention_view."""
    want = AttentionView(p.wants_stats("attn.scores"), p.wants_stats("attn.pattern"),
                         p.capture_positions("attn.scores"), p.capture_positions("attn.pattern"))
    if not want:
        return None
    T = qh.shape[1]
    if want.scores_rows is None and want.pattern_rows is None:
        off = causal_offset(mask, T, keys.shape[1])
        if not p.probe.stats_backend.attention(p, qh, keys, values, mask, off, want):
            offer_exact(p, qh, keys, mask, want)
        return
    _offer(p, attention_view(qh, keys, mask, p.pos0, want), want, T)


def _offer(p, res: AttentionResult, want: AttentionView, T: int) -> None:
    for stage, stats, rows, wanted in (("attn.scores", res.scores_stats, res.scores_rows, want.scores_rows),
                                       ("attn.pattern", res.pattern_stats, res.pattern_rows, want.pattern_rows)):
        if stats is not None:
            p.offer_stats(stage, stats)
        if rows is not None:
            p.offer_rows(stage, rows, [t for t in wanted if p.pos0 <= t < p.pos0 + T])


def offer_pending(p, qh: torch.Tensor, keys: torch.Tensor, off: int | None, want: AttentionView) -> bool:
    """The PyTorch backend's attention statistics: a causal layer (off not None) computed up to its partial
    results, offered to p as a PendingAttention the batcher combines for all layers at its flush (no host round
    trip per layer; rows the partial results cannot give exactly take the exact path there). False: another mask."""
    if off is None:
        return False
    with torch.no_grad():
        pending = _pending(qh.detach(), keys.detach(), off, want)
    p.offer_pending(ATTENTION_MAPS, pending)
    return True


def offer_exact(p, qh: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, want: AttentionView) -> bool:
    """The reference's attention statistics: every block materialised and reduced by dense_stats, any mask."""
    _offer(p, attention_view(qh, keys, mask, p.pos0, want, exact=True), want, qh.shape[1])
    return True


def causal_offset(mask: torch.Tensor | None, T: int, S: int) -> int | None:
    """S - T when the mask is the causal one (query t sees keys j <= S - T + t), else None. Every layer of a
    call passes the same mask object, so the answer for the last one seen is kept (per thread)."""
    off = S - T
    if mask is None:
        return off
    last = getattr(_local, "mask", None)
    if last is not None and last[0]() is mask and last[1] == (T, S):
        return last[2]
    dev = mask.device
    causal = torch.arange(S, device=dev)[None, :] <= (off + torch.arange(T, device=dev))[:, None]
    answer = off if mask.shape == (T, S) and bool(torch.equal(mask, causal)) else None
    _local.mask = (weakref.ref(mask), (T, S), answer)      # (a weak reference: the mask is not kept)
    return answer


def query_blocks(T: int, S: int, H: int, off: int | None, block_elements: int,
                 min_rows: int = MIN_ROWS) -> list[tuple[int, int]]:
    """Query row ranges whose scores hold about block_elements each (at least one row). Causal: a block of
    rows t0..t1 needs keys 0..off+t1 only, so early blocks take more rows."""
    blocks, t0 = [], 0
    block_elements = max(block_elements, min(min_rows, T) * H * S)
    while t0 < T:
        if off is None:
            rows = block_elements // (H * S)
        else:            # the largest r with H * r * (off + t0 + r) <= block_elements
            c = off + t0
            rows = int((math.sqrt(c * c + 4 * block_elements / H) - c) / 2)
        t1 = min(T, t0 + max(1, rows))
        blocks.append((t0, t1))
        t0 = t1
    return blocks


def attention_view(qh: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, pos0: int,
                   want: AttentionView, block_elements: int = BLOCK_ELEMENTS, min_rows: int = MIN_ROWS,
                   exact: bool = False) -> AttentionResult:
    """qh (H, T, hd) rotated queries, keys (K, S, hd), mask None (causal) or bool (T, S) allowed.

    Returns per-position statistics (T, 7) of the scores (-inf mask entries left out) and of the pattern,
    and the rows asked for, in blocks of about block_elements score elements (and at least min_rows rows).
    exact: every block materialised (the reference), also under the causal mask."""
    with torch.no_grad():        # statistics are observations: never part of a gradient (grad=True forwards)
        return _attention_view(qh.detach(), keys.detach(), mask, pos0, want, block_elements, min_rows, exact)


def _attention_view(qh, keys, mask, pos0: int, want: AttentionView, block_elements: int,
                    min_rows: int, exact_only: bool) -> AttentionResult:
    (H, T, hd), K, S = qh.shape, keys.shape[0], keys.shape[1]
    off = causal_offset(mask, T, S)
    blocks = query_blocks(T, S, H, off, block_elements, min_rows)
    q = (qh.float() * hd ** -0.5).reshape(K, -1, T, hd)                     # (K, G, T, hd)
    kT = keys.float().transpose(1, 2)                                      # (K, hd, S)
    out = AttentionResult(torch.empty(T, 7, device=qh.device) if want.scores_stats else None,
                          torch.empty(T, 7, device=qh.device) if want.pattern_stats else None)
    keep, exact = _Keep(want, pos0, T), blocks
    if off is not None and not exact_only:
        acc = _run_blocks(q, kT, H, T, S, off, blocks, keep, want.pattern_stats)
        scores, pattern, bad = _finish([acc], want.scores_stats, want.pattern_stats)
        out.scores_stats = None if scores is None else scores[0]
        out.pattern_stats = None if pattern is None else pattern[0]
        bad = bad[0]                                                        # (T,) rows for the exact path
        exact = [(t0, t1) for t0, t1 in blocks if bool(bad[t0:t1].any())] if bool(bad.any()) else []
    for t0, t1 in exact:
        allowed = mask[t0:t1] if off is None else \
            torch.arange(S, device=qh.device)[None, :] <= (off + torch.arange(t0, t1, device=qh.device))[:, None]
        _exact_block(q, kT, allowed, t0, t1, out, keep.block(blocks.index((t0, t1)), t0, t1))
    out.scores_rows, out.pattern_rows = keep.result(H, S, qh.device)
    return out


class _Keep:
    """Rows some capture keeps, by block: which rows of a block, and what was kept there (a redone block
    replaces its rows)."""

    def __init__(self, want: AttentionView, pos0: int, T: int) -> None:
        self.want = want
        self.all_s = sorted(p - pos0 for p in set(want.scores_rows or ()) if 0 <= p - pos0 < T)
        self.all_p = sorted(p - pos0 for p in set(want.pattern_rows or ()) if 0 <= p - pos0 < T)
        self.kept_s: dict[int, torch.Tensor] = {}     # block -> its kept rows
        self.kept_p: dict[int, torch.Tensor] = {}
        self.sel_s, self.sel_p, self.b = [], [], 0

    def block(self, b: int, t0: int, t1: int) -> "_Keep":
        """Select block b (rows t0..t1): sel_s / sel_p are its rows to keep, relative to t0."""
        self.b = b
        self.sel_s = [t - t0 for t in self.all_s if t0 <= t < t1]
        self.sel_p = [t - t0 for t in self.all_p if t0 <= t < t1]
        return self

    def result(self, H: int, S: int, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        def cat(kept):
            parts = [kept[b] for b in sorted(kept)]
            return torch.cat(parts, 1) if parts else torch.empty(H, 0, S, device=device)
        return (cat(self.kept_s) if self.want.scores_rows is not None else None,
                cat(self.kept_p) if self.want.pattern_rows is not None else None)


class _Partials:
    """Per (head, row) partial results of the causal fast path, (H, T) each, combined by _finish."""

    def __init__(self, H: int, T: int, S: int, off: int, device, X_buf: torch.Tensor, W_buf: torch.Tensor) -> None:
        self.H, self.T, self.S, self.off = H, T, S, off
        self.X_buf, self.W_buf = X_buf, W_buf
        self.z = torch.zeros(6, H, T, device=device)
        self.lo, self.hi, self.s1, self.s2, self.pmax, self.r = self.z
        self.n = torch.arange(off + 1, off + T + 1, device=device, dtype=torch.float32)    # keys each row sees
        self.unseen = torch.zeros(T, device=device)          # keys after the row's block (never computed)
        self._tiles: tuple = ()

    def make_tiles(self, rows: int, device) -> None:
        """The diagonal tile's mask as tiles to add or multiply (a block of Tb rows uses the top-left Tb × Tb):
        keys after the query get +inf (min), 0 (sums) or -inf (max, softmax). Masks are applied by add/mul:
        masked_fill is 10x slower."""
        tiles = getattr(_local, "tiles", None)
        if tiles is None or tiles[0].shape[0] < rows or tiles[0].device != device:
            upper = torch.ones(rows, rows, dtype=torch.bool, device=device).triu_(1)
            zero = torch.zeros(rows, rows, device=device)
            with torch.inference_mode(False):
                tiles = _local.tiles = (zero.masked_fill(upper, float("inf")), (~upper).float(),
                                        zero.masked_fill(upper, float("-inf")))
        self._tiles = tiles

    def block(self, q, kT, t0: int, t1: int, keep: _Keep, pattern: bool) -> None:
        """Query rows t0..t1 against keys 0..off+t1: the scores' partial min, max, Σx and Σx², then the pattern
        (softmax in place) and its largest value (1/l) and ‖p - 1/S‖."""
        H, S = self.H, self.S
        Tb, P, Sc = t1 - t0, self.off + t0, self.off + t1     # rows, keys every row sees, keys any row sees
        X = _scores_block(q, kT, t0, t1, Sc, self.X_buf)                   # (H, Tb, Sc)
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
            keep.kept_s[keep.b] = _pad(X[:, keep.sel_s], S, float("-inf"))
        torch.amax(X, -1, out=hi)
        if not (pattern or keep.sel_p):
            return
        p = torch.ops.aten._softmax.out(X, -1, False, out=X)               # in place: the block is contiguous
        if keep.sel_p:
            keep.kept_p[keep.b] = _pad(p[:, keep.sel_p], S, 0.0)
        torch.amax(p, -1, out=self.pmax[:, t0:t1])                         # = exp(0) / l: 1/l
        torch.linalg.vector_norm(p.sub_(1.0 / S), dim=-1, out=self.r[:, t0:t1])


def _run_blocks(q, kT, H: int, T: int, S: int, off: int, blocks, keep: "_Keep", pattern: bool) -> "_Partials":
    """The causal fast path over every query block: per (head, row) partial results, no host round trip."""
    size = max((t1 - t0) * (off + t1) for t0, t1 in blocks) * H
    tile = max(t1 - t0 for t0, t1 in blocks) ** 2 * H
    acc = _Partials(H, T, S, off, q.device, *_workspace(size, tile, q.device, torch.float32))
    acc.make_tiles(max(t1 - t0 for t0, t1 in blocks), q.device)
    for b, (t0, t1) in enumerate(blocks):
        acc.block(q, kT, t0, t1, keep.block(b, t0, t1), pattern)
    return acc


class PendingAttention:
    """One layer's attention statistics as partial results, combined later with other layers' (resolve):
    what engine.inspection.stats.StatsBatcher.add_pending takes. Keeps the scaled queries and the keys (a view of the
    cache, which the rest of the call does not change) for the exact path (rows with a NaN or Inf among their
    scores, or cancellation), decided once for all layers together."""

    def __init__(self, acc: "_Partials", q, keys, blocks, want: AttentionView) -> None:
        self.acc, self.q, self.keys, self.blocks, self.want = acc, q, keys, blocks, want
        self.rows = acc.T
        self.elements = q.numel()          # what it holds until resolved (the batcher bounds its queue by it)
        self.values: tuple = (None, None)  # (scores (T, 7), pattern (T, 7)) once resolved

    @property
    def wanted(self) -> tuple[bool, bool]:
        return self.want.scores_stats, self.want.pattern_stats

    @staticmethod
    def resolve(pending: list["PendingAttention"]) -> None:
        """Statistics of every pending layer (sharing T, S and heads, as the layers of one call do) in a few
        ops, one host round trip for all of them, then the exact path for the layers that need it."""
        groups: dict[tuple, list[PendingAttention]] = {}
        for pa in pending:
            groups.setdefault((pa.acc.H, pa.acc.T, pa.acc.S, pa.acc.off) + pa.wanted, []).append(pa)
        for group in groups.values():
            scores, pattern, bad = _finish([pa.acc for pa in group], *group[0].wanted)
            for i, pa in enumerate(group):
                pa.values = (None if scores is None else scores[i], None if pattern is None else pattern[i])
            for i in bad.any(1).nonzero().flatten().tolist():
                group[i].redo(bad[i])

    def redo(self, bad: torch.Tensor) -> None:
        """The exact path for the blocks holding a row in bad (T,), written into this layer's values."""
        out, keep = AttentionResult(*self.values), _Keep(AttentionView(), 0, self.rows)
        kT = self.keys.float().transpose(1, 2)
        S, off, dev = kT.shape[2], self.acc.off, self.q.device
        for b, (t0, t1) in enumerate(self.blocks):
            if bool(bad[t0:t1].any()):
                allowed = torch.arange(S, device=dev)[None, :] <= (off + torch.arange(t0, t1, device=dev))[:, None]
                _exact_block(self.q, kT, allowed, t0, t1, out, keep.block(b, t0, t1))


def _pending(qh, keys, off: int, want: AttentionView) -> PendingAttention:
    """A statistics-only layer under the causal mask (query t sees keys s <= off + t), computed up to its
    partial results."""
    (H, T, hd), K, S = qh.shape, keys.shape[0], keys.shape[1]
    blocks = query_blocks(T, S, H, off, BLOCK_ELEMENTS, MIN_ROWS)
    q = (qh.float() * hd ** -0.5).reshape(K, -1, T, hd)                     # (K, G, T, hd)
    kT = keys.float().transpose(1, 2)                                      # (K, hd, S)
    acc = _run_blocks(q, kT, H, T, S, off, blocks, _Keep(AttentionView(), 0, T), want.pattern_stats)
    return PendingAttention(acc, q, keys, blocks, want)


def _finish(accs: list["_Partials"], scores: bool, pattern: bool) -> tuple:
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


def _scores_block(q, kT, t0: int, t1: int, Sc: int, buf: torch.Tensor) -> torch.Tensor:
    """Scaled scores of query rows t0..t1 against keys 0..Sc into buf: (H, Tb, Sc)."""
    K, G, _, hd = q.shape
    Tb = t1 - t0
    X = buf[:K * G * Tb * Sc].view(K, G * Tb, Sc)
    torch.bmm(q[:, :, t0:t1].reshape(K, G * Tb, hd), kT[:, :, :Sc], out=X)
    return X.view(K * G, Tb, Sc)


def _exact_block(q, kT, allowed: torch.Tensor, t0, t1, out: AttentionResult, keep: _Keep) -> None:
    """One block materialised (H, Tb, S) and reduced by the stage statistics' own code: any mask, any value."""
    K, G, _, hd = q.shape
    Tb, S = t1 - t0, kT.shape[2]
    X = (q[:, :, t0:t1].reshape(K, G * Tb, hd) @ kT).view(K * G, Tb, S).masked_fill(~allowed, float("-inf"))
    if out.scores_stats is not None:
        out.scores_stats[t0:t1] = dense_stats(X.transpose(0, 1).reshape(Tb, -1), masked=True)
    if keep.sel_s:
        keep.kept_s[keep.b] = X[:, keep.sel_s]
    if out.pattern_stats is not None or keep.sel_p:
        pat = torch.softmax(X, dim=-1)
        if out.pattern_stats is not None:
            out.pattern_stats[t0:t1] = dense_stats(pat.transpose(0, 1).reshape(Tb, -1))
        if keep.sel_p:
            keep.kept_p[keep.b] = pat[:, keep.sel_p]


def _pad(x: torch.Tensor, S: int, fill: float) -> torch.Tensor:
    """(H, k, Sc) rows -> (H, k, S): the keys after the block's last query are masked (-inf / 0)."""
    if x.shape[-1] == S:                      # (a copy: the block's buffer is reused)
        return x.clone()
    out = x.new_full((x.shape[0], x.shape[1], S), fill)
    out[:, :, :x.shape[-1]] = x
    return out
