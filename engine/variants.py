"""Model variants, made in one place: a precision plan (some units in fp32), a cast to another dtype, a copy
with other weights (quantised round trips, engine.tools.quant), a copy with some attention heads' outputs zeroed
(the why-loop's head reruns). Every variant shares the model's config and tokenizer, gets its own weights where
they differ (the rest are shared), and gets no native decode step of its own (engine.accelerator: a variant's
attributes are set after it is built, so its eligibility is not known there), except the zeroed heads' variant,
whose step is checked against the model's (NativeDecoder.sharing: it differs only in the changed `wo` matrices);
its statistics backend is chosen as for any model."""
from __future__ import annotations

import dataclasses

import torch

from engine.accelerator import Accelerator
from engine.errors import InputError
from engine.family.slots import UNIT_FIELDS
from engine.memory import COPY_ADVICE, check_work_fits
from engine.model import Model
from engine.quant_matrix import QuantMatrix
from engine.rope import RopeTables
from engine.weights import LayerWeights, Weights, as_float

PRECISION_UNITS = ("embed", "blocks.{i}.attn", "blocks.{i}.mlp", "blocks.{i}.resid", "final_norm", "logits")
ATTN_WEIGHTS, MLP_WEIGHTS = UNIT_FIELDS["attn"], UNIT_FIELDS["mlp"]


def derive(model: Model, weights: Weights, *, dtype: torch.dtype, name: str) -> Model:
    """A model of the same architecture and tokenizer with these weights (the one constructor of variants)."""
    return Model(model.config, weights, model.tokenizer, device=model.device, dtype=dtype, name=name,
                 path=model.path)


def cast_model(model: Model, dtype: str | torch.dtype) -> Model:
    """A new Model with the weights converted to dtype (copies; the given model is never changed)."""
    from engine.loader import pick_dtype
    dt = pick_dtype(dtype, model.device)
    check_work_fits(model.weights.dequantized_nbytes() + model.weights.values() * dt.itemsize,
                    f"a {str(dt).removeprefix('torch.')} copy of {model.name}", "its copy of the weights", COPY_ADVICE)
    w = model.weights.floats()      # a model kept quantised is cast from its dequantised values

    def cv(t):
        return None if t is None else t.to(dt, copy=True)
    layers = [LayerWeights(**{f.name: cv(getattr(lw, f.name)) for f in dataclasses.fields(lw)}) for lw in w.layers]
    head = cv(w.lm_head)
    weights = dataclasses.replace(w, embed=head.t() if w.tied() else cv(w.embed), layers=layers, norm=cv(w.norm),
                                  lm_head=head, norm_bias=cv(w.norm_bias), pos_embed=cv(w.pos_embed),
                                  head_bias=cv(w.head_bias))
    return derive(model, weights, dtype=dt, name=f"{model.name} [{str(dt).removeprefix('torch.')}]")


def without_heads(model: Model, heads) -> Model:
    """The model with these (layer, head) pairs' attention outputs zeroed, as the hook engine.inspection.probe.
    zero_heads at blocks.{layer}.attn.z zeroes them: attn_out = z (T, H*hd) @ wo (H*hd, d), so zeroing head h's
    slice of z is zeroing rows h*hd .. (h+1)*hd of wo (each such product term is exactly 0 either way, for finite
    values). Only the changed layers' wo are copied; every other weight is shared. A float32 model with a native
    decode step keeps it (reading the variant's weights: the changed wo, every other one shared), so the variant
    decodes as fast as the model; the PyTorch forward computes the same numbers as the hooked model's."""
    hd, H, L = model.config.head_dim, model.config.num_heads, model.config.num_layers
    by_layer: dict[int, set[int]] = {}
    for layer, head in heads:
        if not (0 <= int(layer) < L and 0 <= int(head) < H):
            raise InputError(f"no head L{layer}h{head}: layers are [0, {L}), heads [0, {H})")
        by_layer.setdefault(int(layer), set()).add(int(head))
    layers, wos = list(model.weights.layers), {}
    for layer, hs in by_layer.items():
        wo = as_float(layers[layer].wo).clone()     # kept quantised: its dequantised value, zeroed rows
        for h in hs:
            wo[h * hd:(h + 1) * hd] = 0
        wos[layer] = wo
        layers[layer] = dataclasses.replace(layers[layer], wo=wo)
    names = ", ".join(f"L{layer}h{h}" for layer in sorted(by_layer) for h in sorted(by_layer[layer]))
    variant = derive(model, dataclasses.replace(model.weights, layers=layers), dtype=model.dtype,
                     name=f"{model.name} [zeroed: {names}]")
    for attr in ("resid_fp32_from", "fp32_units", "cache_dtype", "rope", "base_name"):   # a plan stays one
        setattr(variant, attr, getattr(model, attr))
    step = model.accelerator.decode
    shared = None if step is None else step.sharing(variant, "wo", wos)
    if shared is None:
        return variant
    return variant.with_accelerator(Accelerator(shared, variant.accelerator.stats))


def precision_plan(model: Model, units: list[str] | tuple[str, ...], source: Model | None = None) -> Model:
    """A precision plan: this (lower-precision) model with the named units computed in fp32. Units: embed (the
    embedding table in fp32, so the stream it starts is fp32), blocks.{i}.attn (its weights, RoPE and its KV cache
    in fp32: a plan with one keeps the whole cache in fp32, which holds the other layers' keys and values
    exactly), blocks.{i}.mlp, blocks.{i}.resid (the residual stream in fp32 from layer i on), final_norm, logits.
    Only those units' weights are copied to fp32 (from source when given, e.g. the fp32 model, else upcast from
    this one); every other weight is shared with this model. A plan of a plan holds both plans' units."""
    units = list(dict.fromkeys([*model.fp32_units, *units]))
    src = source or model
    layers, resid_from = list(model.weights.layers), model.resid_fp32_from
    ends = {"embed": ("embed",), "final_norm": ("norm",), "logits": ("lm_head", "head_bias")}  # unit -> Weights fields
    whole = {f: getattr(model.weights, f) for fields in ends.values() for f in fields}
    for unit in units:
        layer, part = _split_unit(unit, model.config.num_layers)
        if part == "resid":
            resid_from = layer if resid_from is None else min(resid_from, layer)
        elif part in ("attn", "mlp"):
            fields = ATTN_WEIGHTS if part == "attn" else MLP_WEIGHTS
            lw = src.weights.layers[layer]
            layers[layer] = dataclasses.replace(layers[layer], **{f: _fp32_copy(getattr(lw, f)) for f in fields})
        else:
            for f in ends[part]:
                whole[f] = _fp32_copy(getattr(src.weights, f), rows=f == "embed")
    weights = dataclasses.replace(model.weights, layers=layers, **whole)   # LayerNorm bias, positions: shared
    plan = derive(model, weights, dtype=model.dtype, name=f"{model.base_name} [fp32: {', '.join(units) or 'none'}]")
    plan.base_name, plan.resid_fp32_from, plan.fp32_units = model.base_name, resid_from, units
    if any(u.endswith(".attn") for u in units):
        plan.rope = RopeTables(model.config, model.device, torch.float32, tuple(model.rope))
        plan.cache_dtype = torch.float32
    return plan


def _fp32_copy(t, rows: bool = False):
    """A weight's float32 copy in the engine's layout; a matrix kept quantised (a source loaded as stored) by its
    dequantised values: (in, out), or (V, d) rows for the embedding table (rows=True)."""
    if isinstance(t, QuantMatrix):
        return t.dequantize().t().contiguous() if rows else t.dequantize()
    return None if t is None else t.to(torch.float32, copy=True)


def _split_unit(unit: str, num_layers: int) -> tuple[int | None, str]:
    """'blocks.3.mlp' -> (3, 'mlp'); 'final_norm' -> (None, 'final_norm'); anything else is an InputError."""
    if unit in ("embed", "final_norm", "logits"):
        return None, unit
    parts = unit.split(".")
    if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit() and parts[2] in ("attn", "mlp", "resid") \
            and int(parts[1]) < num_layers:
        return int(parts[1]), parts[2]
    raise InputError(f"unknown precision unit {unit!r}; units are {', '.join(PRECISION_UNITS)} "
                     f"with i in [0, {num_layers})")
