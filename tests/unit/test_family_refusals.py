"""A config the engine does not implement is refused naming the key, never loaded and computed differently: an
unknown family, an unknown RoPE type, a variation on a family that does not declare it, a new attention variant."""
from __future__ import annotations

import json

import pytest

from engine import load_model
from engine.errors import UnsupportedModelError
from tests.helpers import tiny_config, write_model_dir

pytestmark = pytest.mark.unit

CASES = [
    ({"model_type": "falcon"}, "unsupported architecture model_type='falcon'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_scaling type 'yarn'"),
    ({"model_type": "qwen3", "partial_rotary_factor": 0.5}, "unsupported partial_rotary_factor=0.5"),
    ({"attn_logit_softcapping": 50.0}, "unsupported attn_logit_softcapping=50.0"),
    ({"final_logit_softcapping": 30.0}, "unsupported final_logit_softcapping=30.0"),
    ({"no_rope_layers": [1, 0]}, "unsupported no_rope_layers=[1, 0]"),
    ({"num_local_experts": 8, "num_experts_per_tok": 2}, "unsupported num_local_experts=8"),
    ({"residual_multiplier": 0.2}, "unsupported residual_multiplier=0.2"),
    ({"query_pre_attn_scalar": 144}, "unsupported query_pre_attn_scalar=144"),
    ({"model_type": "qwen3", "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
     "unsupported layer_types='sliding_attention'"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "unsupported use_sliding_window=True"),
    ({"model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh", "use_bidirectional_attention": True},
     "unsupported use_bidirectional_attention=True"),
    ({"model_type": "phi3", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "unsupported rope_scaling type 'llama3'; supported: default, longrope"),
    ({"model_type": "gemma2", "hidden_activation": "relu"}, "unsupported hidden_activation='relu'"),
    ({"use_parallel_residual": True}, "unsupported use_parallel_residual=True"),
    ({"model_type": "gpt2", "hidden_act": "gelu_new", "scale_attn_by_inverse_layer_idx": True},
     "unsupported scale_attn_by_inverse_layer_idx=True"),
    ({"model_type": "gpt2", "hidden_act": "gelu_new", "add_cross_attention": True},
     "unsupported add_cross_attention=True"),
    ({"model_type": "gpt_neox", "hidden_act": "relu"}, "unsupported hidden_act='relu'"),
    # stablelm-2-12b's per-head LayerNorm of q and k, and its parallel block with one shared norm
    ({"model_type": "stablelm", "qk_layernorm": True},
     "unsupported qk_layernorm=True for model_type='stablelm' (stablelm is implemented with qk_layernorm=False)"),
    ({"model_type": "stablelm", "use_parallel_residual": True},
     "unsupported use_parallel_residual=True for model_type='stablelm'"),
    ({"model_type": "starcoder2", "hidden_act": "gelu"}, "unsupported hidden_act='gelu' for model_type='starcoder2'"),
    # Cohere's per-head LayerNorm of q and k (Command R+), a sequential block, and a logit scale on another family
    ({"model_type": "cohere", "use_qk_norm": True},
     "unsupported use_qk_norm=True for model_type='cohere' (cohere is implemented with use_qk_norm=False)"),
    ({"model_type": "cohere", "use_parallel_residual": False}, "unsupported use_parallel_residual=False"),
    ({"logit_scale": 0.0625}, "unsupported logit_scale=0.0625 for model_type='llama' (a logit scale is Cohere's)"),
    ({"model_type": "phi", "hidden_act": "gelu_new", "qk_layernorm": True},
     "unsupported qk_layernorm=True for model_type='phi'"),
]


@pytest.mark.parametrize("override,msg", CASES, ids=[m.split("=")[0].split(" ")[-1] for _, m in CASES])
def test_an_unimplemented_config_key_is_refused_by_name(tmp_path, tokenizer_files, override, msg):
    d = write_model_dir(tmp_path / "m", tokenizer_files, tiny_config(), {})
    (d / "config.json").write_text(json.dumps(tiny_config(**override)))
    with pytest.raises(UnsupportedModelError, match=msg.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        load_model(d, device="cpu")
