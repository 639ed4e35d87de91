"""The native statistics backend (engine.inspection.row_stats: NATIVE): the statistics of a multi-token forward
in one pass each (inspect.c; the per-row kernel rowstat.h is the one decode.c uses too). It takes float32 CPU
tensors whose last dim is contiguous and declines the rows holding a NaN or Inf (the reference statistics,
engine.inspection.reference_stats, then count them; the other rows' values stand); engine.accelerator chains it before the PyTorch backend,
which takes what it has no kernel for (masked stages, other dtypes)."""
from __future__ import annotations

import torch

from engine.inspection.row_stats import Alloc, StatsBackend, StatsQueue
from engine.inspection.stat_sources import Given
from engine.native import build


def _lib():
    return build.load()[0]


def layout(X: torch.Tensor) -> tuple | None:
    """(T, G, n, row stride, group stride) of a float32 CPU tensor (T, n) or (T, G, n) whose last dim is
    contiguous; None for anything else. (Called for every stage a probe takes statistics of: kept lean.)"""
    if X.dtype is not torch.float32 or X.device.type != "cpu" or X.requires_grad:
        return None
    shape, stride = X.shape, X.stride()
    if len(shape) == 2 and stride[1] == 1 and shape[0] and shape[1]:
        return shape[0], 1, shape[1], stride[0], 0
    if len(shape) == 3 and stride[2] == 1 and shape[0] and shape[1] and shape[2]:
        return shape[0], shape[1], shape[2], stride[0], stride[1]
    return None


def _empty(rows: int) -> torch.Tensor:
    return torch.empty(rows, 7)


def row_stats(xs: list[torch.Tensor], alloc=_empty, lays: list[tuple] | None = None
              ) -> list[torch.Tensor | None] | None:
    """Tensors (T, n) or (T, G, n) -> for each, its (T, 7) statistics per row (inspection.stat_columns.Col), or None
    for one holding a NaN or Inf (the PyTorch path counts those); None for all when the library is missing.
    Every tensor must have layout() (float32 on the CPU, last dim contiguous). alloc(rows) gives the (rows, 7)
    float32 tensor the results are written to (engine.inspection.stats.StatsBatcher.rows_out: one arena, see there);
    lays: the tensors' layout() when the caller has them."""
    got = row_stats_rows(xs, alloc, lays)
    return None if got is None else [None if bad is not None else v for v, bad in got]


def row_stats_rows(xs: list[torch.Tensor], alloc=_empty, lays: list[tuple] | None = None
                   ) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
    """row_stats, row by row: for each tensor (its (T, 7) statistics, None or a (T,) bool of the rows holding a NaN
    or Inf, whose values are not given); None when the library is missing."""
    lib = _lib()
    if lib is None:
        return None
    lays = lays or [layout(x) for x in xs]
    desc = torch.tensor([[x.data_ptr(), *lay] for x, lay in zip(xs, lays)], dtype=torch.long)
    counts = [lay[0] for lay in lays]
    out = alloc(sum(counts))
    bad = torch.zeros(sum(counts), dtype=torch.int32)
    lib.llmi_row_stats_many(len(xs), desc.data_ptr(), out.data_ptr(), bad.data_ptr(), torch.get_num_threads())
    return [(v, b.bool() if bool(b.any()) else None) for v, b in zip(out.split(counts), bad.split(counts))]


def attention_stats(qh: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, off: int, scores: bool,
                    pattern: bool, alloc=_empty) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """qh (H, T, hd), keys (K, S, hd) float32 on the CPU; query t sees keys s <= off + t -> (T, 7) statistics
    of the scores (masked entries left out) and of the pattern over (heads × S). None: not here, or a score
    or a value (K, S, hd) is not finite (the exact path counts those); otherwise q, keys and values are all
    finite."""
    if qh.device.type != "cpu" or qh.dtype != torch.float32 or keys.dtype != torch.float32 \
            or values.dtype != torch.float32 or qh.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1 \
            or qh.requires_grad:
        return None
    lib = _lib()
    if lib is None:
        return None
    H, T, hd = qh.shape
    K, S = keys.shape[0], keys.shape[1]
    nth = torch.get_num_threads()
    out_s = alloc(T) if scores else None
    out_p = alloc(T) if pattern else None
    work = torch.empty(lib.llmi_attention_work_floats(H, K, T, S, hd, nth))
    bad = lib.llmi_attention_stats(H, K, T, S, hd, off, hd ** -0.5, qh.data_ptr(), qh.stride(0), qh.stride(1),
                                   keys.data_ptr(), keys.stride(0), keys.stride(1),
                                   values.data_ptr(), values.stride(0), values.stride(1),
                                   None if out_s is None else out_s.data_ptr(),
                                   None if out_p is None else out_p.data_ptr(), work.data_ptr(), nth)
    return None if bad else (out_s, out_p)


def attention_source(qh: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None, off: int | None, want,
                     alloc: Alloc = _empty) -> Given | None:
    """attention_stats of a causal layer (off: engine.inspection.attention_blocks.causal_offset, None for another
    mask) as a source of the stages' statistics (want: an AttentionView), results in alloc's tensors. None: not
    done here; otherwise q, keys and values proved finite."""
    if off is None or values is None:
        return None
    got = attention_stats(qh, keys, values, off, want.scores_stats, want.pattern_stats, alloc)
    return None if got is None else Given([v for v in got if v is not None])


BACKEND_BYTES = 8 << 20   # tensors are queued until the storage the queue keeps alive reaches this, for one native
                          # call giving their statistics (a layer's stages still in the last-level cache)


class _NativeQueue(StatsQueue):
    """One batcher's native queue: float32 CPU tensors, run in one call per BACKEND_BYTES of them (or at a cut:
    a replace hook may change them in place)."""

    def __init__(self, alloc: Alloc) -> None:
        self._alloc = alloc
        self._queue: list[tuple] = []      # (entry, x, layout) waiting for _run
        self._bytes = 0
        self._entries: list[int] = []
        self._values: list[torch.Tensor | None] = []
        self._declined: list[tuple] = []

    def add(self, entry: int, x: torch.Tensor, masked: bool) -> int | None:
        x2 = x if x.dim() > 1 else x.reshape(1, -1)
        lay = None if masked else layout(x2)
        if lay is None:
            return None
        self._queue.append((entry, x2, lay))
        self._bytes += 8 * x.numel()       # what the queue keeps alive: a view's base (q of qkv, gate of gate_up)
        if self._bytes >= BACKEND_BYTES:   # is about twice the view
            self._run()
        return 0

    def cut(self) -> None:
        if self._queue:
            self._run()

    def _run(self) -> None:
        queue, self._queue, self._bytes = self._queue, [], 0
        got = row_stats_rows([q[1] for q in queue], self._alloc, [q[2] for q in queue])
        for i, (entry, x, _) in enumerate(queue):
            v, bad = (None, None) if got is None else got[i]
            if v is None or bad is not None:      # the rows holding a NaN or Inf only (the others' values stand)
                self._declined.append((len(self._values), x, False, bad))
            self._entries.append(entry)
            self._values.append(v)

    def finish(self, T: int) -> list[tuple]:
        if self._queue:
            self._run()
        if not self._entries:
            return []
        block = (self._entries, self._values, self._declined)
        self._entries, self._values, self._declined = [], [], []
        return [block]


class _Native(StatsBackend):
    name = "native"

    def queue(self, alloc: Alloc) -> StatsQueue:
        return _NativeQueue(alloc)

    def attention(self, qh, keys, values, mask, off, want, alloc):
        return attention_source(qh, keys, values, off, want, alloc)


NATIVE: StatsBackend = _Native()
