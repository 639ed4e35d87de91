"""The engine against transformers (test-only reference) on the bundled model, fp32 on the CPU."""
from __future__ import annotations

import pytest
import torch

from engine import inspection_probe
from engine.generate import generate
from engine.sources import bundled_gguf
from tests.reference import rounding

pytestmark = pytest.mark.filterwarnings("ignore")

LONG_TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
             "combined movable metal type, oil-based ink and a wooden screw press. Within fifty years, presses "
             "operated in more than 250 cities across Europe, and an estimated 20 million volumes had been "
             "printed by 1500. ")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def prompts(tok) -> dict[str, list[int]]:
    long_ids = tok.encode(LONG_TEXT * 12)[:512]
    assert len(long_ids) == 512
    return {
        "raw short": tok.encode("The capital of France is"),
        "raw digits+emoji": tok.encode("In 2024, 3.14159 × 12 = 37.69908 🤖✨ 你好"),
        "chat": tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}]),
        "chat with system": tok.encode_chat([{"role": "system", "content": "You are terse."},
                                             {"role": "user", "content": "Name three prime numbers."}]),
        "raw 512 tokens": long_ids,
    }


def test_logits_match_transformers(bundled_model, hf_reference):
    for name, ids in prompts(bundled_model.tokenizer).items():
        ours = bundled_model.logits(ids)
        ref = hf_logits(hf_reference, ids)
        assert ours.shape == ref.shape == (len(ids), bundled_model.config.vocab_size)
        err = rel_err(ours, ref)
        assert err <= 1e-4, f"{name}: relative error {err:.2e}"


def test_greedy_64_tokens_identical(bundled_model, hf_reference):
    for ids in (bundled_model.tokenizer.encode("Once upon a time, in a small village,"),
                bundled_model.tokenizer.encode_chat([{"role": "user", "content": "Write a haiku about rain."}])):
        ours = generate(bundled_model, ids, max_new_tokens=64, ignore_eos=True).token_ids
        with torch.no_grad():
            ref = hf_reference.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                        attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
        assert ours == ref[0, len(ids):].tolist()


def test_full_inspection_keeps_logits_and_greedy_tokens_equal_to_transformers(bundled_model, hf_reference):
    """The app's probe (statistics of every stage incl. attention, in blocks; logits kept) changes nothing."""
    ids = bundled_model.tokenizer.encode(LONG_TEXT * 4)[:300]
    probed = bundled_model.logits(ids, inspection_probe(timing=True))
    assert rel_err(probed, hf_logits(hf_reference, ids)) <= 1e-4
    ids = bundled_model.tokenizer.encode("Once upon a time, in a small village,")
    ours = generate(bundled_model, ids, max_new_tokens=32, ignore_eos=True, probe=inspection_probe()).token_ids
    with torch.no_grad():
        ref = hf_reference.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
    assert ours == ref[0, len(ids):].tolist()


def test_kv_cache_decode_equals_full_forward(bundled_model):
    ids = bundled_model.tokenizer.encode(LONG_TEXT)[:48]
    full = bundled_model.logits(ids)
    cache = bundled_model.new_cache(len(ids))
    # prefill 20 positions, one chunk of 8 (masked attention over the past), then one token at a time
    parts = [bundled_model.forward(torch.tensor(ids[:20]), cache), bundled_model.forward(torch.tensor(ids[20:28]),
                                                                                         cache)]
    parts += [bundled_model.forward(torch.tensor([t]), cache) for t in ids[28:]]
    stepped = torch.cat(parts).float()
    assert cache.get_pos() == len(ids)
    # within what two float32 evaluations of the full forward differ by (tests/reference/rounding.py: the rms over
    # reordered forwards, K_NORM times); the decode steps are the native step where there is one
    draws = rounding.reordered_runs(lambda: bundled_model.logits(ids), rounding.LOGITS_DRAWS)
    bound = rounding.logits_bound(draws, full, range(len(ids)))
    print(f"\nstepped against full: at most {max(rel_err(stepped[t], full[t]) for t in range(len(ids))) / bound:.2f}"
          f" of the bound {bound:.2e}")
    assert rel_err(stepped, full) <= bound
    for t in range(len(ids)):   # per position too, not only in aggregate
        assert rel_err(stepped[t], full[t]) <= bound, (t, rel_err(stepped[t], full[t]), bound)


def test_dequantised_tensors_equal_transformers_gguf(bundled_dir):
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open
    path = bundled_gguf()
    ref = transformers.LlamaForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ref_sd = ref.state_dict()
    with safe_open(str(bundled_dir / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        assert len(names) == 272
        for name in names:
            ours = f.get_tensor(name)
            assert name in ref_sd, name
            assert torch.equal(ours, ref_sd[name].float()), f"{name} differs from transformers' dequantisation"


def test_chat_answer_contains_paris(bundled_model):
    r = generate(bundled_model, "What is the capital of France?", chat=True, max_new_tokens=32)
    assert "Paris" in r.text
    assert r.stop_reason == "eos"
