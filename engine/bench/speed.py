"""python -m engine bench: prefill and decode speed of this engine, with and without statistics on every
stage, against transformers on the same weights, prompt and thread count, and against the machine's
memory-bandwidth floor, in one run.

This machine's memory speed moves between phases (its large read measured 33 and 57 GB/s minutes apart), so
a and b run side by side, a few decoded tokens of each in turn (BLOCK) with large reads after each pair of
blocks: within a round all of them meet the same phase. A round's decode time of each is the median of its
steps, its read time the best of its reads; each ratio (a/floor, b/a) is taken within a round, and the median over the
rounds is reported. The speeds printed are the best round's. transformers (c) runs its own generate in
rounds between ours (best of its rounds).

Plain prefill against transformers at 512 and 2,048 tokens (a_over_c_prefill_512, a_over_c_prefill_2048;
engine.bench.prefill): interleaved, the median of the rounds' own ratios (at most 3 rounds), in the same run.
--app adds the app's full inspection (engine.bench.inspection) and the app's whole run of a 2,048-token prompt
against engine generate (app_run_ratio_2048; engine.bench.app_run).

The floor: decoding one token at batch 1 must read every weight matrix once (plus the KV cache so far), so
no implementation can decode faster than read bandwidth / bytes per token. The bandwidth is measured here,
in the same run, as the best of several reads (a sum) of a buffer far larger than the caches.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.bench.held import held_line
from engine.bench.inspection import run_inspection_bench
from engine.bench.prefill import LENGTHS, prefill_vs_transformers
from engine.family.slots import MATRICES
from engine.generate import GenerationRun
from engine.quant_matrix import QuantMatrix
from engine.inspection.probe import Probe

READ_BUFFER_BYTES = 512 * 2 ** 20        # far larger than any last-level cache
PREFILLS = 3     # prefills of each configuration a round
BLOCK = 8        # decoded tokens of one configuration in a row (each as a user's run has them, back to back)


def _round(model, ids: list[int], new_tokens: int, read: "ReadBandwidth", mats: "MatrixReads") -> dict:
    """One round of a (hooks off) and b (statistics on every stage) side by side: PREFILLS prefills of each in
    turn (the median is the round's), then BLOCK decoded tokens of a, BLOCK of b, three large reads and one
    pass of matrix reads, in turn."""
    prefills: dict[str, list[float]] = {"a": [], "b": []}
    for _ in range(PREFILLS):       # a, b, a, b, ...: the last pair goes on decoding
        runs = {"a": GenerationRun(model, ids, max_new_tokens=new_tokens, ignore_eos=True),
                "b": GenerationRun(model, ids, max_new_tokens=new_tokens, ignore_eos=True,
                                   probe=Probe().record_stats("*"))}
        for k, run in runs.items():
            run.step()
            prefills[k].append(run.timings["prefill"])
    steps: dict[str, list[float]] = {"a": [], "b": []}
    reads, mat_reads = [], []
    for i in range(0, new_tokens - 1, BLOCK):
        for k, run in runs.items():
            for _ in range(min(BLOCK, new_tokens - 1 - i)):
                before = run.timings["decode"]
                run.step()
                steps[k].append(run.timings["decode"] - before)
        reads += [read.measure() for _ in range(3)]
        mat_reads.append(mats.measure())
    return {"prefill_a": statistics.median(prefills["a"]), "prefill_b": statistics.median(prefills["b"]),
            "decode_a": statistics.median(steps["a"]), "decode_b": statistics.median(steps["b"]),
            "read": min(reads), "mats": min(mat_reads)}


def hf_load(model):
    """transformers' model of the same weights (SDPA attention, same dtype and device), or None where it cannot
    load one (not installed, another architecture)."""
    try:
        import transformers
    except ImportError:
        return None
    if model.config.num_experts:      # its experts loop would measure transformers' MoE, not a peer's decode
        return None
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model.path), dtype=model.dtype,
                                                           attn_implementation="sdpa")
    return hf.to(model.device).eval()


@torch.inference_mode()
def hf_speed(hf, ids: list[int], new_tokens: int, device) -> tuple[float, float]:
    """transformers' prefill and decode tokens/s of ids then new_tokens greedy tokens (its own generate)."""
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


def bytes_per_decoded_token(model, position: float) -> int:
    """Bytes one decode step must read: every layer's weights, the final norm, the lm_head, one embedding
    row, and the KV cache of `position` earlier positions."""
    w = model.weights
    tensors = [w.norm, w.lm_head] + [t for lw in w.layers for t in lw.present().values()]
    seen, total = set(), 0
    for t in tensors:
        t = t.blocks if isinstance(t, QuantMatrix) else t       # kept quantised: its block bytes are what is read
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    total += w.embed.blocks.shape[1] if isinstance(w.embed, QuantMatrix) else w.embed.shape[1] * w.embed.element_size()
    cache = model.new_cache(1)
    return int(total + cache.bytes_per_token * position)


class ReadBandwidth:
    """Bytes per second of reading a buffer far larger than the caches (best of the reads so far)."""

    def __init__(self, device, nbytes: int = READ_BUFFER_BYTES) -> None:
        self.buf = torch.ones(nbytes // 4, device=device)
        self.device = device
        self.best = float("inf")

    def measure(self) -> float:
        _sync(self.device)
        t0 = time.perf_counter()
        self.buf.sum()
        _sync(self.device)
        seconds = time.perf_counter() - t0
        self.best = min(self.best, seconds)
        return seconds

    @property
    def bytes_per_second(self) -> float:
        return self.buf.numel() * self.buf.element_size() / self.best


class MatrixReads:
    """Seconds to read every weight matrix a decode step reads, one op per matrix (a sum), in forward order:
    what any implementation that streams each matrix with its own kernel cannot beat (best so far)."""

    def __init__(self, model) -> None:
        w = model.weights
        self.mats = [t.blocks if isinstance(t, QuantMatrix) else t       # kept quantised: its bytes are read
                     for t in [getattr(lw, f) for lw in w.layers for f in MATRICES] + [w.lm_head] if t is not None]
        self.device = model.device
        self.best = float("inf")

    def measure(self) -> float:
        _sync(self.device)
        t0 = time.perf_counter()
        for m in self.mats:
            m.sum()
        _sync(self.device)
        seconds = time.perf_counter() - t0
        self.best = min(self.best, seconds)
        return seconds


def measure(model, a: argparse.Namespace) -> dict:
    """The rounds (see the module docstring): per-round figures, the best of each, and c's best."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size - 100, (a.prompt_tokens,), generator=g).tolist()
    hf = hf_load(model)
    read, mats = ReadBandwidth(model.device), MatrixReads(model)
    _round(model, ids, 4, read, mats)                 # warm-up: first touches of weights and kernels
    if hf is not None:
        hf_speed(hf, ids, 4, model.device)
    rounds, c = [], (0.0, 0.0)
    for _ in range(a.repeats):
        rounds.append(_round(model, ids, a.new_tokens, read, mats))
        if hf is not None:
            p, d = hf_speed(hf, ids, a.new_tokens, model.device)
            c = (max(c[0], p), max(c[1], d))
    n, nbytes = len(ids), bytes_per_decoded_token(model, a.prompt_tokens + a.new_tokens / 2)
    buf = read.buf.numel() * read.buf.element_size()
    best = {f"{k}: engine, {what}": (n / min(r[f"prefill_{k}"] for r in rounds),
                                     1 / min(r[f"decode_{k}"] for r in rounds))
            for k, what in (("a", "hooks off"), ("b", "stats on every stage"))}
    if hf is not None:
        best["c: transformers generate"] = c
    median = statistics.median
    prefills = {} if hf is None else prefill_vs_transformers(
        model, hf, tuple(getattr(a, "prefill_lengths", LENGTHS)), rounds=a.repeats)
    return {"best": best, "prefills": prefills, "read_gb_s": read.bytes_per_second / 1e9, "bytes_per_token": nbytes,
            "floor_tok_s": read.bytes_per_second / nbytes, "matrix_reads_tok_s": 1 / mats.best,
            "rounds": len(rounds),
            "floor_ratio": median(r["read"] * nbytes / buf / r["decode_a"] for r in rounds),
            "mats_ratio": median(r["mats"] / r["decode_a"] for r in rounds),
            "b_a_prefill": median(r["prefill_a"] / r["prefill_b"] for r in rounds),
            "b_a_decode": median(r["decode_a"] / r["decode_b"] for r in rounds)}


def report(model, a: argparse.Namespace, m: dict) -> dict:
    """Print the table and ratios; return the figures for --json."""
    best, out = m["best"], {}
    say = (lambda *x, **k: None) if a.json else print
    say(f"model {model.name}; device {model.device.type}; dtype {str(model.dtype).removeprefix('torch.')}; "
        f"threads {torch.get_num_threads()}; prompt {a.prompt_tokens} tokens; decode {a.new_tokens} tokens; "
        f"{a.repeats} rounds (a and b step by step, a large read after each pair)")
    nat = model.accelerator.decode
    why = model.accelerator.why_not
    say("decode steps: " + ("native (engine/native: one C call a token, reading the model's own weights)" if nat is not None
                            else f"PyTorch forward ({why})"))
    out["native_decode"] = nat is not None
    out["decode_path"] = "native" if nat is not None else f"PyTorch forward: {why}"
    say(f"{'configuration':34s} {'prefill tok/s':>14s} {'decode tok/s':>13s}")
    for k, (p, d) in best.items():
        say(f"{k:34s} {p:14.1f} {d:13.1f}")
    A, B = best["a: engine, hooks off"], best["b: engine, stats on every stage"]
    say(f"{'floor: memory bandwidth':34s} {'':14s} {m['floor_tok_s']:13.1f}   ({m['bytes_per_token'] / 1e6:.0f} MB "
        f"per token at {m['read_gb_s']:.1f} GB/s read)")
    out.update(decode_floor_ratio=m["floor_ratio"], b_over_a_prefill=m["b_a_prefill"], b_over_a_decode=m["b_a_decode"],
               read_gb_s=m["read_gb_s"], bytes_per_token=m["bytes_per_token"], floor_tok_s=m["floor_tok_s"],
               a_prefill_tok_s=A[0], a_decode_tok_s=A[1], b_prefill_tok_s=B[0], b_decode_tok_s=B[1])
    say(f"{'reading each weight matrix once':34s} {'':14s} {m['matrix_reads_tok_s']:13.1f}   (one sum per matrix, "
        "in forward order: what a kernel per matrix cannot beat)")
    out.update(matrix_reads_tok_s=m["matrix_reads_tok_s"], decode_matrix_reads_ratio=m["mats_ratio"])
    say(f"ratio a/floor (decode vs bandwidth)  {out['decode_floor_ratio']:.2f}   (target >= 0.75); "
        f"a/matrix reads {out['decode_matrix_reads_ratio']:.2f}")
    say(f"ratio b/a (stats overhead)        prefill {out['b_over_a_prefill']:.2f}  "
        f"decode {out['b_over_a_decode']:.2f}   (target >= 0.9)")
    say(f"(ratios: median over {m['rounds']} rounds of each round's own ratio; speeds: the best round's)")
    if "c: transformers generate" in best:
        C = best["c: transformers generate"]
        out.update(a_over_c_prefill=A[0] / C[0], a_over_c_decode=A[1] / C[1], c_prefill_tok_s=C[0],
                   c_decode_tok_s=C[1])
        say(f"ratio a/c (engine vs transformers) prefill {A[0] / C[0]:.2f}  decode {A[1] / C[1]:.2f}   "
            "(target decode >= 2.0)")
        at = {k: v for k, v in m["prefills"].items() if k.startswith("a_over_c_prefill_")}
        out.update(at)
        say("ratio a/c plain prefill (engine generate's prefill vs transformers SDPA, interleaved, median of "
            f"{len(next(iter(m['prefills']['prefill_rounds'].values()), []))} rounds) " +
            "  ".join(f"{k.removeprefix('a_over_c_prefill_')} tokens {v:.2f}" for k, v in at.items()) +
            "   (target >= 1.0)")
    else:
        out["a_over_c_decode"] = None
        say("ratio a/c: transformers is not installed; no reference measured")
    return out


def run_bench(model, a: argparse.Namespace, held: dict | None = None) -> int:
    """held: engine.bench.held's figures of this model, measured before anything else was loaded beside it."""
    a.json = getattr(a, "json", False)
    out = report(model, a, measure(model, a))
    if held is not None:
        out.update(held)
        if not a.json:
            print(held_line(held))
    if getattr(a, "app", False):
        out.update(run_inspection_bench(model, tuple(getattr(a, "app_lengths", (512, 2048, 8000))), quiet=a.json,
                                        app_run_tokens=getattr(a, "app_run_tokens", 2048),
                                        rounds=min(a.repeats, 3)))
    if a.json:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()
                          if not k.endswith("_rounds")}))
    return 0
