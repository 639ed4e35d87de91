"""Batched decode across runs: the runs in flight that each feed one decode token step together, their rows stacked
into one forward (the layers' matmuls read every weight once for all of them), each row's attention against its
own run's KV cache at its own position, each run's probe told only its own row, then each run samples, stops and
calls back on its own (engine.generate.GenerationRun.step with the step's logits).

    from engine.batch import step_together
    steps = step_together(runs)          # one Step (or None) per run, in order

The entry point is step_together (forward_together is its forward half, for a caller that finishes each run's step
afterwards); StepBarrier (engine.batch.barrier) drives runs in their own threads to meet at each step, as the app's runs
do, its leader finishing every run's step; engine.batch.rows holds what the model's forward talks to for a batch (the
rows' cache and the fan-out probe). The batched forward is the model's one forward, Model.forward_batch, over
engine.forward_batch.Batch.rows: one native call (engine/native/decode_rows.c) where a lone token would take the
native step, else the PyTorch path (CUDA's too). Prefills are packed the same way (engine.batch.prefill:
prefill_together, PrefillGate, which the barrier's runs meet at; engine.batch.segments: each run's rows of the packed
forward, Model.forward_batch over Batch.packed)."""
from engine.batch.barrier import StepBarrier, shared_barrier
from engine.batch.step import alone_reason, forward_together, step_together

__all__ = ["StepBarrier", "alone_reason", "forward_together", "shared_barrier", "step_together"]
