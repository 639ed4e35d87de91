"""step_together: the next step of several runs, the decode steps of runs on one model in one forward.

Arithmetic (batch invariance, on the CPU): row b's logits, statistics and captures are those of its run alone, bit
for bit. Runs whose lone step would take the native step batch on the native batched step
(engine/native/decode_rows.c: every row summed in the lone step's order, engine/native/row_product.h), the others on
the PyTorch forward (engine/matmul.py's fixed tiles, each row's attention alone, per-row statistics); the two kinds
never share a forward (native_row). A model whose lone step is native but whose batched native step is refused
(native.step's rows_refusal: a block beyond Llama's, GGUF matrices kept in their blocks) steps each run alone. tests/unit/test_batch_invariance.py holds a run to itself alone inside random
batches. What does not hold: a native batched step in which some row meets a NaN or Inf is redone on the PyTorch
forward for every row (the lone step redoes only its own); on an accelerator (CUDA, MPS) rows are computed
together, within rounding of alone. exact=True steps every run alone (no batching).

A run's own failure ends that run only: what its preparation raises leaves it out of the forward, and what its
probe or its row raises inside the forward (engine.batch.rows: the fence) is its outcome while the other rows'
results stand (its cache is not advanced); its sampler and on_token run in its own step. Only a failure of the
forward itself (memory) is every run's."""
from __future__ import annotations

import time
from typing import Union

import torch

from engine.batch.rows import FanProbe, Rows
from engine.forward_batch import Batch
from engine.generate import GenerationRun
from engine.matmul import DECODE_TILE, tiled
from engine.results import Step

Outcome = Union[Step, None, BaseException]

_NO_STAGES: list[str] = []     # Probe.served_by([]): no replace hook, weight override or run-only epsilon


def alone_reason(run: GenerationRun) -> str | None:
    """Why this run's next step cannot join a batch (None: it can)."""
    if run.decode_input() is None:
        return "its next step is no one-token decode step on its cache (the prefill, the end, or no cache)"
    step = run.model.accelerator.decode
    if native_row(run) and step.rows_refusal:
        return (f"its lone step is native and the batched native step cannot run this model ({step.rows_refusal}): "
                "on the PyTorch forward its row would not be its run alone, bit for bit")
    return shared_forward_reason(run)


def shared_forward_reason(run: GenerationRun) -> str | None:
    """Why this run can share no forward with other runs' whatever its step (None: it can): a batched decode step's
    or a packed prefill's (engine.batch.prefill)."""
    if run.probe is not None and not run.probe.served_by(_NO_STAGES):
        return "its probe changes the forward (a replace hook, a weight override or a run-only epsilon)"
    if run.model.config.rope_scaling.rope_type == "longrope":
        return "longrope picks its rotary table by the call's length"
    return None


def step_together(runs: list[GenerationRun], *, exact: bool = False) -> list[Outcome]:
    """Each run's next step, in order: its Step, None (it had ended or ends here without a token), or the exception
    its step raised (the others' steps go on). Runs whose next step is a decode step on the same model share one
    forward (two or more of them); the rest step alone. exact: every run alone."""
    groups: dict[tuple[int, bool], list[int]] = {}
    for n, run in enumerate(runs):
        if not exact and alone_reason(run) is None:
            groups.setdefault((id(run.model), native_row(run)), []).append(n)
    out: list[Outcome] = [None] * len(runs)
    batched = {n for g in groups.values() if len(g) > 1 for n in g}
    for members in groups.values():
        if len(members) > 1:
            _batch([runs[n] for n in members], [out, members])
    for n, run in enumerate(runs):
        if n not in batched:
            out[n] = guarded(run.step)
    return out


def native_row(run: GenerationRun) -> bool:
    """Whether the run's decode step alone would take the model's native step (its probe served by it): such runs
    batch among themselves, on the native batched step, and the others among themselves on the PyTorch forward,
    so that a run's row is computed by the path that computes it alone whatever runs share its step (a run whose
    probe captures a stage would otherwise move every row of its batch to the PyTorch forward)."""
    step = run.model.accelerator.decode
    return step is not None and (run.probe is None or run.probe.served_by(step.names) is not False)


def _batch(runs: list[GenerationRun], into: list) -> None:
    """One forward over the runs' rows, then each run samples from its own logits row."""
    out, members = into
    try:
        rows, seconds = forward_together(runs)
    except Exception as e:      # the batch's forward failed (memory): every run of it hears why; no cache advanced
        for n in members:
            out[n] = e
        return
    for n, run, row in zip(members, runs, rows):
        out[n] = row if isinstance(row, BaseException) else guarded(run.step, row, seconds=seconds)


def forward_together(runs: list[GenerationRun]) -> tuple[list[torch.Tensor | BaseException], float]:
    """The forward half of a batched step: runs (each alone_reason None, one model) -> (rows, seconds): rows[b] run
    b's logits (V,), its cache advanced and its probe told its row, or the exception its own code raised (its
    preparation, its probe in the forward: its cache not advanced). Run b then finishes its step with
    runs[b].step(rows[b], seconds=seconds), in any thread. A failed forward (memory) raises, no cache advanced."""
    model = runs[0].model
    if any(r.model is not model for r in runs):
        raise ValueError("runs of one batched step must share one model")
    rows: list[torch.Tensor | BaseException | None] = [guarded(_prepare, run) for run in runs]
    go = [b for b, row in enumerate(rows) if row is None]         # the runs whose preparation went through
    if go:
        batch = [runs[b] for b in go]
        positions = [run.cache.get_pos() for run in batch]
        ids = torch.tensor([run.decode_input() for run in batch])
        probe = FanProbe([r.probe for r in batch], positions)
        t0 = time.perf_counter()
        rows_cache = Rows(model, [r.cache for r in batch], positions)
        with tiled(DECODE_TILE):     # each row's products as its lone step's (engine.matmul: tiles of 8 rows)
            logits = model.forward_batch(Batch.rows(ids, positions, rows_cache, probe, model.device))
        seconds = time.perf_counter() - t0
        for g, b in enumerate(go):
            rows[b] = probe.failed[g] if probe.failed[g] is not None else logits[g]
            if probe.failed[g] is None:
                runs[b].cache.advance(1)
    else:
        seconds = 0.0
    return rows, seconds


def _prepare(run: GenerationRun) -> None:
    """A run's own part of a batched step before its forward: room in its cache, its probe told the step."""
    run.cache.check_room(1)
    if run.probe is not None:
        run.probe.step = len(run.steps)


def guarded(fn, *args, **kwargs) -> Outcome:
    """fn(*args, **kwargs), or the exception it raised (handed to the run it belongs to)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:      # the caller hands it to the run it belongs to
        return e
