"""A routing breakpoint ("token routed to expert e at layer L") on a tiny Qwen3-MoE: it fires exactly for the experts
a hand computation of the router's top k picks at the step's last position, and names a missing capture."""
from __future__ import annotations

import pytest
import torch

from engine import EngineError, Probe, load_model
from engine.generate import GenerationRun
from engine.tools.breakpoints import ROUTING_CAPTURE, RoutedTo
from tests.reference.family_models import build

pytest.importorskip("transformers")
pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def moe(tmp_path_factory, tokenizer_files):
    return load_model(build("qwen3_moe", tmp_path_factory.mktemp("moe") / "m", tokenizer_files), device="cpu")


def test_routing_breakpoint_fires_for_the_router_top_k_only(moe):
    probe = Probe().capture([ROUTING_CAPTURE, "blocks.0.mlp_norm"])
    run = GenerationRun(moe, [5, 900, 1200, 77], max_new_tokens=2, probe=probe)
    step = run.step()
    h = probe.recording.captured("blocks.0.mlp_norm", step=0)[-1].value[-1].double()                # (d,)
    logits = h @ moe.weights.layers[0].router.double()                                    # (E,)
    chosen = set(torch.topk(logits, moe.config.experts_per_token).indices.tolist())       # softmax keeps the order
    for e in range(moe.config.num_experts):
        fired = RoutedTo(0, e).check(run, step, probe)
        assert (fired is not None) == (e in chosen), (e, chosen, fired)
        if fired:
            assert f"expert {e} at layer 0" in fired and "position 3" in fired
    with pytest.raises(EngineError, match="must capture"):
        RoutedTo(0, 0).check(run, step, Probe())
