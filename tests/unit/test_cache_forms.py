"""The forward's declared interfaces (engine.cache_protocol, engine.inspection.stage_sink): every cache form the
forward is handed is a Cache, every probe form a RunSink or a BlockSink, and a cache that only declares the protocol
(no KVCache, no batch) runs the forward to the plain forward's logits, bit for bit."""
from __future__ import annotations

import pytest
import torch

from engine.batch.rows import FanProbe, Rows
from engine.batch.segments import SegmentProbe, Segments
from engine.cache_protocol import Cache, KeyStore, RunCache
from engine.inspection.probe import Probe
from engine.inspection.probe_views import NO_PROBE
from engine.inspection.stage_sink import BlockSink, RunSink, StageSink
from engine.kv_cache import KVCache
from engine.tools.patching import PrefixKV

pytestmark = pytest.mark.unit


def test_every_cache_form_is_a_cache(tiny_model):
    caches = [tiny_model.new_cache(8), tiny_model.new_cache(8)]
    seg_probe = SegmentProbe([Probe(), None], [3, 2], [0, 0])
    k = torch.zeros(tiny_model.config.num_kv_heads, 2, tiny_model.config.head_dim)
    forms = [caches[0], Rows(tiny_model, caches, [0, 0]), Segments(tiny_model, caches, seg_probe, [None, None]),
             PrefixKV(k, k)]
    assert [type(f).__name__ for f in forms if not isinstance(f, Cache)] == []
    assert isinstance(caches[0], KeyStore) and isinstance(forms[-1], KeyStore)
    # the protocol is not met by a store that only writes keys (what run_blocks took before: update() alone)
    class UpdateOnly:
        def update(self, layer, k, v):
            return k, v
    assert not isinstance(UpdateOnly(), Cache) and not isinstance(UpdateOnly(), KeyStore)


def test_every_probe_form_is_a_sink(tiny_model):
    probe = Probe().record_stats("*")
    fan = FanProbe([probe, None], [3, 4])
    seg = SegmentProbe([Probe(), None], [3, 2], [0, 0])
    runs = [probe, NO_PROBE, fan, seg]
    blocks = [probe.layer(0), NO_PROBE, fan.layer(0), seg.layer(1)]
    assert [type(f).__name__ for f in runs if not isinstance(f, RunSink)] == []
    assert [type(f).__name__ for f in blocks if not isinstance(f, BlockSink)] == []
    assert all(isinstance(f, StageSink) for f in runs + blocks)
    assert not isinstance(probe, BlockSink)          # a whole run's probe is no block's view (no guards_nan)


class _DeclaredOnly(RunCache):
    """A cache the forward knows only by its protocol: a KeyStore of its own over the keys it was given."""

    def __init__(self, layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers
        self.asked: list[int] = []

    def key_positions(self, layer: int, T: int) -> tuple[int, int]:
        return 0, T + (0 if self.k[layer] is None else self.k[layer].shape[1])

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        self.asked.append(layer)
        self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k], 1)
        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v], 1)
        return self.k[layer], self.v[layer]


def test_a_cache_known_only_by_its_protocol_runs_the_blocks_as_a_kvcache(tiny_model):
    """run_blocks over a Cache that is no KVCache: the same stream as over a KVCache, bit for bit, each layer's keys
    written once (the forward dispatches on nothing but the protocol)."""
    cfg = tiny_model.config
    T = 6
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(tiny_model.dtype)
    pos = torch.arange(T)
    ours = _DeclaredOnly(cfg.num_layers)
    a = tiny_model.run_blocks(x, ours, 0, cfg.num_layers, positions=pos)
    b = tiny_model.run_blocks(x, KVCache(cfg, T, tiny_model.device, tiny_model.cache_dtype), 0, cfg.num_layers,
                              positions=pos)
    assert torch.equal(a, b) and ours.asked == list(range(cfg.num_layers))
