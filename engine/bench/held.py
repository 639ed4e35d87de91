"""What the loaded model holds (issue 44: memory near the weights' own size): the weights' bytes by dtype, and the
process's resident memory the load added, after loading and after a first decode, over those bytes. Measured by
`python -m engine bench` before anything else is loaded beside the model (transformers, the peer, comes after)."""
from __future__ import annotations

import torch

from engine.heap import trim
from engine.memory import gb, process_rss


def held_figures(model, rss_before: int, decode_tokens: int = 8) -> dict:
    """Called right after load_model; rss_before: the process's resident bytes just before it. Read now (the heap's
    free pages given back first: a load's passing buffers are not what it holds), then after a short decode (a
    16-token prompt, then decode_tokens one at a time, the model's own decode path), its KV cache's bytes taken out
    (caches are accounted apart from the weights)."""
    trim()
    rss_loaded = process_rss()
    cache = model.new_cache(16 + decode_tokens)
    logits = model.forward(torch.arange(100, 116), cache, None, last_only=True)
    for _ in range(decode_tokens):
        logits = model.forward(logits[-1:].argmax(-1), cache, None)
    trim()
    decoded = process_rss() - cache.bytes_allocated
    weights = model.weights.nbytes()
    return {"weights_bytes": weights, "weights_bytes_by_dtype": {str(k).removeprefix("torch."): v for k, v in model.weights.nbytes_by_dtype().items()},
            "held_after_load_over_weights": (rss_loaded - rss_before) / weights,
            "held_after_decode_over_weights": (decoded - rss_before) / weights}


def held_line(f: dict) -> str:
    dtypes = ", ".join(f"{k} {gb(v)}" for k, v in f["weights_bytes_by_dtype"].items())
    return (f"held: weights {gb(f['weights_bytes'])} ({dtypes}); the process grew by "
            f"{f['held_after_load_over_weights']:.2f}x that in loading, {f['held_after_decode_over_weights']:.2f}x "
            "after a first decode (its KV cache not counted)   (target <= 1.15)")
