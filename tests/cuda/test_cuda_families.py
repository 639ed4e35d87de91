"""Two new families' block on CUDA in bf16 (nothing family-specific is CPU-only): Gemma 2 (post-norms, soft caps,
window rings) and Qwen3-MoE (q/k norms, router and experts), against transformers' fp32 logits on the CPU."""
from __future__ import annotations

import pytest
import torch

from engine import load_model
from tests.reference.family_models import build

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PROMPT = [int(t) for t in torch.randint(3, 49000, (40,), generator=torch.Generator().manual_seed(7))]


@pytest.mark.parametrize("name", ["gemma2", "qwen3_moe"])
def test_family_runs_on_cuda_in_bf16_close_to_fp32(tmp_path, tokenizer_files, name):
    transformers = pytest.importorskip("transformers")
    d = build(name, tmp_path / name, tokenizer_files)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    m = load_model(d, device="cuda")
    assert m.dtype == torch.bfloat16 and m.weights.embed.is_cuda
    rows = (m.logits(PROMPT) - want).abs().max(-1).values / want.abs().max()
    # bf16: the tolerance of tests/reference/test_families.py (experts: a rare routing flip at a near tie)
    assert float(rows.median()) <= 0.02 and float((rows > 0.1).float().mean()) <= 1 / 8
    cache = m.new_cache(len(PROMPT))
    m.forward(torch.tensor(PROMPT[:30]), cache)
    for t in PROMPT[30:]:                      # decode through the rings / experts on the device
        assert torch.isfinite(m.forward(torch.tensor([t]), cache)).all()
