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
pending_source is the PyTorch statistics backend's attention method, exact_source the reference's
(engine.inspection.row_stats; the native backend's runs in engine/native/inspect.c): each returns a source of
statistics (engine.inspection.stats) that inspect_attention hands to the layer's probe view once, and the view
to the batcher's one door. The blocks and workspace live in engine.inspection.attention_blocks, the causal
partial results in engine.inspection.attention_partials.
"""
from __future__ import annotations

import torch

from engine.attention_math import scaled_queries
from engine.inspection.attention_blocks import (
    BLOCK_ELEMENTS,
    MIN_ROWS,
    AttentionResult,
    AttentionView,
    Keep,
    causal_offset,
    exact_block,
    query_blocks,
)
from engine.inspection.attention_partials import finish_partials, pending_attention, run_blocks
from engine.inspection.stages import ATTENTION_MAPS
from engine.inspection.stat_sources import Given


def inspect_attention(p, qh: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, values=None) -> None:
    """Offer a layer's attention scores and pattern to its probe view p as statistics and/or captured rows,
    as far as p needs them short of the whole tensors (engine.inspection.probe_views: STATS or ROWS). Statistics
    alone: a source from the probe's statistics backend (engine.inspection.row_stats), or the reference's
    (exact_source) when it declines; with captured rows, attention_view."""
    want = AttentionView(p.wants_stats("attn.scores"), p.wants_stats("attn.pattern"),
                         p.capture_positions("attn.scores"), p.capture_positions("attn.pattern"))
    if not want:
        return None
    T = qh.shape[1]
    if want.scores_rows is None and want.pattern_rows is None:
        off = causal_offset(mask, T, keys.shape[1])
        probe = p.probe
        source = probe.stats_backend.attention(qh, keys, values, mask, off, want, probe.stats_batcher.rows_out)
        p.offer_stats(wanted_stages(want), source if source is not None else exact_source(qh, keys, mask, want))
        return
    res = attention_view(qh, keys, mask, p.pos0, want)
    given = [v for v in (res.scores_stats, res.pattern_stats) if v is not None]
    if given:
        p.offer_stats(wanted_stages(want), Given(given))
    for stage, rows, wanted in (("attn.scores", res.scores_rows, want.scores_rows),
                                ("attn.pattern", res.pattern_rows, want.pattern_rows)):
        if rows is not None:
            p.offer_rows(stage, rows, [t for t in wanted if p.pos0 <= t < p.pos0 + T])


def wanted_stages(want: AttentionView) -> list[str]:
    """The stages whose statistics want asks for, in forward order."""
    return [s for s, w in zip(ATTENTION_MAPS, (want.scores_stats, want.pattern_stats)) if w]


def pending_source(qh: torch.Tensor, keys: torch.Tensor, off: int | None, want: AttentionView):
    """The PyTorch backend's attention statistics: a causal layer (off not None) computed up to its partial
    results, a PendingAttention the batcher combines for all layers at its flush (no host round trip per layer;
    rows the partial results cannot give exactly take the exact path there). None: another mask."""
    if off is None:
        return None
    with torch.no_grad():
        return pending_attention(qh.detach(), keys.detach(), off, want)


def exact_source(qh: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, want: AttentionView) -> Given:
    """The reference's attention statistics: every block materialised and reduced by dense_stats, any mask."""
    res = attention_view(qh, keys, mask, 0, AttentionView(want.scores_stats, want.pattern_stats), exact=True)
    return Given([v for v in (res.scores_stats, res.pattern_stats) if v is not None])


def attention_view(qh: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, pos0: int,
                   want: AttentionView, block_elements: int = BLOCK_ELEMENTS, min_rows: int = MIN_ROWS,
                   exact: bool = False) -> AttentionResult:
    """qh (H, T, hd) rotated queries, keys (K, S, hd), mask None (causal) or bool (T, S) allowed.

    Returns per-position statistics (T, 7) of the scores (-inf mask entries left out) and of the pattern,
    and the rows asked for, in blocks of about block_elements score elements (and at least min_rows rows).
    exact: every block materialised (the reference), also under the causal mask."""
    with torch.no_grad():        # statistics are observations: never part of a gradient (grad=True forwards)
        return _view(qh.detach(), keys.detach(), mask, pos0, want, block_elements, min_rows, exact)


def _view(qh, keys, mask, pos0: int, want: AttentionView, block_elements: int,
                    min_rows: int, exact_only: bool) -> AttentionResult:
    (H, T, hd), K, S = qh.shape, keys.shape[0], keys.shape[1]
    off = causal_offset(mask, T, S)
    blocks = query_blocks(T, S, H, off, block_elements, min_rows)
    q = scaled_queries(qh).reshape(K, -1, T, hd)                            # (K, G, T, hd)
    kT = keys.float().transpose(1, 2)                                      # (K, hd, S)
    out = AttentionResult(torch.empty(T, 7, device=qh.device) if want.scores_stats else None,
                          torch.empty(T, 7, device=qh.device) if want.pattern_stats else None)
    keep, exact = Keep(want, pos0, T), blocks
    if off is not None and not exact_only:
        acc = run_blocks(q, kT, H, T, S, off, blocks, keep, want.pattern_stats)
        scores, pattern, bad = finish_partials([acc], want.scores_stats, want.pattern_stats)
        out.scores_stats = None if scores is None else scores[0]
        out.pattern_stats = None if pattern is None else pattern[0]
        bad = bad[0]                                                        # (T,) rows for the exact path
        exact = [(t0, t1) for t0, t1 in blocks if bool(bad[t0:t1].any())] if bool(bad.any()) else []
    for t0, t1 in exact:
        allowed = mask[t0:t1] if off is None else \
            torch.arange(S, device=qh.device)[None, :] <= (off + torch.arange(t0, t1, device=qh.device))[:, None]
        exact_block(q, kT, allowed, t0, t1, out, keep.block(blocks.index((t0, t1)), t0, t1))
    out.scores_rows, out.pattern_rows = keep.result(H, S, qh.device)
    return out
