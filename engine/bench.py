"""python -m engine bench: prefill and decode speed of this engine, with and without statistics on every
stage, against transformers on the same weights, prompt and thread count, in one run.

Rounds are interleaved (a, b, c, a, b, c, ...) and the best of each configuration is kept, so a burst of
load from elsewhere on a shared machine hurts all three alike rather than one of them.
"""
from __future__ import annotations

import argparse
import time

import torch

from .bench_inspect import run_inspection_bench
from .probe import Probe


def _engine(model, ids: list[int], new_tokens: int, stats: bool) -> tuple[float, float]:
    probe = Probe().record_stats("*") if stats else None
    r = model.generate(ids, max_new_tokens=new_tokens, ignore_eos=True, probe=probe)
    return len(ids) / r.timings["prefill"], (new_tokens - 1) / r.timings["decode"]


def _hf_load(model):
    try:
        import transformers
    except ImportError:
        return None
    if model.config.model_type not in ("llama", "mistral", "qwen2"):
        return None
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model.path), dtype=model.dtype)
    return hf.to(model.device).eval()


@torch.inference_mode()
def _hf(hf, ids: list[int], new_tokens: int, device) -> tuple[float, float]:
    x = torch.tensor([ids], device=device)
    _sync(device)
    t0 = time.perf_counter()
    hf(x, use_cache=True)
    _sync(device)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                pad_token_id=0, attention_mask=torch.ones_like(x))
    _sync(device)
    total = time.perf_counter() - t0
    return len(ids) / prefill, (new_tokens - 1) / max(total - prefill, 1e-9)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_bench(model, a: argparse.Namespace) -> int:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size - 100, (a.prompt_tokens,), generator=g).tolist()
    hf = _hf_load(model)
    print(f"model {model.name}; device {model.device.type}; dtype {str(model.dtype).removeprefix('torch.')}; "
          f"threads {torch.get_num_threads()}; prompt {a.prompt_tokens} tokens; decode {a.new_tokens} tokens; "
          f"{a.repeats} interleaved rounds, best of each")
    configs = {"a: engine, hooks off": lambda: _engine(model, ids, a.new_tokens, False),
               "b: engine, stats on every stage": lambda: _engine(model, ids, a.new_tokens, True)}
    if hf is not None:
        configs["c: transformers generate"] = lambda: _hf(hf, ids, a.new_tokens, model.device)
    for fn in configs.values():  # warm-up: first touches of weights and kernels
        fn()
    best = {k: (0.0, 0.0) for k in configs}
    for _ in range(a.repeats):
        for k, fn in configs.items():
            p, d = fn()
            best[k] = (max(best[k][0], p), max(best[k][1], d))
    print(f"{'configuration':34s} {'prefill tok/s':>14s} {'decode tok/s':>13s}")
    for k, (p, d) in best.items():
        print(f"{k:34s} {p:14.1f} {d:13.1f}")
    A, B = best["a: engine, hooks off"], best["b: engine, stats on every stage"]
    print(f"ratio b/a (stats overhead)        prefill {B[0] / A[0]:.2f}  decode {B[1] / A[1]:.2f}   (target >= 0.7)")
    if hf is not None:
        C = best["c: transformers generate"]
        print(f"ratio a/c (engine vs transformers) prefill {A[0] / C[0]:.2f}  decode {A[1] / C[1]:.2f}   "
              "(target decode >= 1.3)")
    else:
        print("ratio a/c: transformers is not installed; no reference measured")
    if a.app:
        run_inspection_bench(model)
    return 0
