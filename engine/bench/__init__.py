"""`python -m engine bench`: `speed` (decode and prefill against the memory-bandwidth floor and transformers; it runs
the next three), `prefill` (the plain prefill against transformers' at 512 and 2,048 tokens), `inspection` (--app:
the cost of full inspection against a plain prefill, and of an inspected decoded token), `app_run` (--app: the app's
whole run of a long prompt against a plain generation) and `tools` (--tools: each doctor and explainer against one
plain generation). engine/cli/bench.py runs `speed` and `tools`."""
