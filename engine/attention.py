"""Attention for one block: the call's positions (which rotary table, which mask each layer reads), and the one
attention function every caller computes with (attend: the model's blocks through their cache, the batch's rows, a
packed prefill's runs), with its two paths, the fused one (torch SDPA) and the explicit one (scores and pattern as
tensors, offered to the probe). The explicit path's arithmetic (attention_scores: scale, soft cap, mask, GQA; the
softmax; pattern @ V) is engine.attention_math's, which the batch's padded rows, the blocked statistics and the
Attention view's entropy overview also compute with.

    z = attend(p, qh, keys, values, mask, first, scale=cfg.attn_scale, softcap=cfg.attn_softcap)    # (H, T, hd)
    z = attend_store(p, qh, k, v, store, layer, at)       # the same, the keys first written to a run's store
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention_math import attention_output, attention_scores, score_queries, softmax_pattern
from engine.inspection.attention_stats import inspect_attention
from engine.inspection.probe_views import FULL
from engine.rope import RopeTables, table_for


class Mask:
    """A call's attention mask, made once and read by every layer of its kind: allowed (T, S) bool, True where query
    row t reads key s, and its additive form for SDPA (0 or -inf, made once per dtype). The CPU kernel takes the
    additive mask at about the cost of an unmasked call, where a boolean one costs ~1.5x (converted per call)."""

    __slots__ = ("allowed", "_bias")

    def __init__(self, allowed: torch.Tensor) -> None:
        self.allowed = allowed
        self._bias: dict[torch.dtype, torch.Tensor] = {}

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        b = self._bias.get(dtype)
        if b is None:
            b = self._bias[dtype] = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device) \
                .masked_fill_(~self.allowed, float("-inf"))
        return b


class Where:
    """The positions one forward call computes: rows (T,) absolute, the rotary tables at those rows (one per kind a
    layer reads), and the mask each layer's keys need, made once per kind and shared by the layers.

    Keys of a global layer are positions 0 .. end - 1 (or, in run_blocks, what its cache holds); a window layer's
    are the cache's key_positions. base (T, S) or None: a caller's mask over global keys (None: causal)."""

    def __init__(self, cfg, tables: dict, rows: torch.Tensor, base: torch.Tensor | None = None,
                 contiguous: bool = True) -> None:
        self.cfg, self.rows, self.T = cfg, rows, rows.shape[0]
        self.end = int(rows.max()) + 1 if contiguous else None
        end = self.end if self.end is not None else int(rows.max()) + 1
        if isinstance(tables, RopeTables):
            tables.ensure(end)           # the model's tables, grown to this call's last position
        self._rope = {k: (c[rows], s[rows]) if not contiguous else (c[int(rows[0]):end], s[int(rows[0]):end])
                      for k, (c, s) in tables.items()}
        self._base = base
        self._masks: dict = {}

    def rope(self, kind: str):
        return self._rope[table_for(self.cfg, kind, self.end or 0)]

    def mask(self, window: int | None, first: int, S: int) -> Mask | None:
        """The mask over S keys at positions first .. first + S - 1 (None: plain causal with S == T, or one row
        that reads every key)."""
        key = (window, first, S)
        if key in self._masks:
            return self._masks[key]
        rows = self.rows
        if self._base is not None and window is None:
            m = Mask(self._base)
        elif window is None and (self.T == 1 or (first == 0 and S == self.T and self.end == self.T)):
            m = None
        else:
            allowed = allowed_keys(rows, first, S, window)
            if self._base is not None:
                allowed &= self._base[:, first:first + S] if self._base.shape[1] >= first + S else self._base
            m = None if self.T == 1 and bool(allowed.all()) else Mask(allowed)
        self._masks[key] = m
        return m


def allowed_keys(rows: torch.Tensor, first: int, S: int, window: int | None) -> torch.Tensor:
    """(T, S) bool: True where the query at absolute position rows[t] reads the key at position first + s: causal,
    and within a window layer's `window` latest positions (the query's own included)."""
    kpos = first + torch.arange(S, device=rows.device)
    allowed = kpos[None, :] <= rows[:, None]
    if window is not None:
        allowed &= kpos[None, :] > rows[:, None] - window
    return allowed


def attend(p, qh: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Mask | None, first: int = 0, *,
           scale: float, softcap: float | None = None) -> torch.Tensor:
    """The one attention of the engine: queries qh (H, T, hd) over keys and values (K, S, hd) at positions first ..
    first + S - 1 (a window layer's kept keys start at first > 0), mask (None: causal with S == T, or one row that
    reads every key) -> z (H, T, hd). p, the block's probe view, is offered scores and pattern where it asks.
    Explicit (scores and pattern as tensors) for one query row, a probe that needs them whole, or a soft cap (which
    SDPA cannot do); otherwise fused, with statistics beside it where the probe asks only for those."""
    need = max(p.need("attn.scores"), p.need("attn.pattern"))
    if qh.shape[1] == 1 or need == FULL or softcap is not None:
        return explicit(qh, keys, values, p, None if mask is None else mask.allowed, scale, softcap, first)
    if need:      # statistics / some rows only: beside the fused kernel (query blocks or native), never whole
        _inspect(p, qh, keys, values, mask, first, scale)
    return fused(qh, keys, values, mask, p.guards_nan, scale, keys.shape[0] != qh.shape[0])   # stats steer nothing


def attend_store(p, qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store, layer: int, at: Where) -> torch.Tensor:
    """Layer `layer`'s attention of one run's rows against its store (engine.cache_protocol.KeyStore: a KVCache),
    the call's keys and values k, v (T, K, hd) written there first: qh (H, T, hd) -> z (H, T, hd), with the layer's
    window, the family's scale and soft cap, at the positions and masks of `at`."""
    cfg = at.cfg
    first, _ = store.key_positions(layer, qh.shape[1])
    keys, values = store.update(layer, k.transpose(0, 1), v.transpose(0, 1))     # (K, S, hd)
    keys, values = keys.to(qh.dtype), values.to(qh.dtype)      # no-ops unless a precision plan differs
    mask = at.mask(cfg.layer_window[layer], first, keys.shape[1])
    return attend(p, qh, keys, values, mask, first, scale=cfg.attn_scale, softcap=cfg.attn_softcap)


def _inspect(p, qh, keys, values, mask: Mask | None, first: int, scale: float) -> None:
    """Attention statistics beside the fused kernel, over every position as the explicit path offers them: the
    query scaled to the family's score scale, a window layer's keys preceded by the positions it dropped."""
    qh = score_queries(qh, scale)
    allowed = None if mask is None else mask.allowed
    if first:
        K, S, hd = keys.shape
        if allowed is None:
            allowed = torch.ones(qh.shape[1], S, dtype=torch.bool, device=qh.device)
        keys = torch.cat([keys.new_zeros(K, first, hd), keys], dim=1)
        values = torch.cat([values.new_zeros(K, first, hd), values], dim=1)
        allowed = F.pad(allowed, (first, 0), value=False)
    inspect_attention(p, qh, keys, allowed, values)


def fused(qh, keys, values, mask: Mask | None, guard: bool, scale: float, gqa: bool) -> torch.Tensor:
    """Several query positions: torch SDPA (flash attention where available). (H, T, hd) out. guard (a probe is
    watching): non-finite values must reach exactly the rows that read them, as in the explicit path. The kernels
    do not promise that (a masked weight 0 times a NaN value is NaN; the CPU kernel returns 0 for a NaN query
    under is_causal), so non-finite queries, keys and values are zeroed for the kernel and the rows that read them
    are set to NaN afterwards."""
    bad = None
    # CPU: a finite sum proves every value finite (three cheap reductions); the device skips the check
    if guard and (qh.device.type != "cpu" or not bool(torch.isfinite(qh.sum() + keys.sum() + values.sum()))):
        bad_q, bad_k = ~torch.isfinite(qh).all(-1, keepdim=True), ~torch.isfinite(keys).all(-1, keepdim=True)
        bad_v = ~torch.isfinite(values)                                    # (H, T, 1), (K, S, 1), (K, S, hd)
        bad = (bad_q, bad_k | bad_v)
        qh, keys, values = qh.masked_fill(bad_q, 0.0), keys.masked_fill(bad_k, 0.0), values.masked_fill(bad_v, 0.0)
    if keys.requires_grad or values.requires_grad:    # a gradient forward: autograd keeps what SDPA reads, and
        keys, values = keys.clone(), values.clone()   # later layers write the cache these views are of
    default = scale == qh.shape[-1] ** -0.5
    z = F.scaled_dot_product_attention(qh[None], keys[None], values[None], enable_gqa=gqa, is_causal=mask is None,
                                       attn_mask=None if mask is None else mask.bias(qh.dtype),
                                       scale=None if default else scale)[0]
    return z if bad is None else _poison_readers(z, bad[0], bad[1], None if mask is None else mask.allowed)


def _poison_readers(z, bad_q, bad_kv, mask) -> torch.Tensor:
    """z (H, T, hd) with NaN in rows whose query is not finite (bad_q (H, T, 1)), and where a row attends
    to a position whose key (any dim) or value (that dim) is not finite (bad_kv (K, S, hd))."""
    (H, T, hd), (K, S) = z.shape, bad_kv.shape[:2]
    if mask is None:              # causal: row t reads positions 0 .. S - T + t
        seen = bad_kv.cumsum(1, dtype=torch.int32)[:, S - T:] > 0                      # (K, T, hd)
    else:
        seen = (mask.to(z.dtype) @ bad_kv.to(z.dtype)) > 0                             # (K, T, hd)
    seen = seen[:, None].expand(K, H // K, T, hd).reshape(H, T, hd)
    return z.masked_fill(seen | bad_q, float("nan"))


def explicit(qh, keys, values, p, mask, scale: float, softcap: float | None, first: int = 0) -> torch.Tensor:
    """Attention with scores and pattern as tensors: one decode row (the usual path: two grouped matmuls beat SDPA's
    kernels at this size), a hook that needs them whole, or a soft cap (Gemma 2: tanh(s / cap) * cap before the mask,
    which SDPA cannot do). (H, T, hd) out, the scores those of attention_scores (GQA without copies of the cache).
    first > 0 (a window layer's kept keys start there): the probe sees scores and pattern over every position
    0 .. S - 1, -inf and 0 before the window, as for any layer."""
    T, S = qh.shape[1], keys.shape[1]
    allowed = mask
    if T > 1 and mask is None:
        allowed = torch.ones(T, S, dtype=torch.bool, device=qh.device).tril()
    scores = attention_scores(qh, keys, scale, softcap, allowed)                         # (H, T, S)
    pad = first if first and max(p.need("attn.scores"), p.need("attn.pattern")) else 0
    if pad:
        scores = F.pad(scores, (pad, 0), value=float("-inf"))
    scores = p("attn.scores", scores)
    pattern = p("attn.pattern", softmax_pattern(scores, qh.dtype))
    return attention_output(pattern[..., pad:], values)                                  # (H, T, hd)
