"""The batched decode step and the packed prefill (engine.batch) on CUDA (bf16): the same steps as on the CPU with the
device's kernels. Three runs prefilled together (or alone) and stepped together write what each writes alone
(greedy: bf16 matmuls over more rows may round otherwise, so tokens are compared where the alone run's top two
logits differ by more than the measured rounding), and each probe holds its own run's records. Skipped without a
GPU; run by scripts/gpu_check.sh."""
from __future__ import annotations

import pytest

from engine import GenerationRun, SamplingParams, load_model
from engine.batch import step_together
from engine.inspection.probe import inspection_probe

pytestmark = pytest.mark.cuda

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived", "1, 2, 3,"]


@pytest.fixture(scope="module")
def gpu_model():
    return load_model(None, device="cuda")


def _runs(model):
    return [GenerationRun(model, p, params=SamplingParams(temperature=0), max_new_tokens=12, ignore_eos=True,
                          probe=inspection_probe()) for p in PROMPTS]


@pytest.mark.parametrize("packed", [False, True], ids=["prefills alone", "prefills packed"])
def test_batched_step_on_cuda_matches_alone(gpu_model, packed):
    from engine.batch.prefill import prefill_together
    alone = _runs(gpu_model)
    for r in alone:
        r.run()
    together = _runs(gpu_model)
    if packed:
        assert all(s is not None for s in prefill_together(together))
    while not all(r.done for r in together):
        for o in step_together(together):
            assert not isinstance(o, BaseException), o
    for a, b in zip(alone, together):
        assert [(s.step, s.name, s.pos0) for s in a.probe.recording.stat_records()] == \
            [(s.step, s.name, s.pos0) for s in b.probe.recording.stat_records()]
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        margins = [s.top[0].prob - s.top[1].prob for s in a.steps]
        assert n == len(a.token_ids) or margins[n] < 0.02, (n, margins[n])    # differs only at a near tie
        last = a.probe.recording.captured("logits")[-1].value.float()
        got = b.probe.recording.captured("logits")[-1].value.float()
        if n == len(a.token_ids):
            assert float((got - last).norm() / last.norm()) < 0.02
    assert gpu_model.live_hooks == 0
