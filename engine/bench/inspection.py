"""python -m engine bench --app: what the app's full inspection (statistics of every stage incl. attention
maps, the logits kept) costs against a plain forward: prefill at several lengths with the memory a run keeps
afterwards and the peak memory it needs on the way, and the time a decoded token takes in the app's
inspected run against a plain run.

Peak extra memory is measured, not estimated: the process's peak resident set during the forward minus its
resident set just before (Linux: the kernel's high-water mark, reset through /proc/self/clear_refs, with a
sampling thread as a fallback; CUDA: the allocator's peak). Free heap memory is handed back to the system
first, so a forward cannot hide its peak in memory an earlier one left behind.
"""
from __future__ import annotations

import statistics
import threading
import time

import torch

from engine.bench.app_run import app_run_ratio
from engine.generate import GenerationRun
from engine.heap import trim
from engine.inspection.attention_blocks import release_workspace, workspace_elements
from engine.inspection.probe import Probe, inspection_probe
from engine.model import Model


def retained_bytes(probe: Probe) -> int:
    """Bytes a run keeps after it ends: its recording's statistics blocks and captured tensors."""
    rec = probe.recording
    total = sum(b.values.numel() * b.values.element_size() for b in rec.stats)
    return total + sum(c.value.numel() * c.value.element_size() for c in rec.captures
                       if isinstance(c.value, torch.Tensor))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak memory above the level at entry during a with-block, in bytes (.extra)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.extra = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        trim()
        self.base = self.peak = _rss()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")                 # reset the high-water mark to the current resident set
            self.hwm = True
        except OSError:
            self.hwm = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.extra = torch.cuda.max_memory_allocated() - self.base
            return
        self._stop.set()
        self._thread.join()
        peak = max(self.peak, _rss(), (_hwm() or 0) if self.hwm else 0)
        self.extra = max(0, peak - self.base)


def prefill(model: Model, ids: list[int], probe: Probe | None) -> tuple[float, int]:
    """Seconds of one prefill (last position's logits, as generation does) and its peak extra memory."""
    cache = model.new_cache(len(ids) + 1)
    with PeakMemory(model.device) as mem:
        t0 = time.perf_counter()
        model.forward(torch.tensor(ids), cache, probe, last_only=True)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    return seconds, mem.extra


def inspection_rows(model: Model, lengths: tuple[int, ...], say) -> dict:
    g = torch.Generator().manual_seed(1)
    out = {}
    say("\napp: full inspection (statistics of every stage incl. attention maps, logits kept) vs plain prefill")
    say(f"{'prompt tokens':>13s} {'plain s':>9s} {'inspected s':>12s} {'ratio':>6s} {'kept MB':>8s} "
        f"{'peak extra MB: plain':>21s} {'inspected':>10s} {'attn workspace MB':>18s}")
    for n in lengths:
        n = min(n, model.context_length - 1)
        ids = torch.randint(100, model.config.vocab_size - 100, (n,), generator=g).tolist()
        repeats = 2 if n <= 2048 else 1
        prefill(model, ids[:16], None)
        plain, insp, kept, mem_p, mem_i = float("inf"), float("inf"), 0, 0, 0
        for _ in range(repeats):           # interleaved: plain, inspected, plain, inspected
            release_workspace()
            s, mem_p = prefill(model, ids, None)
            plain = min(plain, s)
            release_workspace()
            probe = inspection_probe(timing=False)
            s, mem_i = prefill(model, ids, probe)
            insp, kept = min(insp, s), retained_bytes(probe)
            del probe
        ws = workspace_elements() * 4
        say(f"{n:13d} {plain:9.3f} {insp:12.3f} {insp / plain:6.2f} {kept / 1e6:8.1f} {mem_p / 1e6:21.0f} "
            f"{mem_i / 1e6:10.0f} {ws / 1e6:18.1f}")
        key = {512: "512", 2048: "2048"}.get(n, str(n))
        out[f"inspection_ratio_{key}"] = insp / plain
        out[f"inspection_{key}_retained_mb"] = kept / 1e6
        out[f"inspection_{key}_peak_extra_mb"] = mem_i / 1e6
        out[f"plain_{key}_peak_extra_mb"] = mem_p / 1e6
    release_workspace()
    return out


def app_decode(model: Model, say, prompt_tokens: int = 128, new_tokens: int = 32, repeats: int = 3) -> dict:
    """Per-token decode time in the app's run (inspection_probe with per-layer timing, as the app records
    it) against a plain run of the same prompt: app_decode_ratio = inspected / plain (issue 20 step 6: <= 1.2;
    both take the native decode step where it is built, the inspected one with its statistics and marks).
    The two runs go side by side, one step each in turn, so a
    burst of load from elsewhere on a shared machine lands on both alike; a round's figure for each is the
    median of its steps (a burst in a few steps does not move it), and the best round of each is kept."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(100, model.config.vocab_size - 100, (prompt_tokens,), generator=g).tolist()
    best = {"plain": float("inf"), "inspected": float("inf")}
    for _ in range(repeats):
        runs = {k: GenerationRun(model, ids, max_new_tokens=new_tokens, ignore_eos=True,
                                 probe=inspection_probe(timing=True) if k == "inspected" else None) for k in best}
        seconds: dict[str, list[float]] = {k: [] for k in best}
        for run in runs.values():
            run.step()                      # the prefill (not a decoded token)
        for _ in range(new_tokens - 1):
            for k, run in runs.items():
                t0 = time.perf_counter()
                run.step()
                seconds[k].append(time.perf_counter() - t0)
        for k in best:
            best[k] = min(best[k], statistics.median(seconds[k]))
    say(f"\napp: one decoded token ({prompt_tokens}-token prompt, {new_tokens} new): plain "
        f"{best['plain'] * 1e3:.1f} ms, app's inspected run {best['inspected'] * 1e3:.1f} ms "
        f"(inspected/plain {best['inspected'] / best['plain']:.2f}; steps interleaved, median per run, best of "
        f"{repeats})")
    return {"app_decode_ms_plain": best["plain"] * 1e3, "app_decode_ms_inspected": best["inspected"] * 1e3,
            "app_decode_ratio": best["inspected"] / best["plain"]}


def run_inspection_bench(model: Model, lengths: tuple[int, ...] = (512, 2048, 8000), quiet: bool = False, *,
                         app_run_tokens: int = 2048, rounds: int = 3) -> dict:
    say = (lambda *x, **k: None) if quiet else print
    out = inspection_rows(model, lengths, say)
    out.update(app_decode(model, say))
    out.update(app_run_ratio(model, app_run_tokens, rounds=rounds, say=say))
    return out
