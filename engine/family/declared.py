"""Every family the engine opens, one declaration each: its weight names (Hugging Face and GGUF) slot by slot, and
its block's variations. Adding a family is one Family(...) here plus its reference test
(tests/reference/test_families.py); config parsing, loading, GGUF import, stage names and the native step's
allow-list all read these declarations."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

# A part: (Hugging Face name under model.layers.{i}., shape key (engine.family.shapes), GGUF name under blk.{i}.).
# A slot made of several parts concatenates them along the output dimension, in order ("{e}": one per expert; the
# GGUF file holds those stacked in one tensor).
Part = tuple[str, str, str]


def _parts(*triples: Part) -> tuple[Part, ...]:
    return tuple(triples)


ATTN_NORM = {"attn_norm": _parts(("input_layernorm.weight", "d", "attn_norm.weight"))}
QKV = {"wqkv": _parts(("self_attn.q_proj.weight", "q", "attn_q.weight"),
                      ("self_attn.k_proj.weight", "k", "attn_k.weight"),
                      ("self_attn.v_proj.weight", "v", "attn_v.weight")),
       "bqkv": _parts(("self_attn.q_proj.bias", "qb", "attn_q.bias"), ("self_attn.k_proj.bias", "kb", "attn_k.bias"),
                      ("self_attn.v_proj.bias", "vb", "attn_v.bias"))}
HEAD_QK_NORM = {"q_norm": _parts(("self_attn.q_norm.weight", "hd", "attn_q_norm.weight")),
                "k_norm": _parts(("self_attn.k_norm.weight", "hd", "attn_k_norm.weight"))}
WHOLE_QK_NORM = {"q_norm": _parts(("self_attn.q_norm.weight", "qn", "attn_q_norm.weight")),
                 "k_norm": _parts(("self_attn.k_norm.weight", "kn", "attn_k_norm.weight"))}
WO = {"wo": _parts(("self_attn.o_proj.weight", "o", "attn_output.weight"))}
MLP_NORM = {"mlp_norm": _parts(("post_attention_layernorm.weight", "d", "ffn_norm.weight"))}
GATED_MLP = {"w_gate_up": _parts(("mlp.gate_proj.weight", "gate", "ffn_gate.weight"),
                                 ("mlp.up_proj.weight", "up", "ffn_up.weight")),
             "w_down": _parts(("mlp.down_proj.weight", "down", "ffn_down.weight"))}
POST_NORMS = {"attn_post_norm": _parts(("post_attention_layernorm.weight", "d", "post_attention_norm.weight")),
              "mlp_post_norm": _parts(("post_feedforward_layernorm.weight", "d", "post_ffw_norm.weight"))}
GEMMA_MLP_NORM = {"mlp_norm": _parts(("pre_feedforward_layernorm.weight", "d", "ffn_norm.weight"))}
LLAMA = {**ATTN_NORM, **QKV, **WO, **MLP_NORM, **GATED_MLP}
# GPT-2 (under transformer.h.{i}.): LayerNorms with biases, one Conv1D c_attn (stored (in, out), columns q | k | v),
# a plain GELU MLP with biases
GPT2 = {"attn_norm": _parts(("ln_1.weight", "d", "attn_norm.weight")),
        "attn_norm_bias": _parts(("ln_1.bias", "d", "attn_norm.bias")),
        "wqkv": _parts(("attn.c_attn.weight", "qkv", "attn_qkv.weight")),
        "bqkv": _parts(("attn.c_attn.bias", "qkvb", "attn_qkv.bias")),
        "wo": _parts(("attn.c_proj.weight", "o", "attn_output.weight")),
        "bo": _parts(("attn.c_proj.bias", "d", "attn_output.bias")),
        "mlp_norm": _parts(("ln_2.weight", "d", "ffn_norm.weight")),
        "mlp_norm_bias": _parts(("ln_2.bias", "d", "ffn_norm.bias")),
        "w_up": _parts(("mlp.c_fc.weight", "up", "ffn_up.weight")),
        "b_up": _parts(("mlp.c_fc.bias", "upb", "ffn_up.bias")),
        "w_down": _parts(("mlp.c_proj.weight", "down", "ffn_down.weight")),
        "b_down": _parts(("mlp.c_proj.bias", "d", "ffn_down.bias"))}
# GPT-NeoX (under gpt_neox.layers.{i}.): query_key_value fused per head (head h's q, k, v side by side)
NEOX = {"attn_norm": _parts(("input_layernorm.weight", "d", "attn_norm.weight")),
        "attn_norm_bias": _parts(("input_layernorm.bias", "d", "attn_norm.bias")),
        "wqkv": _parts(("attention.query_key_value.weight", "qkv", "attn_qkv.weight")),
        "bqkv": _parts(("attention.query_key_value.bias", "qkvb", "attn_qkv.bias")),
        "wo": _parts(("attention.dense.weight", "o", "attn_output.weight")),
        "bo": _parts(("attention.dense.bias", "d", "attn_output.bias")),
        "mlp_norm": _parts(("post_attention_layernorm.weight", "d", "ffn_norm.weight")),
        "mlp_norm_bias": _parts(("post_attention_layernorm.bias", "d", "ffn_norm.bias")),
        "w_up": _parts(("mlp.dense_h_to_4h.weight", "up", "ffn_up.weight")),
        "b_up": _parts(("mlp.dense_h_to_4h.bias", "upb", "ffn_up.bias")),
        "w_down": _parts(("mlp.dense_4h_to_h.weight", "down", "ffn_down.weight")),
        "b_down": _parts(("mlp.dense_4h_to_h.bias", "d", "ffn_down.bias"))}
# StableLM (stablelm-2, stablelm-3b-4e1t): Llama's names and gated MLP under LayerNorms with biases
STABLELM_NORM_BIASES = {"attn_norm_bias": _parts(("input_layernorm.bias", "d", "attn_norm.bias")),
                        "mlp_norm_bias": _parts(("post_attention_layernorm.bias", "d", "ffn_norm.bias"))}
STABLELM = {**LLAMA, **STABLELM_NORM_BIASES}
# Phi (phi-1, phi-1.5, phi-2): a parallel block under one LayerNorm (no mlp_norm: the MLP reads the attention's
# normed input), q/k/v and dense biases, a plain MLP fc1 -> GELU-tanh -> fc2 with biases
PHI = {"attn_norm": _parts(("input_layernorm.weight", "d", "attn_norm.weight")),
       "attn_norm_bias": _parts(("input_layernorm.bias", "d", "attn_norm.bias")),
       **QKV,
       "wo": _parts(("self_attn.dense.weight", "o", "attn_output.weight")),
       "bo": _parts(("self_attn.dense.bias", "d", "attn_output.bias")),
       "w_up": _parts(("mlp.fc1.weight", "up", "ffn_up.weight")),
       "b_up": _parts(("mlp.fc1.bias", "upb", "ffn_up.bias")),
       "w_down": _parts(("mlp.fc2.weight", "down", "ffn_down.weight")),
       "b_down": _parts(("mlp.fc2.bias", "d", "ffn_down.bias"))}
# StarCoder 2: LayerNorms with biases, q/k/v/o biases, a plain MLP c_fc -> GELU-tanh -> c_proj with biases; use_bias
# switches the projections' biases (never the norms')
BO = {"bo": _parts(("self_attn.o_proj.bias", "d", "attn_output.bias"))}
STARCODER2 = {**ATTN_NORM, **QKV, **WO, **BO, **MLP_NORM, **STABLELM_NORM_BIASES,
              "w_up": _parts(("mlp.c_fc.weight", "up", "ffn_up.weight")),
              "b_up": _parts(("mlp.c_fc.bias", "upb", "ffn_up.bias")),
              "w_down": _parts(("mlp.c_proj.weight", "down", "ffn_down.weight")),
              "b_down": _parts(("mlp.c_proj.bias", "d", "ffn_down.bias"))}
BIAS_SLOTS = ("bqkv", "bo")     # the attention biases a family's bias flag switches (by default)


@dataclass(frozen=True)
class Checkpoint:
    """Where a family's Hugging Face checkpoint keeps its tensors and how it lays them out."""
    layer: str = "model.layers.{i}."      # the prefix of a layer's parts
    embed: str = "model.embed_tokens.weight"
    norm: str = "model.norm.weight"
    norm_bias: str | None = None          # the final LayerNorm's bias
    lm_head: str = "lm_head.weight"
    lm_head_bias: str | None = None       # the head's bias (Phi)
    pos_embed: str | None = None          # learned absolute positions (n_positions, d)
    transposed: bool = False              # matrices stored (in, out) (GPT-2's Conv1D), not (out, in)
    optional_prefix: str = ""             # a prefix older checkpoints left off every name (GPT-2's "transformer.")
    qkv_per_head: bool = False            # fused qkv rows grouped by head: [q_h | k_h | v_h] for each head h
    ignored: str = r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"   # buffers saved beside the weights


LLAMA_CHECKPOINT = Checkpoint()


def _experts(router: str, expert: str, gate: str, up: str, down: str) -> dict[str, tuple[Part, ...]]:
    """A mixture-of-experts layer's slots: its router, and each expert's gate, up and down (GGUF: stacked)."""
    return {"router": _parts((router, "router", "ffn_gate_inp.weight")),
            "experts_gate_up": _parts((f"{expert}{gate}.weight", "egate", "ffn_gate_exps.weight"),
                                      (f"{expert}{up}.weight", "eup", "ffn_up_exps.weight")),
            "experts_down": _parts((f"{expert}{down}.weight", "edown", "ffn_down_exps.weight"))}


@dataclass(frozen=True)
class Family:
    """A decoder-only family: what its checkpoint holds and how its block differs from Llama's.

    Each variation names the config.json keys it reads (engine.config); a key a family does not declare is refused
    when it would change the computation."""
    model_type: str
    architecture: str                     # the HF class name written into an imported config.json
    parts: dict[str, tuple[Part, ...]]    # slot -> its parts, for the slots this family's block has
    gguf_arch: str | None = None          # llama.cpp's general.architecture
    gguf_permutes_qk: bool = False        # llama.cpp's converter permuted q/k rows (its LlamaModel)
    bias: str = "flag"                    # q/k/v biases: "flag" (attention_bias), "always", "never"
    bias_slots: tuple[str, ...] = BIAS_SLOTS   # the slots that flag switches
    norm_offset: float = 0.0              # RMSNorm multiplies by (offset + w) (Gemma: 1)
    activation: str = "silu"              # the gated MLP's: "silu" or "gelu_tanh"
    qk_norm: str | None = None            # RMSNorm of q and k before RoPE: "head" (per head) or "whole" (projection)
    embed_scale: str | None = None        # "sqrt_d" (Gemma) or "multiplier" (Granite's embedding_multiplier)
    multipliers: bool = False             # Granite: residual_multiplier, attention_multiplier, logits_scaling
    softcaps: bool = False                # attn_logit_softcapping, final_logit_softcapping
    query_scale: bool = False             # query_pre_attn_scalar sets the score scale
    windows: str | None = None            # sliding windows: "all" (sliding_window) or "layer_types"
    local_rope: bool = False              # sliding layers' own RoPE (rope_local_base_freq / per-type parameters)
    rotary_fraction: bool = False         # partial_rotary_factor
    rope_types: tuple[str, ...] = ("default", "linear", "llama3")
    no_rope_layers: bool = False          # SmolLM3: no_rope_layers[i] == 0 has no RoPE
    experts: str | None = None            # "mixtral" (renormalised top-k) or "qwen3_moe" (norm_topk_prob)
    moe_parts: dict[str, tuple[Part, ...]] = field(default_factory=dict)   # slots of a mixture-of-experts layer
    norm: str = "rms"                     # "rms" (RMSNorm) or "layer" (LayerNorm, with a bias slot beside each)
    mlp: str = "gated"                    # "gated" (act(gate) * up) or "plain" (act(up), with biases)
    positions: str = "rope"               # "rope" (halves rotate together), "rope_interleaved" (adjacent pairs:
    #                                       Cohere) or "learned" (absolute position embeddings added to the tokens)
    logit_scale: bool = False             # Cohere's logit_scale multiplies the logits
    parallel_residual: bool = False       # reads use_parallel_residual: x + attn(ln1(x)) + mlp(ln2(x)), or
    #                                       x + attn(ln1(x)) + mlp(ln1(x)) where the block has no mlp_norm (Phi)
    bias_default: bool = False            # attention_bias when config.json does not say
    tie_default: bool = False             # tie_word_embeddings when config.json does not say
    config_keys: dict[str, str] = field(default_factory=dict)   # this family's config.json key -> the engine's
    fixed: dict[str, object] = field(default_factory=dict)      # config.json keys computed at one value only
    checkpoint: Checkpoint = LLAMA_CHECKPOINT

    def slots(self, moe: bool, bias: bool) -> dict[str, tuple[Part, ...]]:
        """The slots (and their parts) of one layer: an experts layer swaps the dense MLP for router and experts."""
        out = dict(self.parts)
        if moe:
            out.pop("w_gate_up", None)
            out.pop("w_down", None)
            out |= self.moe_parts
        if not bias:
            for slot in self.bias_slots:
                out.pop(slot, None)
        return out


_llama = Family("llama", "LlamaForCausalLM", LLAMA, gguf_arch="llama", gguf_permutes_qk=True)
_gemma2 = Family("gemma2", "Gemma2ForCausalLM", {**ATTN_NORM, **QKV, **WO, **POST_NORMS, **GEMMA_MLP_NORM, **GATED_MLP},
                 gguf_arch="gemma2", norm_offset=1.0, activation="gelu_tanh", embed_scale="sqrt_d", softcaps=True,
                 query_scale=True, windows="layer_types")
_qwen3 = Family("qwen3", "Qwen3ForCausalLM", {**LLAMA, **HEAD_QK_NORM}, gguf_arch="qwen3", qk_norm="head")

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    _llama,
    replace(_llama, model_type="mistral", architecture="MistralForCausalLM", windows="all"),
    Family("qwen2", "Qwen2ForCausalLM", LLAMA, gguf_arch="qwen2", bias="always"),
    _qwen3,
    # Gemma (v1): Llama's block (norms before attention and MLP only) with Gemma's (1 + w) norms, GELU-tanh and
    # embeddings x sqrt(d); its head is tied unless config.json says otherwise
    replace(_llama, model_type="gemma", architecture="GemmaForCausalLM", gguf_arch="gemma", gguf_permutes_qk=False,
            norm_offset=1.0, activation="gelu_tanh", embed_scale="sqrt_d", tie_default=True),
    _gemma2,
    replace(_gemma2, model_type="gemma3_text", architecture="Gemma3ForCausalLM", gguf_arch="gemma3",
            parts={**_gemma2.parts, **HEAD_QK_NORM}, qk_norm="head", local_rope=True),
    Family("phi3", "Phi3ForCausalLM", {
        **ATTN_NORM, **WO, **MLP_NORM,
        "wqkv": _parts(("self_attn.qkv_proj.weight", "qkv", "attn_qkv.weight")),
        "w_gate_up": _parts(("mlp.gate_up_proj.weight", "gate_up", "ffn_up.weight")),
        "w_down": GATED_MLP["w_down"]},
        gguf_arch="phi3", bias="never", rotary_fraction=True, rope_types=("default", "longrope"), windows="all"),
    Family("olmo2", "Olmo2ForCausalLM", {**QKV, **WHOLE_QK_NORM, **WO, **POST_NORMS, **GATED_MLP},
           gguf_arch="olmo2", qk_norm="whole"),
    replace(_llama, model_type="granite", architecture="GraniteForCausalLM", gguf_arch="granite",
            embed_scale="multiplier", multipliers=True),
    replace(_llama, model_type="smollm3", architecture="SmolLM3ForCausalLM", gguf_arch="smollm3",
            no_rope_layers=True),
    replace(_llama, model_type="mixtral", architecture="MixtralForCausalLM", windows="all", experts="mixtral",
            moe_parts=_experts("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.", "w1", "w3", "w2")),
    replace(_qwen3, model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", gguf_arch="qwen3moe",
            experts="qwen3_moe",
            moe_parts=_experts("mlp.gate.weight", "mlp.experts.{e}.", "gate_proj", "up_proj", "down_proj")),
    Family("gpt2", "GPT2LMHeadModel", GPT2, gguf_arch="gpt2", bias="always", activation="gelu_tanh", norm="layer",
           mlp="plain", positions="learned", tie_default=True,
           config_keys={"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
                        "n_positions": "max_position_embeddings", "n_inner": "intermediate_size",
                        "layer_norm_epsilon": "rms_norm_eps", "activation_function": "hidden_act"},
           fixed={"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                  "reorder_and_upcast_attn": False, "add_cross_attention": False},
           checkpoint=Checkpoint(layer="transformer.h.{i}.", embed="transformer.wte.weight",
                                 norm="transformer.ln_f.weight", norm_bias="transformer.ln_f.bias",
                                 pos_embed="transformer.wpe.weight", transposed=True,
                                 optional_prefix="transformer.",
                                 # the causal-mask buffers older checkpoints saved
                                 ignored=r"transformer\.h\.\d+\.attn\.(bias|masked_bias)")),
    # q/k/v biases by use_qkv_bias, none on o_proj; a rotary fraction (0.25 by default); a sequential block only
    # (stablelm-2-12b's parallel residual shares one norm, and its qk_layernorm is a LayerNorm per head)
    Family("stablelm", "StableLmForCausalLM", STABLELM, gguf_arch="stablelm", norm="layer", rotary_fraction=True,
           config_keys={"layer_norm_eps": "rms_norm_eps", "use_qkv_bias": "attention_bias"},
           fixed={"qk_layernorm": False},
           checkpoint=Checkpoint(norm_bias="model.norm.bias")),
    Family("phi", "PhiForCausalLM", PHI, gguf_arch="phi2", bias="always", activation="gelu_tanh", norm="layer",
           mlp="plain", rotary_fraction=True, parallel_residual=True, config_keys={"layer_norm_eps": "rms_norm_eps"},
           fixed={"qk_layernorm": False},
           checkpoint=Checkpoint(norm="model.final_layernorm.weight", norm_bias="model.final_layernorm.bias",
                                 lm_head_bias="lm_head.bias")),
    Family("starcoder2", "Starcoder2ForCausalLM", STARCODER2, gguf_arch="starcoder2", activation="gelu_tanh",
           norm="layer", mlp="plain", windows="all", bias_default=True, tie_default=True,
           bias_slots=("bqkv", "bo", "b_up", "b_down"),
           config_keys={"norm_epsilon": "rms_norm_eps", "use_bias": "attention_bias"},
           checkpoint=Checkpoint(norm_bias="model.norm.bias")),
    # Cohere (Command R): a parallel block under one bias-free LayerNorm (as Phi's), Llama's gated SiLU MLP, RoPE on
    # adjacent pairs of dimensions, the logits times logit_scale, the head tied by default; attention_bias biases
    # q/k/v and o
    Family("cohere", "CohereForCausalLM", {**ATTN_NORM, **QKV, **WO, **BO, **GATED_MLP}, gguf_arch="command-r",
           norm="layer", positions="rope_interleaved", logit_scale=True, parallel_residual=True, tie_default=True,
           config_keys={"layer_norm_eps": "rms_norm_eps"}, fixed={"use_qk_norm": False, "use_parallel_residual": True}),
    Family("gpt_neox", "GPTNeoXForCausalLM", NEOX, gguf_arch="gptneox", activation="gelu", norm="layer", mlp="plain",
           rotary_fraction=True, parallel_residual=True, bias_default=True,
           config_keys={"layer_norm_eps": "rms_norm_eps", "rotary_pct": "partial_rotary_factor",
                        "rotary_emb_base": "rope_theta"},
           checkpoint=Checkpoint(layer="gpt_neox.layers.{i}.", embed="gpt_neox.embed_in.weight",
                                 norm="gpt_neox.final_layer_norm.weight", norm_bias="gpt_neox.final_layer_norm.bias",
                                 lm_head="embed_out.weight", qkv_per_head=True,
                                 ignored=r"gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)")),
)}
# llama.cpp's mixtral files say "llama" (experts are told by their tensors)
# One family an architecture name: the dense one where a mixture-of-experts family shares its name (mixtral's files
# say "llama"); mistral's files say "llama" too (llama.cpp keeps no sliding window for them)
BY_GGUF_ARCH = {f.gguf_arch: f for f in FAMILIES.values()
                if f.gguf_arch and f.model_type != "mistral" and not (f.experts and f.gguf_arch == "llama")}
# a dense family's experts twin under the same architecture name, told by the file's stacked experts tensors
EXPERTS_OF = {d.model_type: f for f in FAMILIES.values() for d in BY_GGUF_ARCH.values()
              if f.experts and f.gguf_arch == d.gguf_arch and f is not d}
