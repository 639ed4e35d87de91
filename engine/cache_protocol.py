"""The cache a forward attends against, declared: Cache (what the blocks ask of it) and KeyStore (where one run's keys
and values are kept). Every form the forward is handed answers Cache: a run's KVCache (engine.kv_cache), a batched
decode's Rows (engine.batch.rows), a packed prefill's Segments (engine.batch.segments), a tool's store for a span of
blocks (engine.tools.patching); the forward asks no form what it is (tests/unit/test_cache_forms.py holds each form
to the protocol, tests/unit/test_layout.py the forward to asking nothing else).

    z = cache.attend(layer, qh, k, v, p, at)      # qh (H, T, hd), k, v (T, K, hd) -> z (H, T, hd), written first
    x = x[cache.last_rows(T)]                     # the rows a last_only forward keeps logits of
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from engine.attention import Where, attend_store


@runtime_checkable
class Cache(Protocol):
    """What the forward's blocks ask of the cache they are handed."""

    def attend(self, layer: int, qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p, at: Where) -> torch.Tensor:
        """Layer `layer`: write the call's keys and values k, v (T, K, hd) where each row's run keeps them, and
        return the attention of the queries qh (H, T, hd) over what each row may read -> z (H, T, hd); p: block
        layer's probe view (offered scores and pattern), at: the call's positions and masks."""
        ...

    def last_rows(self, T: int) -> slice | list[int]:
        """Which of the call's T rows a last_only forward keeps (their logits): a run's last, or each run's."""
        ...


@runtime_checkable
class KeyStore(Protocol):
    """One run's keys and values, layer by layer."""

    def key_positions(self, layer: int, T: int) -> tuple[int, int]:
        """The positions [first, end) of the keys update() returns for T new rows."""
        ...

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (K, T, hd) after what is kept; return the keys and values (K, S, hd) at key_positions."""
        ...


class RunCache:
    """The Cache of one run's KeyStore: its rows attend against its own keys (engine.attention.attend_store), and a
    last_only forward keeps its last row."""

    def attend(self, layer: int, qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p, at: Where) -> torch.Tensor:
        return attend_store(p, qh, k, v, self, layer, at)

    def last_rows(self, T: int) -> slice:
        return slice(T - 1, T)
