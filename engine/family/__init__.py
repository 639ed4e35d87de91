"""Model families: one declaration each (engine.family.declared), the per-layer weight slots every list of weights
derives from (engine.family.slots), and the shapes of their parts."""
from __future__ import annotations

from engine.errors import UnsupportedModelError
from engine.family.declared import BY_GGUF_ARCH, EXPERTS_OF, FAMILIES, Family
from engine.family.slots import SLOTS, Slot

__all__ = ["FAMILIES", "Family", "SLOTS", "Slot", "family", "family_for_gguf", "part_shape"]


def family(model_type, where: str = "config") -> Family:
    fam = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if fam is None:
        raise UnsupportedModelError(f"{where}: unsupported architecture model_type={model_type!r}; supported: "
                                    f"{', '.join(FAMILIES)}")
    return fam


def family_for_gguf(arch, has_experts: bool = False) -> Family:
    """The declared family of a GGUF file's general.architecture. Families that share an architecture name are told
    apart by the file's tensors: llama.cpp's converter writes Mixtral as "llama" with stacked experts
    (ffn_gate_exps), so a "llama" file with experts is mixtral."""
    fam = BY_GGUF_ARCH.get(arch) if isinstance(arch, str) else None
    if fam is None:
        raise UnsupportedModelError(f"GGUF general.architecture={arch!r} is not supported; supported: "
                                    f"{', '.join(BY_GGUF_ARCH)}")
    return EXPERTS_OF.get(fam.model_type, fam) if has_experts else fam


def part_shape(key: str, cfg) -> tuple[int, ...]:
    """The checkpoint shape of a part (its declared shape key) under a ModelConfig, in HF's (out, in) layout."""
    d, hd, H, K, F = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    Fe, E = cfg.moe_intermediate_size, cfg.num_experts
    return {"d": (d,), "hd": (hd,), "q": (H * hd, d), "k": (K * hd, d), "v": (K * hd, d),
            "qkv": ((H + 2 * K) * hd, d),
            "qkvb": ((H + 2 * K) * hd,), "upb": (F,), "qb": (H * hd,), "kb": (K * hd,), "vb": (K * hd,), "qn": (H * hd,),
            "kn": (K * hd,), "o": (d, H * hd), "gate": (F, d), "up": (F, d), "gate_up": (2 * F, d), "down": (d, F),
            "router": (E, d), "egate": (Fe, d), "eup": (Fe, d), "edown": (d, Fe)}[key]
