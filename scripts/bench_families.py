"""Decode tokens/s of the native step (engine/native/decode.c) against the PyTorch forward on random models of
classic shapes the native step newly computes: GPT-2-small-shaped ones (124M: LayerNorms with biases, learned
positions, a plain GELU-tanh MLP, the head tied), with GPT-2's own vocabulary of 50,257 (gpt2-small: the products'
tails of one column, row_product.h) and with it padded to 50,304 (gpt2-124m: nanoGPT's padding, a multiple of 8, which
the native step once needed), and a Pythia-410M-shaped GPT-NeoX (parallel block, rotary fraction 0.25, exact-erf
GELU). Weights are engine.bench.sizes.make_model's (random, written once under
$LLM_INSPECTOR_CACHE/bench-sizes). Both paths run in this process, on the same model, in alternating turns of
`--tokens` greedy decode steps (each its own cache, after the same prefill), so that a change in the machine's load
reaches both; prints the median of each path's turns and the load average.

    PYTHONPATH=. python scripts/bench_families.py [--turns 5] [--tokens 16] [--threads 2] [--dtypes float32,bfloat16]
        [--shapes gpt2-small,gpt2-124m,pythia-410m]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import engine  # noqa: F401  (first: the thread policy, before torch loads libgomp)
import torch
from engine.accelerator import PLAIN
from engine.bench.sizes import folder, make_model
from engine.loader import load_model

GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
        "n_inner": 3072, "n_positions": 1024, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
        "tie_word_embeddings": True}
SHAPES = {
    "gpt2-small": {**GPT2, "vocab_size": 50257},
    "gpt2-124m": {**GPT2, "vocab_size": 50304},
    "pythia-410m": {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 1024,
                    "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
                    "max_position_embeddings": 2048, "vocab_size": 50304, "rotary_pct": 0.25,
                    "rotary_emb_base": 10000, "layer_norm_eps": 1e-5, "hidden_act": "gelu",
                    "use_parallel_residual": True, "tie_word_embeddings": False},
}
PROMPT = [1, 400, 2000, 31, 77, 1234, 9000, 15] * 4


def turn(model, cache, token: int, n: int) -> tuple[float, int]:
    """n greedy decode steps from `token` -> (seconds, the last token)."""
    t0 = time.perf_counter()
    for _ in range(n):
        token = int(model.forward(torch.tensor([token]), cache)[-1].float().argmax())
    return time.perf_counter() - t0, token


def bench(name: str, dtype: str, turns: int, tokens: int) -> str:
    model = load_model(make_model(name, SHAPES[name], folder()), device="cpu", dtype=dtype)
    if model.accelerator.decode is None:
        raise SystemExit(f"{name} {dtype}: no native step ({model.accelerator.why_not})")
    paths = {"native": model, "pytorch": model.with_accelerator(PLAIN)}
    caches = {k: m.new_cache(len(PROMPT) + turns * tokens + 1) for k, m in paths.items()}
    last = {k: int(m.forward(torch.tensor(PROMPT), caches[k], last_only=True)[-1].float().argmax())
            for k, m in paths.items()}
    rates: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(turns):
        for k, m in paths.items():
            secs, last[k] = turn(m, caches[k], last[k], tokens)
            rates[k].append(tokens / secs)
    a, b = (statistics.median(rates[k]) for k in ("native", "pytorch"))
    return f"{name:12s} {dtype:9s} native {a:7.1f} tok/s  pytorch {b:7.1f} tok/s  ({a / b:4.2f}x)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"some of {', '.join(SHAPES)}")
    a = ap.parse_args()
    unknown = set(a.shapes.split(",")) - set(SHAPES)
    if unknown:
        raise SystemExit(f"no such shape: {', '.join(sorted(unknown))} (the shapes: {', '.join(SHAPES)})")
    torch.set_num_threads(a.threads)
    print(f"{a.threads} threads, load average {os.getloadavg()[0]:.2f} at the start")
    for name in a.shapes.split(","):
        for dtype in a.dtypes.split(","):
            print(bench(name, dtype, a.turns, a.tokens), f"(load {os.getloadavg()[0]:.2f})", flush=True)


if __name__ == "__main__":
    main()
