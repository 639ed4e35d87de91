"""A GGUF file's weights "as stored": its 2-D matrices in the formats engine.quant_matrix decodes (Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) kept as QuantMatrix, in the file's own block bytes; every other tensor (F32/F16,
norms, biases, matrices of other quant types) dequantised to float32 as the import does. A matrix that had to be
dequantised is listed in the notes the model carries (Weights.notes), so nothing is silently turned into floats.

Layout: a QuantMatrix stays in the file's (out, in) rows; its product (engine.matmul.mm) is x @ W in the engine's
sense. llama.cpp's q/k row permutation (engine.gguf_names.unpermute) is undone on the block rows, which are whole
blocks. Fused slots (q|k|v, gate|up) concatenate their parts' block rows when the parts share a format, else are
dequantised (and noted). A tied model's token_embd is one QuantMatrix, the embedding lookup (rows by id) and the
lm_head product both. A mixture of experts' stacked tensors (ffn_gate_exps, ffn_up_exps, ffn_down_exps: one per slot,
all experts) are kept whole as engine.quant_experts.QuantExperts, gate | up fused expert by expert; engine.moe
multiplies only the experts a token chose, each by its own blocks (on the PyTorch forward: decode.c routes float
experts only, and says so).

Arithmetic (engine.quant_int8.ARITHMETICS; load_model's quant="stored" is "float", "stored-int8" is "int8"): each
kept matrix is given it here, in `_kept` and nowhere else; a format without an int8 product keeps the float one, and
the notes say which (Weights.notes).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.family import FAMILIES
from engine.family.slots import BY_FIELD
from engine.family.declared import LLAMA_CHECKPOINT
from engine.gguf_names import SKIPPED, hf_name, unpermute
from engine.quant_experts import QuantExperts
from engine.quant_int8 import FORMATS as INT8_FORMATS
from engine.quant_matrix import BLOCKS, QuantMatrix
from engine.weights import LayerWeights, Weights, layer_parts


def read_tensors(gguf_path: Path, cfg: ModelConfig, arithmetic: str = "float"
                 ) -> tuple[dict[str, QuantMatrix | torch.Tensor], list[str]]:
    """Every tensor under its Hugging Face name: a QuantMatrix (N, K) where kept (multiplied in `arithmetic` where
    its format has that kernel), else float32 in the file's (out, in) layout; and the notes on what was dequantised
    or keeps the float product."""
    from gguf.quants import dequantize

    from engine.gguf_file import open_gguf

    try:
        reader = open_gguf(gguf_path)
    except Exception as e:
        raise ModelLoadError(f"{gguf_path}: not a readable GGUF file: {e}") from None
    fam = FAMILIES[cfg.model_type]
    if fam.checkpoint != LLAMA_CHECKPOINT:
        # stored_weights assembles Llama's checkpoint (no LayerNorm or head biases, no learned positions, no
        # transposed or per-head matrices)
        raise UnsupportedModelError(f"quant='stored' keeps the blocks of Llama-layout checkpoints; {fam.model_type}'s "
                                    "is laid out otherwise: load the file dequantised (quant='dequantized')")
    out, notes, floats = {}, [], {}
    for t in reader.tensors:
        if t.name in SKIPPED:
            continue
        fmt = getattr(t.tensor_type, "name", str(t.tensor_type))
        name = hf_name(t.name, fam)
        if "{e}" in name:       # a stack of experts: kept whole under its name with "{e}" (stored_weights splits it)
            out[name] = _experts(t, fmt, notes, arithmetic, floats)
            reader.release(t)
            continue
        heads = (cfg.num_heads if t.name.endswith(("attn_q.weight", "attn_q.bias")) else
                 cfg.num_kv_heads if t.name.endswith(("attn_k.weight", "attn_k.bias")) else None)
        permute = fam.gguf_permutes_qk and heads is not None
        if len(t.shape) == 2 and fmt in BLOCKS:
            m = _kept(QuantMatrix.from_gguf(t), arithmetic, floats)
            if permute:
                order = torch.from_numpy(unpermute(np.arange(m.shape[0]), heads).copy())
                m = m.permute_rows(order)
            out[name] = m       # keeps the file's name: errors and notes name the tensor as the file does
            reader.release(t)   # copied: its pages leave this process (peak memory ~ the blocks, not twice)
            continue
        try:
            arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (NotImplementedError, ValueError, KeyError, TypeError) as e:
            raise UnsupportedModelError(f"tensor {t.name}: quantization type {fmt} cannot be dequantised here "
                                        f"({type(e).__name__})") from None
        arr = arr.reshape(tuple(int(s) for s in reversed(t.shape)))
        if permute:
            arr = unpermute(arr, heads)
        if fam.norm_offset and t.name.endswith("norm.weight"):
            # llama.cpp's Gemma converters store 1 + w, and the forward reads (1 + w) (engine.weights folds the
            # offset in at load, in float32); the dequantised import takes 1 off (engine.gguf_names.to_checkpoint)
            # and the load adds it back: the same two roundings here, so both loads hold the same values
            off = np.float32(fam.norm_offset)
            arr = (arr - off) + off
        if len(t.shape) == 2 and fmt not in ("F32", "F16", "BF16"):
            notes.append(f"{t.name}: {fmt} is not a format kept quantised; dequantised to float32")
        out[name] = torch.from_numpy(np.ascontiguousarray(arr).copy())
        reader.release(t)
    notes += [f"{n} {fmt} matrices ({', '.join(names[:3])}{', ...' if n > 3 else ''}): {fmt} has no int8 product "
              "(those with one: " + ", ".join(INT8_FORMATS) + "); multiplied by its float kernel (x kept in float32)"
              for fmt, names in floats.items() for n in [len(names)]]
    return out, notes


def _kept(m: QuantMatrix, arithmetic: str, floats: dict[str, list[str]]) -> QuantMatrix:
    """The one place a kept matrix is given its arithmetic: the load's, except "int8" for a format without that
    kernel, which keeps "float" (its name added to floats[format], for the notes)."""
    if arithmetic == "int8" and m.format not in INT8_FORMATS:
        floats.setdefault(m.format, []).append(m.name)
        return m
    return m.with_arithmetic(arithmetic)


def stored_weights(gguf_path: Path, cfg: ModelConfig, arithmetic: str = "float") -> Weights:
    """The model's Weights with its matrices kept as stored, multiplied in `arithmetic` (the module's docstring)."""
    raw, notes = read_tensors(gguf_path, cfg, arithmetic)
    layers = []
    for i in range(cfg.num_layers):
        slots = {}
        for slot, parts in layer_parts(cfg, i).items():
            kind = BY_FIELD[slot].kind
            if kind == "experts":
                slots[slot] = _expert_slot(f"model.layers.{i}.{slot}", [n for n, _ in parts], raw, cfg, notes)
                continue
            ts = [raw.pop(n) for n, _ in parts]
            if kind == "router" and any(isinstance(t, QuantMatrix) for t in ts):
                # a few dozen floats a row (d, E), read as floats by the native step's routing (llama.cpp's quantizer
                # leaves ffn_gate_inp in F32 too)
                notes.append(f"layer {i}: the router ({', '.join(t.format for t in ts if isinstance(t, QuantMatrix))})"
                             " dequantised to float32")
                slots[slot] = _matrix(f"model.layers.{i}.{slot}", [_float(t) for t in ts], notes)
            elif kind in ("matrix", "router"):
                slots[slot] = _matrix(f"model.layers.{i}.{slot}", ts, notes)
            elif kind == "norm" or len(ts) == 1:
                slots[slot] = _float(ts[0])
            else:       # fused biases
                slots[slot] = torch.cat([_float(t) for t in ts])
        if slots.get("bqkv") is not None and isinstance(slots.get("wqkv"), QuantMatrix):
            # engine.model adds a q/k/v bias in one float addmm (its block math, not this module's): that
            # product needs the float matrix
            notes.append(f"layer {i}: q/k/v with a bias ({slots['wqkv'].format}) dequantised to float32")
            slots["wqkv"] = slots["wqkv"].dequantize()
        layers.append(LayerWeights(**slots))
    embed = raw.pop("model.embed_tokens.weight")
    if cfg.tie_word_embeddings:
        lm_head = embed if isinstance(embed, QuantMatrix) else embed.t().contiguous()
        embed = lm_head if isinstance(lm_head, QuantMatrix) else lm_head.t()
    else:
        lm_head = _matrix("lm_head.weight", [raw.pop("lm_head.weight")], notes)
    return Weights(embed=embed, layers=layers, norm=_float(raw.pop("model.norm.weight")), lm_head=lm_head, notes=notes)


def _matrix(name: str, parts: list, notes: list[str]) -> QuantMatrix | torch.Tensor:
    """A slot's matrix from its parts: their block rows joined where all are kept in one format, else float32
    (in, out)."""
    if all(isinstance(p, QuantMatrix) for p in parts):
        if len({p.format for p in parts}) == 1:
            return parts[0] if len(parts) == 1 else QuantMatrix.cat(name, parts)
        notes.append(f"{name}: its parts are {', '.join(p.format for p in parts)}; one fused product needs one "
                     "format, so it is dequantised to float32")
    elif any(isinstance(p, QuantMatrix) for p in parts):
        notes.append(f"{name}: float and quantised parts; dequantised to float32")
    rows = [p.dequantize().t() if isinstance(p, QuantMatrix) else p for p in parts]
    return torch.cat(rows).t().contiguous()


def _float(t) -> torch.Tensor:
    return t.dequantize().t().contiguous() if isinstance(t, QuantMatrix) else t


def _experts(t, fmt: str, notes: list[str], arithmetic: str, floats: dict) -> QuantExperts | torch.Tensor:
    """A stacked-experts tensor (dims (K, N, E)): QuantExperts where its type is kept (given its arithmetic by
    _kept), else float32 (E, N, K)."""
    from gguf.quants import dequantize

    if fmt in BLOCKS:
        return _kept(QuantExperts.from_gguf(t), arithmetic, floats)
    try:
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    except (NotImplementedError, ValueError, KeyError, TypeError) as e:
        raise UnsupportedModelError(f"tensor {t.name}: quantization type {fmt} cannot be dequantised here "
                                    f"({type(e).__name__})") from None
    if fmt not in ("F32", "F16", "BF16"):
        notes.append(f"{t.name}: {fmt} is not a format kept quantised; dequantised to float32")
    return torch.from_numpy(np.ascontiguousarray(arr.reshape(tuple(int(s) for s in reversed(t.shape)))).copy())


def _expert_slot(name: str, names: list[str], raw: dict, cfg: ModelConfig, notes: list[str]):
    """An experts slot from its stacks: names are layer_parts' per-expert names (each part's E experts in turn);
    raw holds each part's stack under its name with "{e}" (read_tensors). Kept: one QuantExperts (gate | up
    fused per expert); a float part, or parts in two formats: the float32 stack (E, K, N) a float model holds."""
    E = cfg.num_experts
    stacks = {n.format(e=0): n for n in raw if "{e}" in n}
    missing = [n for n in names[::E] if n not in stacks]
    if missing:
        raise ModelLoadError(f"{name}: the file holds no stacked experts tensor for {', '.join(missing)}")
    parts = [raw.pop(stacks[n]) for n in names[::E]]
    if all(isinstance(p, QuantExperts) for p in parts) and len({p.format for p in parts}) == 1:
        return parts[0] if len(parts) == 1 else QuantExperts.fuse(name, parts)
    if any(isinstance(p, QuantExperts) for p in parts):
        notes.append(f"{name}: its parts are {', '.join(getattr(p, 'format', 'float32') for p in parts)}; one "
                     "fused product needs one format, so the experts are dequantised to float32")
    floats = [p.dequantize().transpose(1, 2) if isinstance(p, QuantExperts) else p for p in parts]   # (E, N, K)
    return torch.cat(floats, dim=1).transpose(1, 2).contiguous()
