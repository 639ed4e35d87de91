"""`python -m engine bench`: `speed` (decode and prefill against the memory-bandwidth floor and
transformers) and `inspection` (the cost of full inspection against a plain prefill)."""
