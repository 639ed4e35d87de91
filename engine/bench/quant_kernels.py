"""python -m engine.bench.quant_kernels: each quantised format's native product (engine/native/quant.c through
engine.quant_matrix) at B = 1 on an N x K matrix (default 2,048 x 8,192, one large model's projection), as GB/s of
the bytes the matrix is stored in and as billions of weights decoded a second (all threads), against the fp32
dot-product kernel of the same file on the same matrix in fp32 (the memory floor: a B = 1 product reads every weight
once and does two flops per 4 bytes) and torch's x @ w. Each format with llama.cpp's arithmetic too ("Q4_K int8":
load_model(quant="stored-int8")'s product, x rounded to 8 bits once a product, engine/native/quant_int8.h) beside
its exact-float one, the two measured in alternation on the same blocks.

The blocks are random bytes with small finite fp16 scales (any bytes are a valid block of these formats once
their scales are finite). This machine's memory speed moves minute to minute and other processes share its cores,
so the kernels run in rounds, each kernel a few products in turn within a round, and each one's best round is
reported, with the load average at the start and the end.

That matrix (10-70 MB) stays in this machine's caches from one product to the next, so it measures decoding. With
--stream MB each kernel instead multiplies copies of its matrix in turn, at least MB megabytes of them (default
1,024: past the caches), so that every product reads its rows from memory, as a decode step reads a model's
matrices: what the quantised products give the native step (engine/native/decode.c), against the fp32 kernel
streaming its own copies (the memory floor). Each format's copies are made, measured and freed in turn, so that at
most one format's and the fp32 copies are held at once."""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from engine.accelerator import float_product
from engine.quant_int8 import FORMATS as INT8_FORMATS
from engine.quant_matrix import BLOCKS, QuantMatrix

SCALES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
          "Q5_K": (0, 2), "Q6_K": (208,)}       # byte offsets of each block's fp16 scales (and minimum)


def random_matrix(fmt: str, N: int, K: int, seed: int = 0) -> QuantMatrix:
    rng = np.random.default_rng(seed)
    per, size = BLOCKS[fmt]
    raw = rng.integers(0, 256, (N, K // per, size), dtype=np.uint8)
    for at in SCALES[fmt]:
        raw[..., at:at + 2] = rng.uniform(-0.01, 0.01, (N, K // per)).astype(np.float16)[..., None].view(np.uint8)
    return QuantMatrix(f"bench.{fmt}", fmt, (N, K), torch.from_numpy(raw.reshape(N, -1)))


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _figures(N: int, K: int, size: int, seconds: float, floor_gb_s: float) -> dict:
    return {"bytes": size, "ms": round(seconds * 1e3, 3), "GB/s": round(size / seconds / 1e9, 2),
            "Gvalues/s": round(N * K / seconds / 1e9, 2), "of_floor": round(size / seconds / 1e9 / floor_gb_s, 2)}


def _copies(t: torch.Tensor, total: int) -> list[torch.Tensor]:
    """Distinct copies of t's bytes, at least `total` bytes of them together (one at least)."""
    n = max(1, -(-total // (t.numel() * t.element_size())))
    return [t.clone() for _ in range(n)]


def stream(N: int = 2048, K: int = 8192, megabytes: int = 1024, rounds: int = 3) -> dict:
    """Each kernel over copies of its matrix (at least `megabytes` MB of them), one product a copy in turn: every
    product reads its rows from memory. Per product figures (the best round's mean), the floor the fp32 kernel's
    streaming over its copies, measured before the formats and after (the better one kept)."""
    f32_rows = float_product()
    if f32_rows is None:
        raise SystemExit("the native library is not built: nothing to measure")
    load_before, total = os.getloadavg(), megabytes * 10**6
    x = torch.randn(1, K)

    def over(*kernels) -> list[float]:          # each kernel's best round's seconds a product, over every copy in
        for fns in kernels:                     # turn; the kernels alternate round by round
            for fn in fns[:2]:
                fn()                            # warm: the threads and the first touch
        best = [float("inf")] * len(kernels)
        for _ in range(rounds):
            for i, fns in enumerate(kernels):
                best[i] = min(best[i], _best(lambda fns=fns: [fn() for fn in fns], 1) / len(fns))
        return best

    w32 = _copies(torch.randn(N, K), total)
    f32 = [lambda w=w: f32_rows(w, x) for w in w32]
    seconds = {"fp32 (floor)": over(f32)[0]}
    sizes, copies = {"fp32 (floor)": N * K * 4}, {"fp32 (floor)": len(w32)}
    for fmt in BLOCKS:
        m = random_matrix(fmt, N, K)
        mats = [QuantMatrix(m.name, fmt, m.shape, b) for b in _copies(m.blocks, total)]
        names = [fmt] + ([f"{fmt} int8"] if fmt in INT8_FORMATS else [])
        kinds = [mats] + ([[q.with_arithmetic("int8") for q in mats]] if fmt in INT8_FORMATS else [])
        for name, t in zip(names, over(*[[lambda q=q: q.matmul(x) for q in k] for k in kinds])):
            seconds[name], sizes[name], copies[name] = t, m.nbytes, len(mats)
        del mats, kinds
    seconds["fp32 (floor)"] = min(seconds["fp32 (floor)"], over(f32)[0])
    floor = sizes["fp32 (floor)"] / seconds["fp32 (floor)"] / 1e9
    return {"N": N, "K": K, "B": 1, "threads": torch.get_num_threads(), "streamed_bytes_at_least": total,
            "load_before": load_before, "load_after": os.getloadavg(),
            "kernels": {name: _figures(N, K, sizes[name], t, floor) | {"copies": copies[name]}
                        for name, t in seconds.items()}}


def run(N: int = 2048, K: int = 8192, rounds: int = 5, reps: int = 5) -> dict:
    f32_rows = float_product()
    if f32_rows is None:
        raise SystemExit("the native library is not built: nothing to measure")
    load_before = os.getloadavg()
    x = torch.randn(1, K)
    w32 = torch.randn(N, K)                                     # (N, K): W's rows, as quant.c's fp32 kernel reads
    wt = w32.t().contiguous()                                   # (K, N): the engine's (in, out) layout for torch
    kernels = {"fp32 (floor)": (lambda: f32_rows(w32, x), w32.numel() * 4),
               "torch x @ w fp32": (lambda: x @ wt, w32.numel() * 4)}
    for fmt in BLOCKS:
        m = random_matrix(fmt, N, K)
        kernels[fmt] = ((lambda m=m: m.matmul(x)), m.nbytes)
        if fmt in INT8_FORMATS:
            kernels[f"{fmt} int8"] = ((lambda m=m.with_arithmetic("int8"): m.matmul(x)), m.nbytes)
    best = {name: float("inf") for name in kernels}
    for _ in range(rounds):
        for name, (fn, _) in kernels.items():
            fn()                                                # warm: the threads and the first touch
            best[name] = min(best[name], _best(fn, reps))
    floor = kernels["fp32 (floor)"][1] / best["fp32 (floor)"] / 1e9
    rows = {name: {"bytes": size, "ms": round(best[name] * 1e3, 3), "GB/s": round(size / best[name] / 1e9, 2),
                   "Gvalues/s": round(N * K / best[name] / 1e9, 2),
                   "of_floor": round(size / best[name] / 1e9 / floor, 2),
                   "x_fp32_time": round(best["fp32 (floor)"] / best[name], 2)}
            for name, (_, size) in kernels.items()}
    return {"N": N, "K": K, "B": 1, "threads": torch.get_num_threads(), "load_before": load_before,
            "load_after": os.getloadavg(), "kernels": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--stream", type=int, nargs="?", const=1024, default=None, metavar="MB",
                   help="multiply copies of each matrix, at least MB megabytes of them (default 1,024), in turn: "
                        "rows read from memory, not the caches")
    args = p.parse_args()
    if args.stream is not None:
        print(json.dumps(stream(args.n, args.k, args.stream, min(args.rounds, 3)), indent=1))
    else:
        print(json.dumps(run(args.n, args.k, args.rounds), indent=1))


if __name__ == "__main__":
    main()
