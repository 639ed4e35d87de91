"""KVCache: preallocated per-run key/value storage, written in place at an explicit position."""
from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.errors import InputError


class KVCache:
    def __init__(self, cfg: ModelConfig, max_len: int, device: torch.device | str, dtype: torch.dtype) -> None:
        if max_len < 1:
            raise InputError(f"KV cache length must be >= 1, got {max_len}")
        self.max_len = max_len
        self.num_layers = cfg.num_layers
        self.dtype = dtype
        # (layers, kv_heads, S, hd): each layer's slice is already SDPA's (heads, S, hd) layout
        shape = (cfg.num_layers, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
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

    def advance(self, n: int) -> None:
        self._pos += n

    def check_room(self, n: int) -> None:
        if self._pos + n > self.max_len:
            raise InputError(f"KV cache full: {self._pos} positions used + {n} new > {self.max_len} allocated")

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (kv_heads, T, hd) at the current position; return this layer's (kv_heads, S, hd) views."""
        end = self._pos + k.shape[1]
        self.k[layer, :, self._pos:end] = k
        self.v[layer, :, self._pos:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    @property
    def bytes_per_token(self) -> int:
        """K and V, every layer, one position: 2 * layers * kv_heads * head_dim * element size."""
        _, heads, _, hd = self.k.shape[0], self.k.shape[1], self.k.shape[2], self.k.shape[3]
        return 2 * self.num_layers * heads * hd * self.k.element_size()

    @property
    def bytes_allocated(self) -> int:
        return self.bytes_per_token * self.max_len

    @property
    def bytes_used(self) -> int:
        return self.bytes_per_token * self._pos
