"""The rescue's fp32 reference is computed once: its logits are the fp32 run's own (kept as it generates, the
faults and the watch applied), the same numbers `replay` computes for those tokens (as every plan's rerun is
computed), and the fp32 model runs one forward per step (the prefill, then one per token), not two."""
from __future__ import annotations

import pytest
import torch

from engine import RunSettings
from engine.tools.rescue_runs import Watch, fault_only_probe, fp32_reference, replay

pytestmark = pytest.mark.unit
FAULT = ("scale=1e3@blocks.1.mlp_out",)


def test_the_reference_is_the_runs_own_logits_from_one_forward_a_step(tiny_model):
    calls = []
    forward = type(tiny_model).forward
    # Not monkeypatch: its undo would leave a bound Model.forward in the session's shared instance's __dict__,
    # and a later test patching Model.forward (the app's queue-wait test) would no longer reach this model.
    tiny_model.forward = lambda *a, **k: (calls.append(1), forward(tiny_model, *a, **k))[1]
    try:
        ref = fp32_reference(tiny_model, torch.float16, RunSettings(prompt="one two three", chat=False), 5,
                             injections=FAULT)
    finally:
        del tiny_model.forward                                  # the class's method again
    assert ref.nonfinite is None and len(ref.tokens) == 5 and ref.logits.shape == (5, tiny_model.config.vocab_size)
    assert len(calls) == 5                                      # the prefill and 4 decode steps, once each
    again = replay(tiny_model, ref.prompt_ids, ref.fed, fault_only_probe(tiny_model, FAULT, None, watch=Watch()))
    assert torch.equal(ref.logits, again)
    assert ref.logits.argmax(-1).tolist() == ref.tokens         # greedy: row i is the step that drew token i
