"""The native accelerators: the decode step, one token of a Llama-family model in one C call (decode.c), its batched
form for several runs' tokens at once (decode_rows.c, with decode.c's per-row operations from llama_ops.h), and when
the engine uses them (step.py); the statistics backend of multi-token forwards (inspect.c, inspect.py; the per-row
kernel rowstat.h is shared with decode.c); the products of GGUF matrices kept in their quantised blocks (quant.c,
quant.py, for engine.quant_matrix); and their build into one cached library (build.py). The weights' layout
the decode step streams is made in step.py; engine.accelerator chooses these, nothing else imports them."""
