"""The unprobed forward does its residual adds and the MLP's SiLU-times-up in place (engine.model.Model._block,
own=True): the same numbers as the probed forward, which keeps every stage as its own tensor, bit for bit;
and run_blocks, whose stream is the caller's, never writes it."""
from __future__ import annotations

import torch

from engine.inspection.probe import Probe


def test_the_unprobed_forward_gives_the_probed_forwards_numbers_bit_for_bit(tiny_model):
    ids = torch.tensor(tiny_model.tokenizer.encode("In place or not, the numbers are the same. " * 3))
    plain_cache, probed_cache = tiny_model.new_cache(len(ids) + 1), tiny_model.new_cache(len(ids) + 1)
    plain = tiny_model.forward(ids, plain_cache)
    probe = Probe().capture("blocks.*.resid_post").capture("blocks.*.mlp.act")
    probed = tiny_model.forward(ids, probed_cache, probe)
    assert torch.equal(plain, probed)
    assert torch.equal(plain_cache.k, probed_cache.k) and torch.equal(plain_cache.v, probed_cache.v)
    last_name = f"blocks.{tiny_model.config.num_layers - 1}.resid_post"
    last = [c.value for c in probe.recording.captures if c.name == last_name][0]
    stream = tiny_model.forward(ids, tiny_model.new_cache(len(ids)), stop_after=tiny_model.config.num_layers - 1)
    assert torch.equal(last.reshape(stream.shape), stream)      # the stream itself, as the probe saw it


def test_run_blocks_leaves_the_callers_stream_as_it_was(tiny_model):
    x = torch.randn(6, tiny_model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    before = x.clone()
    out = tiny_model.run_blocks(x, tiny_model.new_cache(6), 0, tiny_model.config.num_layers, positions=torch.arange(6))
    assert torch.equal(x, before) and not torch.equal(out, x)
