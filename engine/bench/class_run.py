"""python -m engine bench --class: a whole class pressing Run at once, through the app's own run path.

N students (N = 1, 8, 30 by default) start a 32-token answer each at the same moment, each in its own thread as
the app's LiveRun does, through what the app's run path (inspector.session.run.inspect_run) computes: the request
checked (GenerationRun: settings and prompt), the generation with full inspection (engine.inspection_probe(timing=
True)) whose decode steps meet at the process's step barrier and batch (engine.batch.shared_barrier, as the app's
runs do), the run record (engine.make_trace) and the heap trimmed (engine.heap.trim). Not included: the app's
admission queue, which the engine may not import (tests/unit/test_layout.py); with the app's default
MAX_CONCURRENT_RUNS (32) it admits a class of up to 32 at once, so it adds no wait at these sizes. Every student
asks a different question (prompts of different lengths) and has a seed of their own. A round runs every size once
(the order rotates from round to round); its ratio for size N is the last student's finish over the lone
student's time in the same round, and the reported figure is the median of the rounds' ratios:

    class_last_over_alone_8, class_last_over_alone_30   (targets <= 2.5 and <= 6 on a 2-core CPU)
    class_tokens_per_s_30                              (30 x 32 tokens over the last finish, median)
    lone_app_over_cli_decode   the app's decode per token for one user (full inspection, in a thread of its own as
                               the app's runs are) over engine generate's (no probe, this thread), both alone in
                               this process: the thread policy is one for both (engine.threads)
    cli_beside_busy_over_alone engine generate's decode seconds per token beside one competing torch process
                               over alone (target <= 2.5); the competitor runs with libgomp's default
                               (its environment cleaned of the policy's OMP_WAIT_POLICY / GOMP_SPINCOUNT)
    policy_worker_over_alone, throttled_worker_over_alone   a worker thread's small op beside other threads' OpenMP
                               teams over the lone thread's, under the policy and under PASSIVE (engine.bench.
                               thread_policy: about 1 and 7 on a quiet machine)"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time

from engine.batch import shared_barrier
from engine.bench.thread_policy import thread_policy_bench
from engine.generate import GenerationRun, generate
from engine.heap import trim
from engine.inspection.probe import inspection_probe
from engine.inspection.trace import make_trace
from engine.settings import RunSettings
from engine.threads import POLICY

QUESTIONS = ("What is the capital of France?", "Why is the sky blue?", "Name three animals that live in the sea.",
             "Write a short poem about autumn leaves falling in the park.", "What is 12 times 7?",
             "Explain photosynthesis to a ten-year-old in two sentences.")
BUSY = "import torch\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a\n"


def _student(model, i: int, new_tokens: int) -> None:
    """One student's run as the app computes it (the module docstring)."""
    settings = RunSettings(prompt=f"Student {i}: {QUESTIONS[i % len(QUESTIONS)]}", max_new_tokens=new_tokens, seed=i,
                           ignore_eos=True)
    t0 = time.perf_counter()
    probe = inspection_probe(timing=settings.timing)
    run = GenerationRun(model, settings.prompt, probe=probe, **settings.generation_kwargs())
    result = shared_barrier().drive(run)
    make_trace(settings, result, probe, model.name, time.perf_counter() - t0)
    trim()


def _class(model, n: int, new_tokens: int) -> float:
    """Seconds until the last of n students started together has its run record."""
    gate, ends, errors = threading.Barrier(n + 1), [0.0] * n, []

    def student(i: int) -> None:
        gate.wait()
        try:
            _student(model, i, new_tokens)
        except Exception as e:          # reported below: a bench whose runs failed measures nothing
            errors.append(e)
        ends[i] = time.perf_counter()
    threads = [threading.Thread(target=student, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} students' runs failed: {errors[0]!r}")
    return max(ends) - t0


def _decode_s(model, settings: RunSettings, probe=None) -> float:
    return generate(model, settings.prompt, probe=probe, **settings.generation_kwargs()).timings["per_token_decode"]


def _plain_env() -> dict[str, str]:
    """The competitor's environment: this one without the thread policy's variables (engine.threads), so that it is
    a plain busy torch process with libgomp's default spinning, as any other program on the machine would be."""
    return {k: v for k, v in os.environ.items() if k not in POLICY}


def _in_thread(fn, *args) -> float:
    """fn(*args) in a thread of its own, as the app computes a run (engine.threads: OpenMP teams per thread)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    t.join()
    if not out:
        raise RuntimeError("the app's run in its thread failed")
    return out[0]


def _lone(model, new_tokens: int, rounds: int) -> tuple[float, float]:
    """(app's decode per token, its run in a thread of its own as the app's, over plain in this thread; plain beside a
    busy process over plain alone): medians of rounds."""
    s = RunSettings(prompt=QUESTIONS[1], max_new_tokens=new_tokens, ignore_eos=True)
    app, busy = [], []
    for _ in range(rounds):
        plain = _decode_s(model, s)
        app.append(_in_thread(_decode_s, model, s, inspection_probe()) / plain)
        other = subprocess.Popen([sys.executable, "-c", BUSY], env=_plain_env())
        try:
            time.sleep(1.0)              # the competitor's threads are up
            busy.append(_decode_s(model, s) / plain)
        finally:
            other.kill()
            other.wait()
    return statistics.median(app), statistics.median(busy)


def class_bench(model, sizes: tuple[int, ...] = (1, 8, 30), new_tokens: int = 32, rounds: int = 3,
                say=print) -> dict:
    """The figures of the module docstring, plus class_<n>_s (each size's best last finish) and class_rounds."""
    _class(model, 2, 4)                                            # warm-up: the batched path and the queue
    rows = []
    for r in range(rounds):
        order = sizes[r % len(sizes):] + sizes[:r % len(sizes)]
        got = {n: _class(model, n, new_tokens) for n in order}
        rows.append(got)
        say(f"round {r + 1}: " + ", ".join(f"{n} students: last at {got[n]:.1f} s" for n in sizes))
    alone = sizes[0]
    out: dict = {"class_rounds": rows}
    for n in sizes[1:]:
        out[f"class_last_over_alone_{n}"] = statistics.median(row[n] / row[alone] for row in rows)
        out[f"class_{n}_s"] = min(row[n] for row in rows)
        out[f"class_tokens_per_s_{n}"] = statistics.median(n * new_tokens / row[n] for row in rows)
    out[f"class_{alone}_s"] = min(row[alone] for row in rows)
    out["lone_app_over_cli_decode"], out["cli_beside_busy_over_alone"] = _lone(model, new_tokens, rounds)
    out.update(thread_policy_bench())
    for n in sizes[1:]:
        say(f"{n} students at once: the last finishes at {out[f'class_last_over_alone_{n}']:.2f}x one alone "
            f"({out[f'class_tokens_per_s_{n}']:.1f} tokens/s over the class)")
    say(f"one user: the app's decode {out['lone_app_over_cli_decode']:.2f}x engine generate's; engine generate beside "
        f"a busy process {out['cli_beside_busy_over_alone']:.2f}x alone (medians of {rounds} rounds)")
    say(f"a worker thread's small op beside other teams: {out['policy_worker_over_alone']:.2f}x the lone thread's "
        f"under the policy, {out['throttled_worker_over_alone']:.2f}x under PASSIVE")
    return out
