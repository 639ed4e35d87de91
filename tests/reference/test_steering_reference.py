"""Steering on the bundled model against transformers: the vector is the mean difference of transformers' own hidden
states after the layer (output_hidden_states[layer + 1], each prompt's mean over its positions), and the steered
greedy run is the run transformers makes with the same vector added to that decoder layer's output by a forward hook:
the same tokens, and each step's KL(steered || plain) and steered-token probability as transformers' own steered
logits and its plain logits on the steered prefix give them (1e-3 relative, 1e-4 absolute)."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.settings import RunSettings
from engine.tools.steering import steer, steering_vector

pytestmark = pytest.mark.reference
POSITIVE = ["I love this. It is wonderful and happy.", "What a great, joyful day!"]
NEGATIVE = ["I hate this. It is awful and sad.", "What a terrible, miserable day!"]
LAYER, COEFFICIENT, NEW = 12, 4.0, 12
PROMPT = "I went to the park today and"


def _hf_hidden_mean(hf, model, prompts) -> torch.Tensor:
    means = []
    for p in prompts:
        with torch.no_grad():
            out = hf(torch.tensor([model.tokenizer.encode(p)]), output_hidden_states=True)
        means.append(out.hidden_states[LAYER + 1][0].double().mean(0))
    return torch.stack(means).mean(0)


def test_the_vector_and_the_steered_run_equal_transformers_with_a_forward_hook(bundled_model, hf_reference):
    vec = steering_vector(bundled_model, POSITIVE, NEGATIVE, LAYER)
    want = _hf_hidden_mean(hf_reference, bundled_model, POSITIVE) - _hf_hidden_mean(hf_reference, bundled_model,
                                                                                    NEGATIVE)
    assert float((vec.vector.double() - want).abs().max()) <= 1e-4 * float(want.abs().max())

    settings = RunSettings(prompt=PROMPT, chat=False, max_new_tokens=NEW, params=SamplingParams(temperature=0),
                           ignore_eos=True)
    run = steer(bundled_model, settings, vec, COEFFICIENT)
    add = (COEFFICIENT * vec.vector).to(torch.float32)

    def hook(module, args, out):
        return (out[0] + add,) + tuple(out[1:]) if isinstance(out, tuple) else out + add
    handle = hf_reference.model.layers[LAYER].register_forward_hook(hook)
    ids = bundled_model.tokenizer.encode(PROMPT)
    steered_logits = []
    try:
        for _ in range(NEW):                      # greedy, one full forward a token
            with torch.no_grad():
                logits = hf_reference(torch.tensor([ids])).logits[0, -1]
            steered_logits.append(logits)
            ids = ids + [int(logits.argmax())]
    finally:
        handle.remove()
    hf_tokens = ids[-NEW:]
    assert run.steered_ids == hf_tokens
    assert run.steered_ids != run.plain_ids                # the vector does change this run
    prefix = bundled_model.tokenizer.encode(PROMPT) + hf_tokens[:-1]
    with torch.no_grad():
        plain = hf_reference(torch.tensor([prefix])).logits[0, len(prefix) - NEW:]
    for k, step in enumerate(run.steps):
        lp, lq = torch.log_softmax(steered_logits[k].double(), -1), torch.log_softmax(plain[k].double(), -1)
        kl = float((lp.exp() * (lp - lq)).sum())
        assert abs(step["kl_steered_plain"] - kl) <= 1e-3 * max(1.0, kl), (k, step["kl_steered_plain"], kl)
        assert abs(step["p_steered"] - float(lp[step["token"]].exp())) <= 1e-4
