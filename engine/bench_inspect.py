"""python -m engine bench --app: what full inspection (statistics of every stage incl. attention maps, the
logits kept) costs against a plain prefill, and how much a run keeps afterwards."""
from __future__ import annotations

import time

import torch

from .model import Model
from .probe import Probe, inspection_probe


def retained_bytes(probe: Probe) -> int:
    """Bytes a run keeps after it ends: statistics blocks and captured tensors."""
    total = sum(b.values.numel() * b.values.element_size() for b in probe.stats)
    return total + sum(c.value.numel() * c.value.element_size() for c in probe.captures
                       if isinstance(c.value, torch.Tensor))


def prefill_seconds(model: Model, ids: list[int], probe: Probe | None) -> float:
    cache = model.new_cache(len(ids) + 1)
    t0 = time.perf_counter()
    model.forward(torch.tensor(ids), cache, probe, last_only=True)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_inspection_bench(model: Model, lengths: tuple[int, ...] = (512, 2048), repeats: int = 2) -> None:
    g = torch.Generator().manual_seed(1)
    print("\napp: full inspection (statistics of every stage incl. attention maps, logits kept) vs plain prefill")
    print(f"{'prompt tokens':>13s} {'plain s':>9s} {'inspected s':>12s} {'ratio':>6s} {'kept MiB':>9s}")
    for n in lengths:
        n = min(n, model.context_length - 1)
        ids = torch.randint(100, model.config.vocab_size - 100, (n,), generator=g).tolist()
        prefill_seconds(model, ids[:16], None)
        plain = min(prefill_seconds(model, ids, None) for _ in range(repeats))
        best, kept = float("inf"), 0
        for _ in range(repeats):
            probe = inspection_probe(timing=False)
            best = min(best, prefill_seconds(model, ids, probe))
            kept = retained_bytes(probe)
        print(f"{n:13d} {plain:9.3f} {best:12.3f} {best / plain:6.2f} {kept / 2**20:9.2f}")
