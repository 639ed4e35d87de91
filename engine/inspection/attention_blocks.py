"""The blocks attention statistics are computed in (engine.inspection.attention_stats): what a probe asks of a
layer's attention (AttentionView) and gets (AttentionResult), the per-thread workspace, the causal mask test,
query blocks, rows kept for captures (Keep), and one block materialised and reduced exactly (exact_block)."""
from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass

import torch

from engine.attention_math import attention_scores, softmax_pattern
from engine.inspection.reference_stats import dense_stats

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


def workspace(n: int, m: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat buffers of at least n (a block's scores) and m (its diagonal tile) elements, kept per thread so
    no layer allocates its own."""
    ws = getattr(_local, "ws", None)
    if ws is None or ws[0].numel() < n or ws[1].numel() < m or ws[0].device != device or ws[0].dtype != dtype:
        n, m = max(n, 0 if ws is None else ws[0].numel()), max(m, 0 if ws is None else ws[1].numel())
        with torch.inference_mode(False):        # ordinary tensors: usable inside and outside inference mode
            ws = _local.ws = (torch.empty(n, device=device, dtype=dtype), torch.empty(m, device=device, dtype=dtype))
    return ws


def diagonal_tiles(rows: int, device) -> tuple:
    """The diagonal tile's mask as tiles to add or multiply (a block of Tb rows uses the top-left Tb × Tb):
    keys after the query get +inf (min), 0 (sums) or -inf (max, softmax), kept per thread. Masks are applied by
    add/mul: masked_fill is 10x slower."""
    tiles = getattr(_local, "tiles", None)
    if tiles is None or tiles[0].shape[0] < rows or tiles[0].device != device:
        upper = torch.ones(rows, rows, dtype=torch.bool, device=device).triu_(1)
        zero = torch.zeros(rows, rows, device=device)
        with torch.inference_mode(False):
            tiles = _local.tiles = (zero.masked_fill(upper, float("inf")), (~upper).float(),
                                    zero.masked_fill(upper, float("-inf")))
    return tiles


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


class Keep:
    """Rows some capture keeps, by block: which rows of a block, and what was kept there (a redone block
    replaces its rows)."""

    def __init__(self, want: AttentionView, pos0: int, T: int) -> None:
        self.want = want
        self.all_s = sorted(p - pos0 for p in set(want.scores_rows or ()) if 0 <= p - pos0 < T)
        self.all_p = sorted(p - pos0 for p in set(want.pattern_rows or ()) if 0 <= p - pos0 < T)
        self.kept_s: dict[int, torch.Tensor] = {}     # block -> its kept rows
        self.kept_p: dict[int, torch.Tensor] = {}
        self.sel_s, self.sel_p, self.b = [], [], 0

    def block(self, b: int, t0: int, t1: int) -> "Keep":
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


def scores_block(q, kT, t0: int, t1: int, Sc: int, buf: torch.Tensor) -> torch.Tensor:
    """Scaled scores of query rows t0..t1 against keys 0..Sc into buf: (H, Tb, Sc). q is in score units
    (engine.attention_math.scaled_queries), so the product written into the workspace is the score; no mask (the
    caller's tiles add it)."""
    K, G, _, hd = q.shape
    Tb = t1 - t0
    X = buf[:K * G * Tb * Sc].view(K, G * Tb, Sc)
    torch.bmm(q[:, :, t0:t1].reshape(K, G * Tb, hd), kT[:, :, :Sc], out=X)
    return X.view(K * G, Tb, Sc)


def exact_block(q, kT, allowed: torch.Tensor, t0, t1, out: AttentionResult, keep: Keep) -> None:
    """One block materialised (H, Tb, S) and reduced by the stage statistics' own code: any mask, any value."""
    K, G, Tb = q.shape[0], q.shape[1], t1 - t0
    X = attention_scores(q[:, :, t0:t1].reshape(K * G, Tb, -1), kT.transpose(1, 2), None, None, allowed)  # (H, Tb, S)
    if out.scores_stats is not None:
        out.scores_stats[t0:t1] = dense_stats(X.transpose(0, 1).reshape(Tb, -1), masked=True)
    if keep.sel_s:
        keep.kept_s[keep.b] = X[:, keep.sel_s]
    if out.pattern_stats is not None or keep.sel_p:
        pat = softmax_pattern(X)
        if out.pattern_stats is not None:
            out.pattern_stats[t0:t1] = dense_stats(pat.transpose(0, 1).reshape(Tb, -1))
        if keep.sel_p:
            keep.kept_p[keep.b] = pat[:, keep.sel_p]


def pad_rows(x: torch.Tensor, S: int, fill: float) -> torch.Tensor:
    """(H, k, Sc) rows -> (H, k, S): the keys after the block's last query are masked (-inf / 0)."""
    if x.shape[-1] == S:                      # (a copy: the block's buffer is reused)
        return x.clone()
    out = x.new_full((x.shape[0], x.shape[1], S), fill)
    out[:, :, :x.shape[-1]] = x
    return out
