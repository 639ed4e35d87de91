"""The CUDA path (bf16). Skipped on machines without a GPU; run by scripts/gpu_check.sh when one is lent."""
from __future__ import annotations

import pytest
import torch

from engine import Probe, load_model
from engine.generate import generate

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def gpu_model():
    return load_model(None, device="cuda")


def test_defaults_to_bf16_on_cuda(gpu_model):
    assert gpu_model.device.type == "cuda" and gpu_model.dtype == torch.bfloat16


def test_bf16_logits_close_to_fp32(gpu_model, bundled_model):
    ids = bundled_model.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    ref = bundled_model.logits(ids)
    got = gpu_model.logits(ids)
    assert float((got - ref).norm() / ref.norm()) < 0.03
    assert int(got[-1].argmax()) == int(ref[-1].argmax())


def test_chat_answer_on_gpu(gpu_model):
    r = generate(gpu_model, "What is the capital of France?", chat=True, max_new_tokens=32)
    assert "Paris" in r.text


def test_stats_and_cuda_timing_on_gpu(gpu_model):
    probe = Probe(timing=True).record_stats("*")
    generate(gpu_model, "Hello", max_new_tokens=4, ignore_eos=True, probe=probe)
    assert probe.recording.first_nonfinite() is None and len(probe.recording.stats) > 0
    assert all(t >= 0 for _, _, t in probe.recording.marks)
    assert gpu_model.live_hooks == 0
