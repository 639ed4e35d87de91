"""llama.cpp's tensor names and layouts against a family's Hugging Face checkpoint (engine.family.declared): which
checkpoint tensor a GGUF tensor is, and how llama.cpp's converter changed it on the way (said per change), so the
import can write the checkpoint back as transformers saves it.

- LlamaModel (llama, granite, smollm3, mixtral) permutes the q and k rows (its RoPE rotates adjacent pairs; HF's
  rotates halves): permuted back.
- The Gemma converters store norms as 1 + w: w written back.
- GPT2Model transposes GPT-2's Conv1D matrices (stored (in, out)) to (out, in): transposed back.
- GPTNeoXModel regroups query_key_value from per head ([q_h | k_h | v_h] for each head h) to q | k | v: regrouped.
"""
from __future__ import annotations

import numpy as np

from engine.errors import UnsupportedModelError
from engine.family import Family

SKIPPED = {"rope_freqs.weight"}  # llama3 rope factors: read back into config.rope_scaling (gguf_import)


def global_map(fam: Family) -> dict[str, str]:
    """GGUF name -> checkpoint name of the tensors outside the layers, from the family's checkpoint."""
    ck = fam.checkpoint
    out = {"token_embd.weight": ck.embed, "output_norm.weight": ck.norm, "output.weight": ck.lm_head}
    for gguf_name, hf in (("output_norm.bias", ck.norm_bias), ("output.bias", ck.lm_head_bias),
                          ("position_embd.weight", ck.pos_embed)):
        if hf:
            out[gguf_name] = hf
    return out


def layer_map(fam: Family) -> dict[str, str]:
    """GGUF name under blk.{i}. -> checkpoint name under the family's layer prefix ("{e}": one per expert, the GGUF
    tensor stacks them), from the family's declared parts."""
    return {g: hf for parts in (*fam.parts.values(), *fam.moe_parts.values()) for hf, _, g in parts}


def hf_name(gguf_name: str, fam: Family) -> str:
    names = global_map(fam)
    if gguf_name in names:
        return names[gguf_name]
    names = layer_map(fam)
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return fam.checkpoint.layer.format(i=int(parts[1])) + names[parts[2]]
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name for {fam.model_type}")


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (transformers: _reverse_permute_weights)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def to_checkpoint(arr: np.ndarray, gguf_name: str, fam: Family, cfg: dict) -> np.ndarray:
    """A GGUF tensor (in its numpy shape, (out, in) for a matrix) in the checkpoint's layout (see the module's
    docstring for each converter's change)."""
    if fam.gguf_permutes_qk and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
        arr = unpermute(arr, cfg["num_attention_heads"])
    elif fam.gguf_permutes_qk and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
        arr = unpermute(arr, cfg["num_key_value_heads"])
    if fam.norm_offset and gguf_name.endswith("norm.weight"):
        arr = arr - np.float32(fam.norm_offset)
    layer = gguf_name.startswith("blk.")
    if fam.checkpoint.transposed and layer and arr.ndim == 2:
        arr = arr.T
    if fam.checkpoint.qkv_per_head and gguf_name.endswith(("attn_qkv.weight", "attn_qkv.bias")):
        heads = cfg["num_attention_heads"]     # (3, H, hd, ...) -> (H, 3, hd, ...): multi-head only (GPT-NeoX)
        arr = arr.reshape(3, heads, arr.shape[0] // 3 // heads, *arr.shape[1:]).swapaxes(0, 1).reshape(arr.shape)
    return arr
