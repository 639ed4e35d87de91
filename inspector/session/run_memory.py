"""What one run holds in memory while it generates, and the budget the runs in flight share (session.admission
admits a run only while the runs generating, with it, fit the budget).

A run's own memory grows with its length: its KV cache (allocated whole for the prompt plus the requested new
tokens: K and V of every layer, each position, in the cache's dtype, a window layer only its window) and its
probe's recording at that length (the app's inspection: seven float32 statistics of every stage of the forward at
every position, the sampler's stages at every new token, and each new token's logits row). Everything else a
step needs is shared (the weights) or freed when the step ends.

    need = run_bytes(model, n_prompt=40, max_new=32)
    budget = runs_budget(limits, model.device)      # bytes; 0: no bound but the count of runs
"""
from __future__ import annotations

import torch

from engine import Model
from engine.inspection.stages import SAMPLER_STAGES, forward_stages

from .limits import Limits

STAT_BYTES = 7 * 4            # one stage's statistics at one position: seven float32 values
AUTO_SHARE = 0.5              # with runs_memory_mb 0: this share of the memory available when first asked

_available: dict[str, int] = {}


def run_bytes(model: Model, n_prompt: int, max_new: int) -> int:
    """Bytes one inspected run of n_prompt + max_new positions holds at its end (its cache and recording)."""
    cfg, positions = model.config, n_prompt + max_new
    element = torch.empty(0, dtype=model.cache_dtype).element_size()
    rows = sum(positions if w is None or w >= positions else w for w in cfg.layer_window)
    cache = 2 * cfg.num_kv_heads * cfg.head_dim * element * rows
    stats = STAT_BYTES * (len(forward_stages(cfg)) * positions + len(SAMPLER_STAGES) * max_new)
    logits = 4 * cfg.vocab_size * max_new
    return cache + stats + logits


def runs_budget(limits: Limits, device: torch.device) -> int:
    """Bytes the runs generating at once may hold together: the limits' max_runs_mb, or (0) AUTO_SHARE of the
    memory the device had available when this process first asked (host memory for the CPU, free memory of a
    CUDA device)."""
    if limits.max_runs_mb:
        return limits.max_runs_mb * 2**20
    key = str(device)
    if key not in _available:
        _available[key] = _free_bytes(device)
    return int(AUTO_SHARE * _available[key])


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0        # unknown: no bound but the count of runs
