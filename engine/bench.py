"""python -m engine bench: prefill and decode speed of this engine, with and without statistics on every
stage, against transformers on the same weights, prompt and thread count, and against the machine's
memory-bandwidth floor, in one run.

Rounds are interleaved (a, b, c, read, a, b, c, read, ...) and the best of each configuration is kept, so a
burst of load from elsewhere on a shared machine hurts all of them alike rather than one of them.

The floor: decoding one token at batch 1 must read every weight matrix once (plus the KV cache so far), so
no implementation can decode faster than read bandwidth / bytes per token. The bandwidth is measured here,
in the same run, as the best of several reads (a sum) of a buffer far larger than the caches.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from .bench_inspect import run_inspection_bench
from .native import build
from .probe import Probe

READ_BUFFER_BYTES = 512 * 2 ** 20        # far larger than any last-level cache


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


def bytes_per_decoded_token(model, position: float) -> int:
    """Bytes one decode step must read: every layer's weights, the final norm, the lm_head, one embedding
    row, and the KV cache of `position` earlier positions."""
    w = model.weights
    tensors = [w.norm, w.lm_head] + [t for lw in w.layers for t in vars(lw).values() if t is not None]
    seen, total = set(), 0
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    total += w.embed.shape[1] * w.embed.element_size()
    cache = model.new_cache(1)
    return int(total + cache.bytes_per_token * position)


class ReadBandwidth:
    """Bytes per second of reading a buffer far larger than the caches (best of the reads so far)."""

    def __init__(self, device, nbytes: int = READ_BUFFER_BYTES) -> None:
        self.buf = torch.ones(nbytes // 4, device=device)
        self.device = device
        self.best = float("inf")

    def measure(self) -> None:
        _sync(self.device)
        t0 = time.perf_counter()
        self.buf.sum()
        _sync(self.device)
        self.best = min(self.best, time.perf_counter() - t0)

    @property
    def bytes_per_second(self) -> float:
        return self.buf.numel() * self.buf.element_size() / self.best


class MatrixReads:
    """Seconds to read every weight matrix a decode step reads, one op per matrix (a sum), in forward order:
    what any implementation that streams each matrix with its own kernel cannot beat (best so far)."""

    def __init__(self, model) -> None:
        w = model.weights
        self.mats = [t for lw in w.layers for t in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)] + [w.lm_head]
        self.device = model.device
        self.best = float("inf")

    def measure(self) -> None:
        _sync(self.device)
        t0 = time.perf_counter()
        for m in self.mats:
            m.sum()
        _sync(self.device)
        self.best = min(self.best, time.perf_counter() - t0)


def measure(model, a: argparse.Namespace) -> dict:
    """The interleaved rounds: best prefill/decode tok/s of each configuration, and the read bandwidth."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size - 100, (a.prompt_tokens,), generator=g).tolist()
    hf = _hf_load(model)
    configs = {"a: engine, hooks off": lambda: _engine(model, ids, a.new_tokens, False),
               "b: engine, stats on every stage": lambda: _engine(model, ids, a.new_tokens, True)}
    if hf is not None:
        configs["c: transformers generate"] = lambda: _hf(hf, ids, a.new_tokens, model.device)
    read, mats = ReadBandwidth(model.device), MatrixReads(model)
    for fn in configs.values():  # warm-up: first touches of weights and kernels
        fn()
    best = {k: (0.0, 0.0) for k in configs}
    for _ in range(a.repeats):
        for k, fn in configs.items():
            p, d = fn()
            best[k] = (max(best[k][0], p), max(best[k][1], d))
        for _ in range(2):
            read.measure()
            mats.measure()
    nbytes = bytes_per_decoded_token(model, a.prompt_tokens + a.new_tokens / 2)
    return {"best": best, "read_gb_s": read.bytes_per_second / 1e9, "bytes_per_token": nbytes,
            "floor_tok_s": read.bytes_per_second / nbytes, "matrix_reads_tok_s": 1 / mats.best}


def report(model, a: argparse.Namespace, m: dict) -> dict:
    """Print the table and ratios; return the figures for --json."""
    best, out = m["best"], {}
    say = (lambda *x, **k: None) if a.json else print
    say(f"model {model.name}; device {model.device.type}; dtype {str(model.dtype).removeprefix('torch.')}; "
        f"threads {torch.get_num_threads()}; prompt {a.prompt_tokens} tokens; decode {a.new_tokens} tokens; "
        f"{a.repeats} interleaved rounds, best of each")
    nat = model.native()
    why = "" if nat is not None else (build.load()[1] or "this model or device cannot take it")
    say("decode steps: " + ("native (engine/native: one C call a token, weights read as panels)" if nat is not None
                            else f"PyTorch forward ({why})"))
    out["native_decode"] = nat is not None
    say(f"{'configuration':34s} {'prefill tok/s':>14s} {'decode tok/s':>13s}")
    for k, (p, d) in best.items():
        say(f"{k:34s} {p:14.1f} {d:13.1f}")
    A, B = best["a: engine, hooks off"], best["b: engine, stats on every stage"]
    say(f"{'floor: memory bandwidth':34s} {'':14s} {m['floor_tok_s']:13.1f}   ({m['bytes_per_token'] / 1e6:.0f} MB "
        f"per token at {m['read_gb_s']:.1f} GB/s read)")
    out.update(decode_floor_ratio=A[1] / m["floor_tok_s"], b_over_a_prefill=B[0] / A[0], b_over_a_decode=B[1] / A[1],
               read_gb_s=m["read_gb_s"], bytes_per_token=m["bytes_per_token"], floor_tok_s=m["floor_tok_s"],
               a_prefill_tok_s=A[0], a_decode_tok_s=A[1], b_prefill_tok_s=B[0], b_decode_tok_s=B[1])
    say(f"{'reading each weight matrix once':34s} {'':14s} {m['matrix_reads_tok_s']:13.1f}   (one sum per matrix, "
        "in forward order: what a kernel per matrix cannot beat)")
    out.update(matrix_reads_tok_s=m["matrix_reads_tok_s"], decode_matrix_reads_ratio=A[1] / m["matrix_reads_tok_s"])
    say(f"ratio a/floor (decode vs bandwidth)  {out['decode_floor_ratio']:.2f}   (target >= 0.75); "
        f"a/matrix reads {out['decode_matrix_reads_ratio']:.2f}")
    say(f"ratio b/a (stats overhead)        prefill {B[0] / A[0]:.2f}  decode {B[1] / A[1]:.2f}   (target >= 0.9)")
    if "c: transformers generate" in best:
        C = best["c: transformers generate"]
        out.update(a_over_c_prefill=A[0] / C[0], a_over_c_decode=A[1] / C[1], c_prefill_tok_s=C[0],
                   c_decode_tok_s=C[1])
        say(f"ratio a/c (engine vs transformers) prefill {A[0] / C[0]:.2f}  decode {A[1] / C[1]:.2f}   "
            "(target decode >= 2.0)")
    else:
        out["a_over_c_decode"] = None
        say("ratio a/c: transformers is not installed; no reference measured")
    return out


def run_bench(model, a: argparse.Namespace) -> int:
    a.json = getattr(a, "json", False)
    out = report(model, a, measure(model, a))
    if getattr(a, "app", False):
        out.update(run_inspection_bench(model, tuple(getattr(a, "app_lengths", (512, 2048, 8000))), quiet=a.json))
    if a.json:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}))
    return 0
