"""The why-loop's memory of forwards its probe-less reruns have in common (engine.tools.why_loop)."""
from __future__ import annotations

import weakref

import torch

from engine.inspection.probe import Probe
from engine.kv_cache import KVCache
from engine.model import Model


class SharedForwards:
    """The model as the probe-less reruns of one why-loop see it: a forward already computed for the same tokens
    (the same prompt, then the same tokens drawn) is answered from memory, its logits and its KV cache rows
    written into the rerun's cache (KVCache.update), instead of being run again. The sampler reruns draw the
    baseline's tokens until their change first picks another one, so they share the baseline's prefill and
    every step up to there; a rerun that keeps the loop often runs no forward at all. The answer is the one the
    forward gave for that same context and cache content: the rerun's tokens and text are those of a fresh run.
    Anything else (a probe, other arguments) runs the model's forward."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self._fed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()     # cache -> token ids fed so far
        self._memo: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.computed = self.answered = 0          # forwards run / answered from memory (positions)

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def new_cache(self, max_len: int) -> KVCache:
        cache = self.model.new_cache(max_len)
        self._fed[cache] = []
        return cache

    def forward(self, ids: torch.Tensor, cache: KVCache, probe: Probe | None = None, *, last_only: bool = False,
                **kwargs) -> torch.Tensor:
        fed = self._fed.get(cache)
        # a cache with window rings keeps no rows by position to copy: those runs compute every step
        if probe is not None or any(v is not None for v in kwargs.values()) or not last_only or fed is None \
                or cache.k is None:
            self._fed.pop(cache, None)               # this cache's rows are no longer the memo's to answer
            return self.model.forward(ids, cache, probe, last_only=last_only, **kwargs)
        new = [int(i) for i in ids.tolist()]
        key, pos, T = (*fed, *new), cache.get_pos(), len(new)
        fed.extend(new)
        if key in self._memo:
            logits, k, v = self._memo[key]
            cache.check_room(T)
            for layer in range(k.shape[0]):
                cache.update(layer, k[layer], v[layer])
            cache.advance(T)
            self.answered += T
            return logits.clone()
        logits = self.model.forward(ids, cache, None, last_only=True)
        self._memo[key] = (logits.clone(), cache.k[:, :, pos:pos + T].clone(), cache.v[:, :, pos:pos + T].clone())
        self.computed += T
        return logits
