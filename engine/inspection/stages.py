"""The stable, dotted stage names a probe can hook (see README 'Stages'), for each family's block.

LAYER_STAGES lists every stage a block may offer, in forward order; a layer offers those its family's block
computes (layer_stages). PLAIN_STAGES is Llama's block (pre-norms, SwiGLU, no q/k norm): what the native decode
step computes. ATTENTION_MAPS are the two stages laid out heads first, (heads, T, S), that a forward materialises only
when a probe asks for them. GLOBAL_STAGES is every stage outside the blocks, of any family; forward_stages(cfg) the
stages a model's forward offers (what a tool compares or watches stage by stage)."""
from __future__ import annotations

LAYER_STAGES = (
    "attn_norm", "attn.q", "attn.k", "attn.v", "attn.q_norm", "attn.k_norm", "attn.q_rot", "attn.k_rot",
    "attn.scores", "attn.pattern", "attn.z", "attn_out", "attn_post_norm", "resid_mid", "mlp_norm", "mlp.gate",
    "mlp.up", "mlp.act", "mlp.router", "mlp.experts", "mlp_out", "mlp_post_norm", "resid_post",
)
PLAIN_STAGES = tuple(s for s in LAYER_STAGES if s not in (
    "attn.q_norm", "attn.k_norm", "attn_post_norm", "mlp.router", "mlp.experts", "mlp_post_norm"))
ATTENTION_MAPS = ("attn.scores", "attn.pattern")
HEAD_STAGES = ("attn.q", "attn.k", "attn.v", "attn.q_rot", "attn.k_rot", "attn.z", *ATTENTION_MAPS)   # a heads axis
SAMPLER_STAGES = ("sampler.penalties", "sampler.temperature", "sampler.top_k", "sampler.top_p",
                  "sampler.min_p", "sampler.probs")
GLOBAL_STAGES = ("tokenizer", "embed", "final_norm", "logits_uncapped", "logits", "detokenizer", *SAMPLER_STAGES)
# stages that exist only where the family's block has the weight or variation behind them
_NEEDS = {"attn_norm": "attn_norm", "attn.q_norm": "q_norm", "attn.k_norm": "k_norm",
          "attn_post_norm": "attn_post_norm", "mlp_norm": "mlp_norm", "mlp_post_norm": "mlp_post_norm"}
_DENSE = ("mlp.gate", "mlp.up", "mlp.act")
_MOE = ("mlp.router", "mlp.experts")
# a plain MLP (GPT-2, GPT-NeoX) has no gate; a parallel block no stream between its halves
_PLAIN_MLP_LACKS = ("mlp.gate",)


def layer_stages(cfg, i: int) -> tuple[str, ...]:
    """The stages block i of a model of this config offers, in forward order."""
    slots = cfg.family.slots(cfg.layer_moe[i], cfg.attention_bias)
    moe = cfg.layer_moe[i]
    lacks = (_PLAIN_MLP_LACKS if "w_up" in slots else ()) + (("resid_mid",) if cfg.parallel_residual else ())
    return tuple(s for s in LAYER_STAGES
                 if (s not in _NEEDS or _NEEDS[s] in slots) and not (moe and s in _DENSE)
                 and not (not moe and s in _MOE) and s not in lacks)


def global_stages(cfg) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The stages before the blocks and after them (the logits before Gemma 2's final soft cap included); cfg None
    or a number: a plain Llama's."""
    softcap = cfg is not None and not isinstance(cfg, int) and cfg.final_softcap
    return ("embed",), ("final_norm", *(("logits_uncapped",) if softcap else ()), "logits")


def hook_names(cfg) -> list[str]:
    """Every stage name of a model of this config (a number: a plain Llama block of that many layers)."""
    (before, after) = global_stages(cfg)
    if isinstance(cfg, int):
        layers = [PLAIN_STAGES] * cfg
    else:
        layers = [layer_stages(cfg, i) for i in range(cfg.num_layers)]
    names = ["tokenizer", *before]
    for i, stages in enumerate(layers):
        names += [f"blocks.{i}.{s}" for s in stages]
    return names + [*after, *SAMPLER_STAGES, "detokenizer"]


def forward_stages(cfg, *, maps: bool = True) -> list[str]:
    """The stages the model's forward offers, embed to logits, in order (no tokenizer, detokenizer or sampler stage):
    what a decode step's statistics rows are, and what tools compare or watch stage by stage. maps=False leaves out
    ATTENTION_MAPS: asking for them makes the forward leave its fused attention kernel (and their -inf masks are no
    fault), so a tool that compares or watches numerics does not ask."""
    return [n for n in hook_names(cfg) if n not in ("tokenizer", "detokenizer") and not n.startswith("sampler.")
            and (maps or not n.endswith(ATTENTION_MAPS))]
