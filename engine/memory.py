"""What a model will hold in memory, known from its config before a byte of it is read, and whether this machine
has room for it: a model that cannot fit is refused before loading (ModelLoadError naming its size by dtype and
what is available), never killed by the kernel's out-of-memory killer halfway through.

The weights' bytes are exact: the checkpoint's tensors by their shapes (engine.weights.expected_tensors: a tied
model's one matrix counted once) at the dtype they are held in. Available memory is the kernel's MemAvailable,
lowered to what the process's cgroup still allows where it has a limit."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.weights import expected_tensors

HELD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Room kept beside the weights while they load and run: one layer's conversion at a time, the KV cache of a few
# thousand positions, a run's recording, the Python heap of the server. A fraction of what is available, so that
# a model that only just fits is refused rather than left to swap or be killed.
HEADROOM = 0.10
MIN_HEADROOM = 256 << 20
COPY_ADVICE = "A smaller model, or one loaded in float32 rather than kept quantised, can be."


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The bytes the engine holds for this config's weights in dtype (one copy of each tensor)."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(shape) for shape in expected_tensors(cfg).values()) * size


def available_bytes() -> int:
    """Memory this process may still take: MemAvailable (/proc/meminfo), or less where a cgroup limit is lower."""
    avail = _meminfo_available()
    limit = _cgroup_room()
    return min(avail, limit) if limit is not None else avail


def check_fits(cfg: ModelConfig, dtype: torch.dtype, where: str, available: int | None = None) -> int:
    """The weights' bytes in dtype; ModelLoadError when they (with HEADROOM) exceed what is available, naming the
    size in every dtype the engine holds and what this machine has."""
    sizes = ", ".join(f"{_name(dt)} {gb(weight_bytes(cfg, dt))}" for dt in HELD_DTYPES)
    return check_fits_bytes(weight_bytes(cfg, dtype), where, f"in {_name(dtype)} ({sizes})", available)


def check_fits_bytes(need: int, where: str, detail: str = "", available: int | None = None) -> int:
    """need (the weights' bytes, e.g. a GGUF file's blocks kept quantized); ModelLoadError when it (with HEADROOM)
    exceeds what is available."""
    avail = available_bytes() if available is None else available
    room = avail - max(MIN_HEADROOM, int(HEADROOM * avail))
    if need > room:
        raise ModelLoadError(
            f"{where}: this model's weights need {gb(need)}{' ' + detail if detail else ''} and this machine has "
            f"{gb(avail)} of memory available (some kept for the caches and runs): not loaded. Choose a smaller dtype "
            "or model, or free memory.")
    return need


def check_work_fits(need: int, what: str, detail: str, advice: str = "", available: int | None = None) -> int:
    """need: the bytes a computation on a loaded model allocates (detail: for what) -- a copy of its weights
    (engine.variants.cast_model, engine.tools.quant.quantized_model: a model kept quantised is copied through its
    float32 values, 8 bytes a value for an 8B-shaped file of 4.5 GB), the tuned lens fit's sums; ModelLoadError when
    it (with HEADROOM) exceeds what is available, before a byte is allocated, rather than the kernel's OOM killer."""
    avail = available_bytes() if available is None else available
    if need > avail - max(MIN_HEADROOM, int(HEADROOM * avail)):
        raise ModelLoadError(f"{what} needs {gb(need)} of memory ({detail}) and this machine has {gb(avail)} "
                             f"available (some kept for the caches and runs): not computed.{' ' + advice if advice else ''}")
    return need


def process_rss() -> int:
    """This process's resident memory in bytes (VmRSS: anonymous and file-backed pages it has mapped)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def gb(n: int) -> str:
    """Bytes for a person: 43.1 kB, 512.0 MB, 4.71 GB, 32.1 GB."""
    for unit, scale in (("kB", 1e3), ("MB", 1e6)):
        if n < scale * 1e3:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e9:.2f} GB" if n < 10e9 else f"{n / 1e9:.1f} GB"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import os
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cgroup_room() -> int | None:
    """The process's cgroup limit less its usage (cgroup v2's memory.max / memory.current, or v1's
    memory.limit_in_bytes / memory.usage_in_bytes), None where there is no limit."""
    try:
        lines = Path("/proc/self/cgroup").read_text().split()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            root, limit_file, used_file = Path("/sys/fs/cgroup"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            root, limit_file, used_file = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        for base in (root / rel.lstrip("/"), root):     # a container often sees its own group as the root
            try:
                limit, used = (base / limit_file).read_text().strip(), int((base / used_file).read_text())
            except (OSError, ValueError):
                continue
            if limit != "max" and int(limit) < 1 << 60:        # v1 writes "no limit" as a huge number
                return max(0, int(limit) - used)
            break
    return None
