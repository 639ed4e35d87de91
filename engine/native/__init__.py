"""The native decode step: one token of a Llama-family model in one C call (decode.c), its build (build.py),
the weights' layout it streams (arena.py) and when the engine uses it (step.py)."""
