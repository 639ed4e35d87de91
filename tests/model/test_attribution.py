"""Input attribution on the bundled model, on synthetic copy prompts whose answer sits in one known token:
"The code is 7391. Repeat: The code is 73" -> "9" rests on the "9" of the first code. Occlusion must find
that source digit, and the deletion curve of the better method must fall faster than random orders'."""
from __future__ import annotations

import random

import pytest

from engine.tools.attribution import METHODS, attribute_inputs, neutral_token, occlusion
from engine.tools.patching import base_run

pytestmark = pytest.mark.model
N_PROMPTS = 30
N_DELETION = 6          # deletion curves cost about orders x T forwards each; a subset shows the point
SOURCE = 6              # 'The', ' code', ' is', ' ', d0, d1, d2: the digit to copy is the prompt's 7th token


def copy_prompts(tok, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(ids, target) pairs: a random 4-digit code, then the request to repeat it, cut after two digits."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        code = "".join(rng.choice("123456789") for _ in range(4))
        ids = tok.encode(f"The code is {code}. Repeat: The code is {code[:2]}")
        target = tok.encode(code[2])
        assert len(target) == 1 and ids[SOURCE] == target[0], (code, ids)
        out.append((ids, target[0]))
    return out


@pytest.fixture(scope="module")
def prompts(bundled_model):
    return copy_prompts(bundled_model.tokenizer, N_PROMPTS)


def test_occlusion_ranks_the_source_digit_first_in_at_least_90_percent_of_copy_prompts(bundled_model, prompts):
    neutral = neutral_token(bundled_model)
    firsts = []
    for ids, target in prompts:
        scores = occlusion(bundled_model, ids, target, neutral, base_run(bundled_model, ids))
        firsts.append(max(range(len(ids)), key=lambda t: scores[t]) == SOURCE)
    assert sum(firsts) >= 0.9 * N_PROMPTS, f"source digit first in {sum(firsts)} of {N_PROMPTS}"


def test_the_better_methods_deletion_curve_falls_faster_than_random_orders(bundled_model, prompts):
    wins, margins = 0, []
    for ids, target in prompts[:N_DELETION]:
        a = attribute_inputs(bundled_model, ids, target, random_orders=2, seed=1)
        best = min(a.areas[m] for m in METHODS)
        assert a.faithful in METHODS and a.areas[a.faithful] == best
        wins += best < a.areas["random"]
        margins.append(a.areas["random"] - best)
        assert a.deletion[a.faithful][0] == pytest.approx(a.logp)
    assert wins >= N_DELETION - 1 and sum(margins) / len(margins) > 0.3, margins
