"""Generation: stopping, streaming, seeds, sampler stages seen by hooks."""
from __future__ import annotations

import pytest
import torch

from engine import GenerationRun, Probe, SamplingParams


def test_seeded_sampling_is_reproducible(tiny_model):
    a = tiny_model.generate("hello there", max_new_tokens=12, seed=5, ignore_eos=True,
                            params=SamplingParams(temperature=1.0, top_p=0.9))
    b = tiny_model.generate("hello there", max_new_tokens=12, seed=5, ignore_eos=True,
                            params=SamplingParams(temperature=1.0, top_p=0.9))
    c = tiny_model.generate("hello there", max_new_tokens=12, seed=6, ignore_eos=True,
                            params=SamplingParams(temperature=1.0, top_p=0.9))
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


@pytest.mark.model
def test_streamed_pieces_join_to_the_text(bundled_model):
    pieces = []
    r = bundled_model.generate("Say hello in Japanese and add an emoji.", chat=True, max_new_tokens=40,
                               on_token=lambda s: pieces.append(s.text))
    assert "".join(pieces) == r.text or r.text.startswith("".join(pieces))
    assert "\ufffd" not in "".join(pieces)
    assert r.text == bundled_model.tokenizer.decode(r.token_ids, skip_special=True)


@pytest.mark.model
def test_stop_reasons(bundled_model):
    r = bundled_model.generate("What is the capital of France?", chat=True, max_new_tokens=64)
    assert r.stop_reason == "eos" and r.token_ids[-1] in bundled_model.tokenizer.eos_ids
    r = bundled_model.generate("What is the capital of France?", chat=True, max_new_tokens=3)
    assert r.stop_reason == "max_new_tokens" and len(r.token_ids) == 3
    r = bundled_model.generate("What is the capital of France?", chat=True, max_new_tokens=64, stop=["France"])
    assert r.stop_reason == "stop_string" and "France" not in r.text and r.text.startswith("The capital of")


def test_steps_record_choice_probability_entropy(tiny_model):
    probe = Probe().capture("logits")
    r = tiny_model.generate("one two", max_new_tokens=4, seed=2, ignore_eos=True, probe=probe,
                            params=SamplingParams(temperature=0.7, top_k=5))
    for step, cap in zip(r.steps, probe.captured("logits")):
        raw = torch.softmax(cap.value[0].float(), -1)
        assert abs(step.model_prob - float(raw[step.token_id])) < 1e-6
        assert abs(step.entropy - float(-(raw * raw.clamp_min(1e-30).log()).sum())) < 1e-3
        assert step.kept <= 5 and step.top[0].prob == max(c.prob for c in step.top)
        assert step.token_id in torch.topk(cap.value[0], 5).indices.tolist()


def test_sampler_stages_visible_and_replaceable(tiny_model):
    probe = Probe().capture("sampler.*")
    # force the draw: a hook on the final distribution puts all mass on token 42
    probe.replace("sampler.probs", lambda p, ctx: torch.nn.functional.one_hot(torch.tensor(42), p.shape[0]).float())
    r = tiny_model.generate("abc", max_new_tokens=3, seed=0, ignore_eos=True, probe=probe,
                            params=SamplingParams(temperature=1.0))
    assert r.token_ids == [42, 42, 42]
    assert [c.name for c in probe.captures[:6]] == ["sampler.penalties", "sampler.temperature", "sampler.top_k",
                                                    "sampler.top_p", "sampler.min_p", "sampler.probs"]


def test_step_by_step_equals_run(tiny_model):
    run = GenerationRun(tiny_model, "step by step", max_new_tokens=5, ignore_eos=True)
    ids = []
    while (s := run.step()) is not None:
        ids.append(s.token_id)
    assert run.done and ids == tiny_model.generate("step by step", max_new_tokens=5, ignore_eos=True).token_ids
    assert run.step() is None


def test_kv_cache_bytes(tiny_model):
    r = tiny_model.generate("abc", max_new_tokens=4, ignore_eos=True)
    c = tiny_model.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    n = len(r.prompt_ids) + 4
    assert r.cache == {"bytes_allocated": per_token * n, "bytes_used": per_token * (n - 1),
                       "bytes_per_token": per_token}
    cache = tiny_model.new_cache(10)
    tiny_model.forward(torch.tensor([5, 6, 7]), cache)
    assert cache.get_pos() == 3 and cache.bytes_used == 3 * per_token
    assert float(cache.k[:, :, 3:].abs().sum()) == 0 and float(cache.k[:, :, :3].abs().sum()) > 0
