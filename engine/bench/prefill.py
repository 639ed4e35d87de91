"""This engine's plain prefill against transformers' at fixed prompt lengths (512 and 2,048 tokens), for
python -m engine bench (keys a_over_c_prefill_512, a_over_c_prefill_2048).

a: the prefill of engine.generate's GenerationRun, hooks off (its first step: the prompt into the KV cache in
chunks of PREFILL_CHUNK positions, the last position's logits), as `python -m engine generate` runs it.
c: transformers' LlamaForCausalLM (attn_implementation "sdpa", the same weights, dtype and thread count) on the
same ids in one forward with use_cache=True and logits_to_keep=1 (the last position's logits, as its generate
asks for in its prefill).

Each side first runs once at each length, untimed (the memory a run of that length allocates is touched for
the first time then). The two run interleaved within a round (a then c in even rounds, c then a in odd ones,
so a drift of the machine's speed within a round favours neither), and a round's ratio is c's seconds over
a's seconds: a's speed over c's, >= 1 when this engine is at least as fast. The reported figure is the median
over the rounds of the rounds' own ratios.
"""
from __future__ import annotations

import statistics
import time

import torch

from engine.generate import GenerationRun
from engine.results import Step

LENGTHS = (512, 2048)


def engine_prefill(model, ids: list[int]) -> tuple[float, Step]:
    """Seconds of GenerationRun's prefill (hooks off), and its step (the top candidates of the last position)."""
    run = GenerationRun(model, ids, max_new_tokens=1, ignore_eos=True)
    step = run.step()
    return run.timings["prefill"], step


@torch.inference_mode()
def hf_prefill(hf, ids: list[int], device) -> tuple[float, torch.Tensor]:
    """Seconds of transformers' prefill forward (use_cache, logits_to_keep=1), and its last logits (V,)."""
    x = torch.tensor([ids], device=device)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = hf(x, use_cache=True, logits_to_keep=1)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out.logits[0, -1].float().cpu()


def prefill_vs_transformers(model, hf, lengths: tuple[int, ...] = LENGTHS, rounds: int = 3) -> dict:
    """{"a_over_c_prefill_<n>": median over rounds of (c's seconds / a's seconds), ...} and the rounds' seconds
    under "prefill_rounds" ({n: [(a_s, c_s), ...]}). Prompt lengths are cut to the model's context."""
    g = torch.Generator().manual_seed(3)
    out: dict = {"prefill_rounds": {}}
    for n in lengths:
        n_ids = min(n, model.context_length - 1)
        ids = torch.randint(100, model.config.vocab_size - 100, (n_ids,), generator=g).tolist()
        engine_prefill(model, ids)                        # warm-up at this length, untimed: the allocator's first
        hf_prefill(hf, ids, model.device)                 # touches of buffers this size are neither side's cost
        times = []
        for r in range(rounds):
            if r % 2 == 0:
                a = engine_prefill(model, ids)[0]
                c = hf_prefill(hf, ids, model.device)[0]
            else:
                c = hf_prefill(hf, ids, model.device)[0]
                a = engine_prefill(model, ids)[0]
            times.append((a, c))
        out["prefill_rounds"][n] = times
        out[f"a_over_c_prefill_{n}"] = statistics.median(c / a for a, c in times)
    return out
