"""The sampler chain against hand computations."""
from __future__ import annotations

import math

import torch

from engine.sampling import (
    SamplingParams,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    draw,
    entropy,
    sampler_chain,
)

NEG = float("-inf")


def kept(x: torch.Tensor) -> list[int]:
    return torch.isfinite(x).nonzero().flatten().tolist()


def logits_for(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_top_k():
    x = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    assert kept(apply_top_k(x, 2)) == [1, 3]
    assert kept(apply_top_k(x, 0)) == [0, 1, 2, 3, 4]
    assert kept(apply_top_k(x, 9)) == [0, 1, 2, 3, 4]


def test_top_p_smallest_set_reaching_p():
    x = logits_for([0.1, 0.45, 0.05, 0.3, 0.1])      # sorted: .45 (1) .3 (3) .1 (0) .1 (4) .05 (2)
    assert kept(apply_top_p(x, 0.5)) == [1, 3]        # .45 < .5, .75 >= .5
    assert kept(apply_top_p(x, 0.7)) == [1, 3]
    assert kept(apply_top_p(x, 0.8)) == [0, 1, 3] or kept(apply_top_p(x, 0.8)) == [1, 3, 4]
    assert len(kept(apply_top_p(x, 0.8))) == 3
    assert kept(apply_top_p(x, 0.3)) == [1]           # the top token is always kept
    assert kept(apply_top_p(x, 1.0)) == [0, 1, 2, 3, 4]


def test_min_p():
    x = logits_for([0.5, 0.2, 0.05, 0.25])
    assert kept(apply_min_p(x, 0.45)) == [0, 3]       # threshold .225
    assert kept(apply_min_p(x, 0.39)) == [0, 1, 3]    # threshold .195


def test_penalties_by_hand():
    x = torch.tensor([2.0, -1.0, 0.5, 3.0])
    p = SamplingParams(repetition_penalty=2.0)
    assert apply_penalties(x, [0, 1, 1], [], p).tolist() == [1.0, -2.0, 0.5, 3.0]
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    assert apply_penalties(x, [9, 3, 3, 2], [3, 3, 2], p).tolist() == [2.0, -1.0, 0.5 - 0.5 - 1.0, 3.0 - 1.0 - 1.0]
    p = SamplingParams(no_repeat_ngram=2)                 # context ... 3 2 ... 3 -> ban 2 after 3
    out = apply_penalties(x, [3, 2, 0, 3], [], p)
    assert out[2] == NEG and torch.isfinite(out[[0, 1, 3]]).all()


def test_chain_order_and_greedy():
    x = torch.tensor([1.0, 2.0, 0.5, 1.9])
    stages = sampler_chain(x, SamplingParams(temperature=0.5, top_k=3, top_p=0.9), [], [])
    assert list(stages) == ["sampler.penalties", "sampler.temperature", "sampler.top_k", "sampler.top_p",
                            "sampler.min_p", "sampler.probs"]
    assert torch.allclose(stages["sampler.temperature"], x / 0.5)
    assert kept(stages["sampler.top_k"]) == [0, 1, 3]
    probs = stages["sampler.probs"]
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6) and float(probs[2]) == 0
    greedy = sampler_chain(x, SamplingParams(temperature=0), [], [])["sampler.probs"]
    assert greedy.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_seeded_draws_match_probabilities():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    g = torch.Generator().manual_seed(123)
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(4000)]), minlength=4).float() / 4000
    assert (counts - probs).abs().max() < 0.03
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [draw(probs, g1) for _ in range(20)] == [draw(probs, g2) for _ in range(20)]


def test_entropy_by_hand():
    assert math.isclose(entropy(torch.tensor([0.5, 0.5, 0.0])), math.log(2), rel_tol=1e-6)
    assert entropy(torch.tensor([1.0, 0.0])) == 0.0
