"""A model's load tells its progress through the long part too (issue 21 item 6: the first visitor's bar sat at
"loading weights (95%)" while every tensor was read and checked): one report per tensor, in order, with
fractions that never go back."""
from __future__ import annotations

import pytest

from engine import load_model
from engine.weights import expected_tensors

pytestmark = pytest.mark.unit


def test_every_tensor_is_reported_in_order(tiny_model_dir):
    seen: list[tuple[float, str]] = []
    model = load_model(tiny_model_dir, device="cpu", dtype="float32", progress=lambda f, m: seen.append((f, m)))
    n = len(expected_tensors(model.config))
    per_tensor = [m for _, m in seen if m.startswith("loading and checking weights: tensor")]
    assert per_tensor == [m for m in per_tensor if f" of {n} (" in m] and len(per_tensor) == n
    assert [int(m.split("tensor ")[1].split(" of")[0]) for m in per_tensor] == list(range(1, n + 1))
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
