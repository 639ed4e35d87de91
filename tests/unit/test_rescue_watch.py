"""engine.tools.rescue_runs.Watch: the first stage holding a NaN or an Inf, whatever the dtype, and never a stage whose
values are all finite however large (a sum in the stage's own dtype would overflow on these: the hand-made
cases below hold the watch to the definition, torch.isfinite over every value)."""
from __future__ import annotations

import pytest
import torch

from engine.tools.rescue_runs import Watch


class Ctx:
    def __init__(self, name: str) -> None:
        self.name = name


def first_flagged(tensors) -> str | None:
    watch = Watch()
    for i, t in enumerate(tensors):
        watch(t, Ctx(f"stage{i}"))
    return watch.stage


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_large_finite_values_are_not_flagged_and_the_first_bad_stage_is(dtype):
    big = torch.finfo(dtype).max
    finite = torch.full((64, 576), big, dtype=dtype)                 # sums far past the dtype's range
    finite[::2] = -big / 3
    assert bool(torch.isfinite(finite).all()) and first_flagged([finite, finite.clone()]) is None
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = finite.clone()
        x[7, 300] = bad
        assert first_flagged([finite, x, x.clone() * 0]) == "stage1"
    both = finite.clone()
    both[0, 0], both[0, 1] = float("inf"), -float("inf")             # +inf and -inf together
    assert first_flagged([both]) == "stage0"


def test_integer_stages_are_not_read():
    assert first_flagged([torch.tensor([1, 2, 3]), torch.tensor([float("nan")])]) == "stage1"
