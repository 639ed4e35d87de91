"""Explain a token on the bundled model against transformers: the logit attribution's parts add up to the
logit difference transformers computes, and zeroing a head (in the head scan and in a plain rerun) moves
the target's logit exactly as zeroing that head's slice of o_proj's input does in transformers."""
from __future__ import annotations

import random

import pytest
import torch

from engine import GenerationRun
from engine.tools.explain import explain_step
from engine.tools.patching import ablated_logit, head_scan

pytestmark = pytest.mark.reference
PROMPTS = [("The capital of France is", False), ("def fibonacci(n):", False),
           ("Once upon a time, there was a", False), ("What is the capital of France?", True),
           ("Write a haiku about the sea.", True)]
REL = 1e-4


def hf_last_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].double()


@pytest.fixture(scope="module")
def runs(bundled_model):
    return [GenerationRun(bundled_model, p, chat=chat, max_new_tokens=5).run() for p, chat in PROMPTS]


def test_contributions_sum_to_transformers_logit_difference_in_30_cases(bundled_model, hf_reference, runs):
    """30 (prompt, step, A, B) cases: A the chosen token, B the runner-up or the tenth-ranked token. The
    bound is 1e-4 relative; a difference under one logit is held to 1e-4 absolute instead, since both
    forwards round in fp32 (about 1e-5 of a logit of ~20)."""
    checked, strict = 0, 0
    for r in runs:
        for step in (0, 2, 4):
            ids = r.prompt_ids + r.token_ids[:step]
            ref = hf_last_logits(hf_reference, ids)
            a = r.token_ids[step]
            tenth = int(torch.topk(ref, 10).indices[-1])
            for b in (None, tenth if tenth != a else int(torch.topk(ref, 11).indices[-1])):
                e = explain_step(bundled_model, r.prompt_ids, r.token_ids, step, versus=b)
                diff = float(ref[e.target] - ref[e.versus])
                assert abs(e.total - diff) <= REL * max(1.0, abs(diff)), (r.prompt_ids, step, e.target, e.versus,
                                                                          e.total, diff)
                assert abs(e.total - e.logit_diff) <= REL * max(1.0, abs(e.logit_diff))
                checked += 1
                strict += abs(diff) >= 1.0
    assert checked == 30 and strict >= 20      # at least 20 cases held to the plain relative bound


def test_zeroing_a_head_matches_transformers_with_that_heads_o_proj_input_zeroed(bundled_model, hf_reference):
    model = bundled_model
    ids = model.tokenizer.encode("The Eiffel Tower is located in the beautiful old city of")
    target = model.tokenizer.encode(" Paris")[0]
    hd = model.config.head_dim
    scan = head_scan(model, ids, target)
    base = float(hf_last_logits(hf_reference, ids)[target])
    rng = random.Random(0)
    picks = [(0, 0), (29, 8)] + [(rng.randrange(30), rng.randrange(9)) for _ in range(8)]
    for layer, head in picks:
        def zero(module, args, h=head):
            x = args[0].clone()
            x[..., h * hd:(h + 1) * hd] = 0
            return (x,)
        handle = hf_reference.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(zero)
        try:
            hf = float(hf_last_logits(hf_reference, ids)[target]) - base
        finally:
            handle.remove()
        rerun = ablated_logit(model, ids, target, layer, head) - float(model.logits(ids)[-1, target])
        assert scan[layer][head] == pytest.approx(rerun, abs=1e-4), (layer, head)
        assert scan[layer][head] == pytest.approx(hf, abs=1e-4), (layer, head)
    assert max(abs(v) for row in scan for v in row) > 0.1      # some head matters, so the match means something
