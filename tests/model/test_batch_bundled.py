"""Batched decode (engine.batch) on the bundled model: three runs of different prompt lengths, seeds and samplers
stepped together write the tokens each writes alone (on the same PyTorch path and on the native one-token step),
and each run's statistics of every stage stay within the rounding a matmul over three rows brings."""
from __future__ import annotations

import pytest

from engine import GenerationRun, SamplingParams
from engine.accelerator import PLAIN
from engine.inspection.probe import inspection_probe
from tests.helpers import assert_same_stats, step_together_to_the_end

pytestmark = pytest.mark.model

SPECS = [("The capital of France is", 0, SamplingParams(temperature=0)),
         ("Once upon a time, in a land far away, there lived", 3, SamplingParams(temperature=0.8, top_k=20)),
         ("1, 2, 3,", 7, SamplingParams(temperature=1.0, top_p=0.9))]


def _runs(model):
    return [GenerationRun(model, p, params=sp, seed=s, max_new_tokens=8, ignore_eos=True,
                          probe=inspection_probe(timing=False)) for p, s, sp in SPECS]


@pytest.mark.parametrize("native", [False, True])
def test_bundled_runs_together_match_alone(bundled_model, native):
    model = bundled_model if native else bundled_model.with_accelerator(PLAIN)
    alone = _runs(model)
    for r in alone:
        r.run()
    together = _runs(model)
    step_together_to_the_end(together)
    for a, b in zip(alone, together):
        assert b.token_ids == a.token_ids
        # measured: at most 1.1e-3 absolute (mlp_out) on the PyTorch path, 1.6e-3 natively (decode_rows.c, nine
        # runs of 16 tokens), relative to values up to ~1e2 in the residual stream
        assert_same_stats(a, b, rtol=1e-4, atol=2e-3)
