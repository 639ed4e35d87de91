"""The stable, dotted stage names a probe can hook (see README 'Stages')."""
from __future__ import annotations

LAYER_STAGES = (
    "attn_norm", "attn.q", "attn.k", "attn.v", "attn.q_rot", "attn.k_rot", "attn.scores", "attn.pattern",
    "attn.z", "attn_out", "resid_mid", "mlp_norm", "mlp.gate", "mlp.up", "mlp.act", "mlp_out", "resid_post",
)
SAMPLER_STAGES = ("sampler.penalties", "sampler.temperature", "sampler.top_k", "sampler.top_p",
                  "sampler.min_p", "sampler.probs")


def hook_names(num_layers: int) -> list[str]:
    names = ["tokenizer", "embed"]
    for i in range(num_layers):
        names += [f"blocks.{i}.{s}" for s in LAYER_STAGES]
    return names + ["final_norm", "logits", *SAMPLER_STAGES, "detokenizer"]
