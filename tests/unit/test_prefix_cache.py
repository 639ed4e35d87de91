"""The chat-template opening shared through a prefix cache (engine.prefix_cache, engine.generate.GenerationRun):
a run whose opening's keys and values were copied from the cache computes bit for bit what the same run computes
with its own forward over the opening (every step's logits, every statistics record, the cache's rows), and draws
the tokens a run prefilled in one piece draws; the cache keeps within its bound (least recently used out first);
runs that miss the same opening at once compute it once; prompts that do not start with the whole opening, and
probes that change the forward, share nothing; a packed prefill (engine.batch) of chat prompts fills each run's
opening first and matches each run alone."""
from __future__ import annotations

import threading

import pytest
import torch

from engine import GenerationRun, SamplingParams
from engine.batch.prefill import PrefillGate, prefill_reason, prefill_together
from engine.generate import prompt_ids
from engine.inspection.interventions import scale
from engine.inspection.probe import inspection_probe
from engine.prefix_cache import PrefixCache, prefix_key, shared_prefix_len, template_opening
from tests.helpers import assert_same_stats

pytestmark = pytest.mark.unit

# the bundled tokenizer's template (tiny_model has it): SmolLM's default system turn and the user turn's header
OPENING_TEXT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                "<|im_start|>user\n")
PROMPTS = ["hello there", "a much longer prompt, with more positions to attend to than the first", "x",
           "one two three four five six seven"]


def _run(model, prompt, cache, *, seed=0, params=None, probe=True, **kw) -> GenerationRun:
    return GenerationRun(model, prompt, chat=kw.pop("chat", True), params=params or SamplingParams(temperature=0),
                         seed=seed, max_new_tokens=5, ignore_eos=True, prefix_cache=cache,
                         probe=inspection_probe(timing=False) if probe is True else probe or None, **kw)


def _logits(run) -> list[torch.Tensor]:
    return [c.value for c in run.probe.recording.captures if c.name == "logits"]


def _kv(run) -> tuple[torch.Tensor, torch.Tensor]:
    n = run.cache.get_pos()
    return run.cache.k[:, :, :n], run.cache.v[:, :, :n]


def test_the_opening_is_the_templates_default_system_turn_and_user_header(tiny_model):
    opening = template_opening(tiny_model.tokenizer)
    assert tiny_model.tokenizer.decode(list(opening)) == OPENING_TEXT
    ids = prompt_ids(tiny_model, "hello there", chat=True)
    assert tuple(ids[:len(opening)]) == opening and shared_prefix_len(tiny_model, ids) == len(opening)


def test_a_copied_opening_computes_what_the_runs_own_forward_computes(tiny_model):
    cache = PrefixCache()
    first = _run(tiny_model, PROMPTS[1], cache)
    first.run()
    copied = _run(tiny_model, PROMPTS[1], cache)
    copied.run()
    own = _run(tiny_model, PROMPTS[1], None)          # its own forward over the opening, kept nowhere
    own.run()
    assert (first.prefix_copied, copied.prefix_copied, own.prefix_copied) == (False, True, False)
    assert (cache.computed, cache.hits, len(cache)) == (1, 1, 1)
    assert copied.token_ids == own.token_ids == first.token_ids and copied.text == own.text
    la, lb = _logits(copied), _logits(own)
    assert len(la) == len(lb) == 5 and all(torch.equal(x, y) for x, y in zip(la, lb))
    ra, rb = copied.probe.recording.stat_records(), own.probe.recording.stat_records()
    assert [(r.step, r.name, r.layer, r.pos0) for r in ra] == [(r.step, r.name, r.layer, r.pos0) for r in rb]
    assert all(torch.equal(x.values.nan_to_num(), y.values.nan_to_num()) for x, y in zip(ra, rb))
    n = first.prefix_len
    assert [r.pos0 for r in ra if r.step == 0 and r.name == "embed"] == [0, n]    # the opening, then the rest
    assert all(torch.equal(x, y) for x, y in zip(_kv(copied), _kv(own)))


def test_the_tokens_are_those_of_a_prefill_in_one_piece(tiny_model):
    cache = PrefixCache()
    for p, seed, params in [(PROMPTS[0], 0, SamplingParams(temperature=0)),
                            (PROMPTS[3], 5, SamplingParams(temperature=0.8, top_k=40))]:
        runs = [_run(tiny_model, p, c, seed=seed, params=params) for c in (cache, cache, False)]
        for r in runs:
            r.run()
        assert runs[2].prefix_len == 0 and runs[1].prefix_copied
        assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids
        for x, y in zip(_logits(runs[1]), _logits(runs[2])):       # another split: the same sums up to rounding
            assert torch.allclose(x, y, rtol=1e-4, atol=1e-5)


def _opening_ids(model, k: int) -> list[int]:
    """k + 1 distinct token sequences of the opening's length (for the cache's own bookkeeping)."""
    n = len(template_opening(model.tokenizer))
    return [[(7 * j + i) % 200 + 10 for i in range(n)] for j in range(k)]


def _fill(model, cache: PrefixCache, ids: list[int]) -> tuple[bool, torch.Tensor]:
    kv = model.new_cache(len(ids) + 1)

    def compute() -> None:
        model.forward(torch.tensor(ids), kv, None, last_only=True)
    copied = cache.fill(model, prefix_key(model, ids, kv, None), len(ids), kv, None, compute)
    assert kv.get_pos() == len(ids)
    return copied, kv.k[:, :, :len(ids)].clone()


def test_the_cache_keeps_within_its_bound_least_recently_used_out_first(tiny_model):
    a, b, c = _opening_ids(tiny_model, 3)
    probe_size = PrefixCache()
    _fill(tiny_model, probe_size, a)
    size = probe_size.bytes_held
    assert size == 2 * tiny_model.config.num_layers * tiny_model.config.num_kv_heads * len(a) \
        * tiny_model.config.head_dim * 4          # keys and values, float32, no probe record
    cache = PrefixCache(max_bytes=2 * size)
    _, ka = _fill(tiny_model, cache, a)
    _fill(tiny_model, cache, b)
    assert (cache.computed, len(cache), cache.bytes_held) == (2, 2, 2 * size)
    copied, ka2 = _fill(tiny_model, cache, a)           # a is now the most recently used
    assert copied and torch.equal(ka, ka2)
    _fill(tiny_model, cache, c)                          # past the bound: b (least recently used) goes
    assert (cache.computed, len(cache), cache.bytes_held) == (3, 2, 2 * size)
    assert _fill(tiny_model, cache, a)[0] and _fill(tiny_model, cache, c)[0]
    assert not _fill(tiny_model, cache, b)[0] and cache.computed == 4
    small = PrefixCache(max_bytes=size - 1)              # an entry larger than the bound is computed, not kept
    assert not _fill(tiny_model, small, a)[0] and not _fill(tiny_model, small, a)[0]
    assert (small.computed, len(small), small.bytes_held) == (2, 0, 0)
    with pytest.raises(ValueError, match="bound"):
        PrefixCache(max_bytes=-1)


def test_runs_that_miss_the_same_opening_at_once_compute_it_once(tiny_model):
    alone = [_run(tiny_model, PROMPTS[k % 2], None, seed=k) for k in range(4)]
    for r in alone:
        r.run()
    cache = PrefixCache(wait_s=600.0)       # the waiting runs wait for the first's computation, however slow
    runs = [_run(tiny_model, PROMPTS[k % 2], cache, seed=k) for k in range(4)]
    start, errors = threading.Barrier(len(runs)), []

    def work(r) -> None:
        start.wait()
        try:
            r.run()
        except Exception as e:       # the test's thread reports it
            errors.append(e)
    threads = [threading.Thread(target=work, args=(r,)) for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert (cache.computed, cache.hits, len(cache)) == (1, 3, 1)
    assert sum(not r.prefix_copied for r in runs) == 1
    for a, b in zip(alone, runs):
        assert b.token_ids == a.token_ids
        assert all(torch.equal(x, y) for x, y in zip(_logits(a), _logits(b)))


def test_prompts_without_the_whole_opening_and_forward_changing_probes_share_nothing(tiny_model):
    cache = PrefixCache()
    opening = list(template_opening(tiny_model.tokenizer))
    odd = [_run(tiny_model, "hello there", cache, chat=False),                 # a plain prompt
           _run(tiny_model, "hello there", cache, system="Answer briefly."),    # its own system turn
           _run(tiny_model, opening, cache),                                   # the opening and nothing after it
           _run(tiny_model, opening[:10], cache)]                              # shorter than the opening
    for r in odd:
        assert r.prefix_len == 0
        r.run()
        assert not r.prefix_copied
    assert (cache.computed, cache.hits, len(cache)) == (0, 0, 0)
    hooked = [_run(tiny_model, PROMPTS[0], cache, probe=inspection_probe().replace("blocks.0.mlp_out", scale(0.5)))
              for _ in range(2)]
    for r in hooked:
        r.run()
    assert hooked[0].prefix_len > 0 and not any(r.prefix_copied for r in hooked)
    assert (cache.computed, cache.hits, len(cache)) == (0, 0, 0)
    plain = [_run(tiny_model, PROMPTS[0], cache, probe=None) for _ in range(2)]   # no probe: another key
    watched = _run(tiny_model, PROMPTS[0], cache)
    for r in plain + [watched]:
        r.run()
    assert [r.prefix_copied for r in plain + [watched]] == [False, True, False]
    assert (cache.computed, cache.hits, len(cache)) == (2, 1, 2)
    assert plain[0].token_ids == plain[1].token_ids == watched.token_ids


def test_a_packed_prefill_of_chat_prompts_fills_each_opening_and_matches_each_alone(tiny_model):
    specs = [(p, k, SamplingParams(temperature=0.9, top_k=40) if k % 2 else SamplingParams(temperature=0))
             for k, p in enumerate(PROMPTS)]
    alone = [_run(tiny_model, p, None, seed=s, params=sp) for p, s, sp in specs]
    for r in alone:
        r.run()
    cache = PrefixCache()
    together = [_run(tiny_model, p, cache, seed=s, params=sp) for p, s, sp in specs]
    assert all(prefill_reason(r) is None for r in together)
    assert [len(r.prefill_input()) for r in together] == [len(r.prompt_ids) - r.prefix_len for r in together]
    steps = prefill_together(together)
    assert [s.index for s in steps] == [0, 0, 0, 0] and all(r.packed_prefill for r in together)
    assert [r.cache.get_pos() for r in together] == [len(r.prompt_ids) for r in together]
    assert (cache.computed, cache.hits) == (1, 3) and [r.prefix_copied for r in together] == [False, True, True, True]
    for r in together:
        r.run()
    for a, b in zip(alone, together):
        assert b.token_ids == a.token_ids and b.text == a.text
        assert_same_stats(a, b, rtol=1e-4, atol=1e-5)       # the rest's matmuls ran over more rows
        assert all(torch.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(_logits(a), _logits(b)))
        assert all(torch.equal(x[:, :, :a.prefix_len], y[:, :, :a.prefix_len]) for x, y in zip(_kv(a), _kv(b)))


def test_the_prefill_gate_packs_chat_prompts_after_their_openings(tiny_model):
    alone = [_run(tiny_model, p, None, seed=k) for k, p in enumerate(PROMPTS)]
    for r in alone:
        r.run()
    cache, gate = PrefixCache(), PrefillGate(wait_s=600.0)
    runs = [_run(tiny_model, p, cache, seed=k) for k, p in enumerate(PROMPTS)]
    start, out = threading.Barrier(len(runs)), [None] * len(runs)

    def work(n: int) -> None:
        start.wait()
        try:
            out[n] = gate.prefill(runs[n])
            runs[n].run()
        except Exception as e:       # the test's thread reports it
            out[n] = e
    threads = [threading.Thread(target=work, args=(n,)) for n in range(len(runs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(s is not None and not isinstance(s, Exception) and s.index == 0 for s in out), out
    assert cache.computed == 1 and cache.hits == 3
    for a, b in zip(alone, runs):
        assert b.token_ids == a.token_ids
        assert_same_stats(a, b, rtol=1e-4, atol=1e-5)


def test_a_replay_of_a_chat_run_follows_its_chunks_bit_for_bit(tiny_model):
    from engine.generate import prefill_chunks
    from engine.tools.rescue_runs import replay
    run = _run(tiny_model, PROMPTS[1], PrefixCache())
    run.run()
    n, opening = len(run.prompt_ids), run.prefix_len
    assert prefill_chunks(tiny_model, run.prompt_ids) == [(0, opening), (opening, n)]
    assert prefill_chunks(tiny_model, run.prompt_ids, 0) == [(0, n)]
    again = replay(tiny_model, run.prompt_ids, run.token_ids[:-1])
    got = torch.stack([x[-1] for x in _logits(run)])
    assert torch.equal(again, got)
