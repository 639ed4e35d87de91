"""KVCache: preallocated per-run key/value storage, written in place at an explicit position.

A global-attention layer keeps every position. A sliding-window layer (Mistral, Gemma 2/3, Phi-3) keeps only its
window: a ring of `window` rows, position p in row p % window, so its memory stops growing at the window.

A KVCache is a KeyStore and the forward's Cache (engine.cache_protocol): the run's rows attend against its keys."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from engine.cache_protocol import RunCache
from engine.config import ModelConfig
from engine.errors import InputError


class KVCache(RunCache):
    def __init__(self, cfg: ModelConfig, max_len: int, device: torch.device | str, dtype: torch.dtype) -> None:
        if max_len < 1:
            raise InputError(f"KV cache length must be >= 1, got {max_len}")
        self.max_len = max_len
        self.num_layers = cfg.num_layers
        self.dtype = dtype
        # rows each layer keeps: the whole length, or its window when that is shorter
        self.rows = tuple(max_len if w is None or w >= max_len else w for w in cfg.layer_window)
        self.windows = tuple(None if r == max_len else r for r in self.rows)
        K, hd = cfg.num_kv_heads, cfg.head_dim
        if all(w is None for w in self.windows):
            # (layers, kv_heads, S, hd): each layer's slice is already SDPA's (heads, S, hd) layout; the native
            # decode step reads the two blocks whole
            shape = (cfg.num_layers, K, max_len, hd)
            self.k = torch.zeros(shape, device=device, dtype=dtype)
            self.v = torch.zeros(shape, device=device, dtype=dtype)
            self.layer_k = self.layer_v = None
        else:
            self.k = self.v = None        # no one block: layers differ in length
            self.layer_k = [torch.zeros(K, r, hd, device=device, dtype=dtype) for r in self.rows]
            self.layer_v = [torch.zeros(K, r, hd, device=device, dtype=dtype) for r in self.rows]
        self._bytes_per_row = 2 * K * hd * torch.empty(0, dtype=dtype).element_size()
        self._pos = 0
        self._scratch: dict[str, tuple] = {}

    def scratch(self, key: str, floats: int) -> torch.Tensor:
        """A float32 work buffer of at least `floats` elements that lives as long as this cache (one run's decode
        steps reuse it; engine.native's step sizes it by the cache's length)."""
        got = self._scratch.get(key)
        if got is None or got[0].numel() < floats:
            got = self._scratch[key] = (torch.empty(floats),)
        return got[0]

    def get_pos(self) -> int:
        return self._pos

    def fork(self) -> "KVCache":
        """A cache of the same length holding copies of this one's keys and values and its position: a run's prefix
        continued another way beside it (engine.tools.steering: the plain model on the steered run's tokens, from
        where the two runs part), without computing the prefix again."""
        out = copy.copy(self)
        if self.k is not None:
            out.k, out.v = self.k.clone(), self.v.clone()
        else:
            out.layer_k, out.layer_v = [t.clone() for t in self.layer_k], [t.clone() for t in self.layer_v]
        out._scratch = {}
        return out

    def copy_layers(self, src: "KVCache", layers: range) -> None:
        """Layers `layers` of src (a cache of the same model, length and dtype) copied into this one, every row: the
        keys and values of a prefix two runs compute alike up to a layer (engine.tools.steering: the steered prompt
        is the plain one up to the layer its vector is added after). The position is not moved."""
        if (src.max_len, src.rows, src.dtype) != (self.max_len, self.rows, self.dtype):
            raise InputError("copy_layers needs a cache of the same length, layers and dtype")
        for i in layers:
            if self.k is not None:
                self.k[i].copy_(src.k[i])
                self.v[i].copy_(src.v[i])
            else:
                self.layer_k[i].copy_(src.layer_k[i])
                self.layer_v[i].copy_(src.layer_v[i])

    def advance(self, n: int) -> None:
        self._pos += n

    def check_room(self, n: int) -> None:
        if self._pos + n > self.max_len:
            raise InputError(f"KV cache full: {self._pos} positions used + {n} new > {self.max_len} allocated")

    def key_positions(self, layer: int, T: int, pos: int | None = None) -> tuple[int, int]:
        """The positions [first, end) of the keys update() returns for T new rows at pos (default: the current
        position): a window layer's are the window - 1 positions before pos that it kept, then the new ones."""
        pos = self._pos if pos is None else pos
        w = self.windows[layer]
        if w is None or pos + T <= w:
            return 0, pos + T
        return pos - min(pos, w - 1), pos + T

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (kv_heads, T, hd) at the current position; return this layer's keys and values
        (kv_heads, S, hd) at key_positions(layer, T): every position up to the new ones, or for a window layer
        the rows its window reaches from the first new row."""
        T, pos, w = k.shape[1], self._pos, self.windows[layer]
        if self.k is not None:      # indexed afresh each call (a view kept from before is not writable under autograd)
            ck, cv = self.k[layer], self.v[layer]
        else:
            ck, cv = self.layer_k[layer], self.layer_v[layer]
        if w is None or pos + T <= w:        # no ring turn yet: rows are positions
            ck[:, pos:pos + T] = k
            cv[:, pos:pos + T] = v
            return ck[:, :pos + T], cv[:, :pos + T]
        first = pos - min(pos, w - 1)
        rows = torch.arange(first, pos, device=ck.device) % w
        keys = torch.cat([ck[:, rows], k], dim=1)
        values = torch.cat([cv[:, rows], v], dim=1)
        keep = min(T, w)                         # only the last window's rows stay
        slots = torch.arange(pos + T - keep, pos + T, device=ck.device) % w
        ck[:, slots] = k[:, T - keep:]
        cv[:, slots] = v[:, T - keep:]
        return keys, values

    @property
    def bytes_per_token(self) -> int:
        """K and V, every layer, one position (what a global layer adds per token; a full window layer adds
        nothing): 2 * layers * kv_heads * head_dim * element size."""
        return self._bytes_per_row * self.num_layers

    @property
    def bytes_allocated(self) -> int:
        return self._bytes_per_row * sum(self.rows)

    @property
    def bytes_used(self) -> int:
        return self._bytes_per_row * sum(min(self._pos, r) for r in self.rows)

    def layer_bytes(self) -> list[tuple[int, int]]:
        """Per layer: (bytes allocated, bytes used)."""
        return [(self._bytes_per_row * r, self._bytes_per_row * min(self._pos, r)) for r in self.rows]


@dataclass(frozen=True)
class ReleasedCache:
    """What a finished run still reads of its KV cache (the figures its record reports) once the cache's
    tensors are given back: a session keeps a finished debugger run for its pages, not its cache."""
    bytes_allocated: int
    bytes_used: int
    bytes_per_token: int
    pos: int

    def get_pos(self) -> int:
        return self.pos
