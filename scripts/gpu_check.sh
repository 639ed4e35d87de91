#!/usr/bin/env bash
# The one prepared GPU check: CUDA tests (bf16; two new families' blocks: Gemma 2 and Qwen3-MoE; the batched decode step
# across runs and the packed prefill: tests/cuda/test_cuda_batch.py; a GGUF file dequantised to bf16 on the GPU against
# the file as stored on the CPU: tests/cuda/test_cuda_quant.py) and the benchmark
# on the GPU. Run on a machine with a CUDA GPU
# after scripts/setup.sh --test. Prints everything; exits non-zero if a CUDA test fails.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.get_device_name())" || exit 1
python3 -m pytest -q -m cuda tests/cuda; rc=$?          # tests/cuda/test_cuda_families.py: the family check
python3 -m engine bench --device cuda --prompt-tokens 512 --new-tokens 128 --repeats 3 --app --json
python3 -m engine generate "What is the capital of France?" --chat --device cuda
exit $rc
