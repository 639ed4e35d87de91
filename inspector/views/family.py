"""What a model's family changes from a plain Llama block, said in a line each with the page that shows it: sliding-
window layers (KV cache, Attention), mixture-of-experts layers (Activations), a final logit soft cap (Sampling)."""
from __future__ import annotations


def family_notes(cfg) -> list[tuple[str, str]]:
    """(sentence, page name) for each variation of this config that a page shows; [] for a plain Llama."""
    notes = []
    local = [w for w in cfg.layer_window if w is not None]
    if local:
        sizes = ", ".join(f"{w:,}" for w in sorted(set(local)))
        notes.append((f"{len(local)} of {cfg.num_layers} layers are local (sliding window of {sizes} positions), the "
                      f"others global: a local layer's KV cache is a ring that stops growing at its window",
                      "kv_cache"))
        notes.append(("a local layer's attention map is a band: each query sees only the last window of keys",
                      "attention"))
    moe = sum(cfg.layer_moe)
    if moe:
        notes.append((f"{moe} of {cfg.num_layers} layers are mixture-of-experts layers: each token goes to "
                      f"{cfg.experts_per_token} of {cfg.num_experts} experts", "activations"))
    if cfg.final_softcap is not None:
        notes.append((f"the logits are soft-capped: {cfg.final_softcap:g} · tanh(logits / {cfg.final_softcap:g}) "
                      "before sampling", "sampling"))
    return notes
