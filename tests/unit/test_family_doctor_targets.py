"""The NaN doctor's custom faults aim only at stages and weights the model's family has."""
from __future__ import annotations

import pytest

from engine.config import ModelConfig
from inspector.views.doctor import target_choices
from tests.helpers import tiny_config

pytestmark = pytest.mark.unit


def test_fault_targets_follow_the_family():
    moe = ModelConfig.from_dict(tiny_config(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2))
    got = target_choices(moe)
    assert "mlp.experts" in got and "weight: mlp.router" in got and "weight: mlp.experts.w_down" in got
    assert "mlp.act" not in got and "weight: mlp.w_gate_up" not in got and "attn.q_norm" not in got
    gemma = ModelConfig.from_dict(tiny_config(model_type="gemma2", hidden_activation="gelu_pytorch_tanh",
                                              head_dim=16, sliding_window=8))
    got = target_choices(gemma)
    assert got.index("attn_out") < got.index("attn_post_norm") < got.index("resid_mid")
    assert "mlp_post_norm" in got and "weight: mlp_post_norm.weight" in got and "mlp.router" not in got
    assert target_choices(ModelConfig.from_dict(tiny_config()))[:3] == ["embed", "attn_norm", "attn.q"]
