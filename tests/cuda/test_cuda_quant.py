"""A GGUF file on CUDA: its blocks are not kept there (the block kernels are CPU code), so the file opens dequantised
to bf16 on the GPU, and asking for it as stored on CUDA is refused by name. Skipped without a GPU; run by
scripts/gpu_check.sh when one is lent."""
from __future__ import annotations

import pytest
import torch

from engine import EngineError, load_model

pytestmark = pytest.mark.cuda
PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def stored_cpu():
    return load_model(None, quant="stored")          # the bundled Q4_1 file as stored: the file's own arithmetic


def test_gguf_dequantised_to_bf16_on_cuda_is_close_to_the_file_as_stored(stored_cpu):
    gpu = load_model(None, device="cuda", quant="dequantized")
    assert gpu.device.type == "cuda" and gpu.dtype == torch.bfloat16
    ids = stored_cpu.tokenizer.encode(PROMPT)
    ref = stored_cpu.logits(ids).float()
    got = gpu.logits(ids).float().cpu()
    assert float((got - ref).norm() / ref.norm()) < 0.03          # bf16's own error on this model (test_cuda.py)
    assert int(got[-1].argmax()) == int(ref[-1].argmax())


def test_stored_on_cuda_is_refused_by_name():
    with pytest.raises(EngineError, match="quant='stored' runs on the CPU"):
        load_model(None, device="cuda", quant="stored")
