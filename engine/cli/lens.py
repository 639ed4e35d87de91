"""python -m engine lens: the tuned lens beside the logit lens (engine.tools.tuned_lens): each layer's mean KL to
the model's final distribution for both lenses over held-out text (the stdlib docstrings' held-out split, or --text),
with the lens' recipe and weights checksum. The lens is the one shipped or kept for the model's weights; --fit fits
one when there is none (least squares, then a few Adam steps on the KL: --steps, default bounded by the model's size,
engine.tools.tuned_lens.default_steps; kept in the cache, engine.tools.lens_file).

    python -m engine lens [--text T ...] [--tokens N] [--fit] [--fit-tokens N] [--rank R] [--steps S] [--json]
        -> {kind: "tuned-lens", layers, tokens, kl: [{layer, logit_lens, tuned_lens}], rank, recipe,
            weights_checksum, fitted_now, fit_seconds}
"""
from __future__ import annotations

import argparse
import json
import time

from engine.cli.prescribe import job_progress
from engine.errors import InputError
from engine.tools.lens_file import find_lens, keep_lens, read_lens
from engine.tools.tuned_lens import DEFAULT_RANK, DEFAULT_TOKENS, EVAL_TOKENS, compare_lenses, fit_tuned_lens


def add_commands(sub, common) -> None:
    p = sub.add_parser("lens", help="the tuned lens beside the logit lens: each layer's KL to the final "
                                    "distribution on held-out text")
    common.model_args(p)
    p.add_argument("--text", action="append", default=None,
                   help="a held-out text (repeatable; default: docstrings of stdlib modules the fit never reads)")
    p.add_argument("--tokens", type=int, default=EVAL_TOKENS, help=f"held-out tokens (default {EVAL_TOKENS})")
    p.add_argument("--fit", action="store_true", help="fit and keep a lens when none is shipped or kept")
    p.add_argument("--fit-tokens", type=int, default=DEFAULT_TOKENS,
                   help=f"tokens to fit on with --fit (default {DEFAULT_TOKENS})")
    p.add_argument("--rank", type=int, default=DEFAULT_RANK, help=f"the maps' rank with --fit (default {DEFAULT_RANK})")
    p.add_argument("--steps", type=int, default=None,
                   help="Adam steps on the KL with --fit (default: 20, fewer for a wide model: minutes at most)")
    p.add_argument("--json", action="store_true", help="print everything as one JSON object")
    p.set_defaults(fn=lambda a: cmd_lens(a, common))


def cmd_lens(a: argparse.Namespace, common) -> int:
    model = common.load(a)
    lens, fitted, seconds = find_lens(model), False, None
    if lens is None:
        if not a.fit:
            raise InputError(f"tuned lens not fitted yet for {model.name}'s weights: run again with --fit to fit "
                             "one (kept in the cache for next time)")
        t0 = time.perf_counter()
        lens = fit_tuned_lens(model, rank=a.rank, max_tokens=a.fit_tokens, steps=a.steps,
                              on_progress=job_progress("fit"))
        seconds = time.perf_counter() - t0
        lens = read_lens(keep_lens(model, lens, "python -m engine lens --fit"), model)
        fitted = True
    cmp = compare_lenses(model, lens, a.text, max_tokens=a.tokens, on_progress=job_progress("held-out KL"))
    if a.json:
        print(json.dumps({"kind": "tuned-lens", **cmp.as_dict(), "rank": lens.rank, "recipe": lens.recipe,
                          "weights_checksum": lens.weights_checksum, "fitted_now": fitted,
                          "fit_seconds": seconds}))
        return 0
    r = lens.recipe
    print(f"tuned lens of rank {lens.rank} fitted on {r['tokens']} tokens of {r['corpus']} by {r['script']}"
          f"{f' (now, in {seconds:.1f} s)' if fitted else ''}; weights {lens.weights_checksum}")
    print(f"method: {r['method']}")
    print(f"KL to the final distribution (nats, mean over {cmp.tokens} held-out tokens)")
    print("layer  logit lens  tuned lens")
    for i, (x, y) in enumerate(zip(cmp.logit_kl, cmp.tuned_kl)):
        print(f"{i:5d}  {x:10.4f}  {y:10.4f}")
    return 0
