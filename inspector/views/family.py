"""What a model's family changes from a plain Llama block, said in a line each with the page that shows it: sliding-
window layers (KV cache, Attention), learned positions, a rotary fraction or RoPE on adjacent pairs (Attention),
mixture-of-experts layers and a parallel residual (Activations), a final logit soft cap (Sampling)."""
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
    if cfg.family.positions == "learned":
        notes.append(("positions are learned vectors added to the token embedding, not RoPE: attn.q_rot and attn.k_rot "
                      "are attn.q and attn.k unrotated", "attention"))
    elif cfg.rotary_dim != cfg.head_dim:
        notes.append((f"RoPE rotates the first {cfg.rotary_dim} of each head's {cfg.head_dim} dimensions; the rest "
                      "carry no position", "attention"))
    if cfg.family.positions == "rope_interleaved":
        notes.append(("RoPE rotates adjacent pairs of dimensions (2j, 2j + 1) of each head, not its two halves",
                      "attention"))
    if cfg.parallel_residual:
        notes.append(("attention and the MLP both read the block's input and add to the stream together (a parallel "
                      "residual): a block has no resid_mid", "activations"))
    if cfg.final_softcap is not None:
        notes.append((f"the logits are soft-capped: {cfg.final_softcap:g} · tanh(logits / {cfg.final_softcap:g}) "
                      "before sampling", "sampling"))
    return notes
