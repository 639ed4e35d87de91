"""Generation: stopping, streaming, seeds, sampler stages seen by hooks."""
from __future__ import annotations

import importlib

import pytest
import torch

from engine import GenerationRun, Probe, SamplingParams
from engine.generate import generate, nonfinite_stop
from engine.progress import Progress


def test_seeded_sampling_is_reproducible(tiny_model):
    a = generate(tiny_model, "hello there", max_new_tokens=12, seed=5, ignore_eos=True,
                 params=SamplingParams(temperature=1.0, top_p=0.9))
    b = generate(tiny_model, "hello there", max_new_tokens=12, seed=5, ignore_eos=True,
                 params=SamplingParams(temperature=1.0, top_p=0.9))
    c = generate(tiny_model, "hello there", max_new_tokens=12, seed=6, ignore_eos=True,
                 params=SamplingParams(temperature=1.0, top_p=0.9))
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


@pytest.mark.model
def test_streamed_pieces_join_to_the_text(bundled_model):
    pieces = []
    r = generate(bundled_model, "Say hello in Japanese and add an emoji.", chat=True, max_new_tokens=40,
                 on_token=lambda s: pieces.append(s.text))
    assert "".join(pieces) == r.text or r.text.startswith("".join(pieces))
    assert "\ufffd" not in "".join(pieces)
    assert r.text == bundled_model.tokenizer.decode(r.token_ids, skip_special=True)


@pytest.mark.model
def test_stop_reasons(bundled_model):
    r = generate(bundled_model, "What is the capital of France?", chat=True, max_new_tokens=64)
    assert r.stop_reason == "eos" and r.token_ids[-1] in bundled_model.tokenizer.eos_ids
    r = generate(bundled_model, "What is the capital of France?", chat=True, max_new_tokens=3)
    assert r.stop_reason == "max_new_tokens" and len(r.token_ids) == 3
    r = generate(bundled_model, "What is the capital of France?", chat=True, max_new_tokens=64, stop=["France"])
    assert r.stop_reason == "stop_string" and "France" not in r.text and r.text.startswith("The capital of")


def test_steps_record_choice_probability_entropy(tiny_model):
    probe = Probe().capture("logits")
    r = generate(tiny_model, "one two", max_new_tokens=4, seed=2, ignore_eos=True, probe=probe,
                 params=SamplingParams(temperature=0.7, top_k=5))
    for step, cap in zip(r.steps, probe.recording.captured("logits")):
        raw = torch.softmax(cap.value[0].float(), -1)
        assert abs(step.model_prob - float(raw[step.token_id])) < 1e-6
        assert abs(step.entropy - float(-(raw * raw.clamp_min(1e-30).log()).sum())) < 1e-3
        assert step.kept <= 5 and step.top[0].prob == max(c.prob for c in step.top)
        assert step.token_id in torch.topk(cap.value[0], 5).indices.tolist()


def test_sampler_stages_visible_and_replaceable(tiny_model):
    probe = Probe().capture("sampler.*")
    # force the draw: a hook on the final distribution puts all mass on token 42
    probe.replace("sampler.probs", lambda p, ctx: torch.nn.functional.one_hot(torch.tensor(42), p.shape[0]).float())
    r = generate(tiny_model, "abc", max_new_tokens=3, seed=0, ignore_eos=True, probe=probe,
                 params=SamplingParams(temperature=1.0))
    assert r.token_ids == [42, 42, 42]
    assert [c.name for c in probe.recording.captures[:6]] == ["sampler.penalties", "sampler.temperature",
                                                              "sampler.top_k", "sampler.top_p", "sampler.min_p",
                                                              "sampler.probs"]


def test_step_by_step_equals_run(tiny_model):
    run = GenerationRun(tiny_model, "step by step", max_new_tokens=5, ignore_eos=True)
    ids = []
    while (s := run.step()) is not None:
        ids.append(s.token_id)
    assert run.done and ids == generate(tiny_model, "step by step", max_new_tokens=5, ignore_eos=True).token_ids
    assert run.step() is None


def test_kv_cache_bytes(tiny_model):
    r = generate(tiny_model, "abc", max_new_tokens=4, ignore_eos=True)
    c = tiny_model.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    n = len(r.prompt_ids) + 4
    assert r.cache == {"bytes_allocated": per_token * n, "bytes_used": per_token * (n - 1),
                       "bytes_per_token": per_token}
    cache = tiny_model.new_cache(10)
    tiny_model.forward(torch.tensor([5, 6, 7]), cache)
    assert cache.get_pos() == 3 and cache.bytes_used == 3 * per_token
    assert float(cache.k[:, :, 3:].abs().sum()) == 0 and float(cache.k[:, :, :3].abs().sum()) > 0


# ---- non-finite logits, stopping, chunked prefill with progress ---------------------------------------
def plant_in_logits(value: float, at_step: int):
    """A replace hook putting `value` into token 0's logit at one step (token 0 is what argmax of NaN picks)."""
    def fn(x, ctx):
        if ctx.step != at_step:
            return None
        y = x.clone()
        y[..., 0] = value
        return y
    return fn


@pytest.mark.parametrize("value,kind", [(float("nan"), "nan"), (float("inf"), "inf")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nonfinite_logits_stop_the_run_without_a_draw(tiny_model, value, kind, temperature):
    probe = Probe().capture("sampler.probs").record_stats("logits").replace("logits", plant_in_logits(value, 2))
    r = generate(tiny_model, "one two", max_new_tokens=6, seed=3, ignore_eos=True, probe=probe,
                 params=SamplingParams(temperature=temperature))
    n = len(r.prompt_ids)
    assert r.stop_reason == "non-finite logits" and len(r.token_ids) == len(r.steps) == 2
    assert nonfinite_stop(r) == {"step": 2, "position": n + 1, "nan": int(kind == "nan"), "inf": int(kind == "inf")}
    assert [c.step for c in probe.recording.captured("sampler.probs")] == [0, 1]          # the sampler never saw step 2
    clean = generate(tiny_model, "one two", max_new_tokens=2, seed=3, ignore_eos=True,
                     params=SamplingParams(temperature=temperature))
    assert r.token_ids == clean.token_ids and nonfinite_stop(clean) is None


def test_nonfinite_logits_in_the_prefill_generate_nothing(tiny_model):
    """NaN logits at step 0 used to make argmax choose token 0 (<|endoftext|>): an 'eos' with nothing said."""
    probe = Probe().replace("logits", plant_in_logits(float("nan"), 0))
    r = generate(tiny_model, "hello", max_new_tokens=4, probe=probe)
    assert (r.stop_reason, r.token_ids, r.text) == ("non-finite logits", [], "")
    assert nonfinite_stop(r) == {"step": 0, "position": len(r.prompt_ids) - 1, "nan": None, "inf": None}  # no stats


def test_on_token_stop_ends_the_run_keeping_what_was_made(tiny_model):
    from engine.progress import STOP
    seen = []
    r = generate(tiny_model, "a b c", max_new_tokens=10, ignore_eos=True,
                 on_token=lambda s: (seen.append(s.token_id), STOP if s.index == 2 else None)[1])
    full = generate(tiny_model, "a b c", max_new_tokens=10, ignore_eos=True)
    assert r.stop_reason == "stopped" and r.token_ids == seen == full.token_ids[:3]
    assert r.text == tiny_model.tokenizer.decode(r.token_ids, skip_special=True)


def test_chunked_prefill_matches_one_forward_and_reports_progress(tiny_model, monkeypatch):
    progress = importlib.import_module("engine.progress")     # where the prefill's chunk size lives
    prompt = list(range(100, 110))                            # 10 prompt ids
    whole_probe = Probe(timing=True).record_stats("*").capture("logits")
    whole = generate(tiny_model, prompt, max_new_tokens=3, ignore_eos=True, probe=whole_probe)
    monkeypatch.setattr(progress, "PREFILL_CHUNK", 4)
    heard = []
    probe = Probe(timing=True).record_stats("*").capture("logits")
    run = GenerationRun(tiny_model, prompt, max_new_tokens=3, ignore_eos=True, probe=probe,
                        on_progress=lambda p: heard.append((p.done, p.chunk_end, p.layer, p.chunks)))
    r = run.run()
    L = tiny_model.config.num_layers
    want = [(a, b, layer, (k + 1, 3)) for k, (a, b) in enumerate([(0, 4), (4, 8), (8, 10)]) for layer in range(L + 1)]
    assert heard == want and Progress(8, 10, 10, L, L).fraction == 1.0
    assert r.token_ids == whole.token_ids
    (a,), (b,) = whole_probe.recording.captured("logits", step=0), probe.recording.captured("logits", step=0)
    assert a.positions == b.positions == [9] and torch.allclose(a.value, b.value, atol=1e-4)
    # the same statistics, (stage, position) for (stage, position), as one forward over the prompt records
    def cells(p):
        return sorted((n, blk.pos0 + t) for blk in p.recording.stats if blk.step == 0 for n in blk.names
                      for t in range(blk.values.shape[1]))
    assert cells(probe) == cells(whole_probe) and {c[1] for c in cells(probe)} == set(range(11))
    assert tiny_model.live_hooks == 0


def test_stop_during_the_prefill(tiny_model, monkeypatch):
    progress = importlib.import_module("engine.progress")     # where the prefill's chunk size lives
    from engine.progress import STOP
    monkeypatch.setattr(progress, "PREFILL_CHUNK", 4)
    r = generate(tiny_model, list(range(100, 110)), max_new_tokens=3, probe=Probe().record_stats("*"),
                 on_progress=lambda p: STOP if p.done == 4 and p.layer == 1 else None)
    assert r.stop_reason == "stopped" and r.steps == [] and tiny_model.live_hooks == 0


def test_on_progress_is_a_parameter_heard_before_the_tokens(tiny_model):
    """The prefill's progress comes through on_progress, the tokens through on_token; an on_token that happens to
    carry an on_progress attribute is not taken as a progress listener (there is one way to pass it)."""
    heard = []

    class Listener:
        def __call__(self, step):
            heard.append(("token", step.index))

        def on_progress(self, p):
            heard.append(("layer", p.layer))
    listener = Listener()
    generate(tiny_model, "hi", max_new_tokens=2, ignore_eos=True, on_token=listener, on_progress=listener.on_progress)
    L = tiny_model.config.num_layers
    assert heard == [("layer", i) for i in range(L + 1)] + [("token", 0), ("token", 1)]
    heard.clear()
    generate(tiny_model, "hi", max_new_tokens=2, ignore_eos=True, on_token=listener)
    assert heard == [("token", 0), ("token", 1)]
