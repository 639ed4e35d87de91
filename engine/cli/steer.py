"""python -m engine steer: a steering vector from two contrasting prompt sets, added at one layer with a coefficient
while a prompt is continued, beside the plain continuation (engine.tools.steering).

    python -m engine steer "PROMPT" --positive "I love this" --positive "..." --negative "I hate this" ...
        --layer 12 --coefficient 4 [sampling flags] [--json]
        -> {plain_ids, plain_text, steered_ids, steered_text, coefficient, layer, vector: {layer, stage, norm, ...},
            steps: [{step, token, text, kl_steered_plain, p_steered, p_plain, plain_top, plain_top_text}]}
"""
from __future__ import annotations

import argparse
import json

from engine.tools.steering import steer, steering_vector


def add_commands(sub, common) -> None:
    p = sub.add_parser("steer", help="add a steering vector (the mean difference of two prompt sets' residual "
                                     "streams at a layer) while continuing a prompt; plain and steered side by side")
    common.prompt_args(p), common.sampling_args(p), common.model_args(p)
    p.add_argument("--positive", action="append", default=[], metavar="TEXT", help="a prompt of the positive set "
                                                                                   "(repeat the flag)")
    p.add_argument("--negative", action="append", default=[], metavar="TEXT", help="a prompt of the negative set")
    p.add_argument("--layer", type=int, required=True, help="the block whose output (resid_post) is steered")
    p.add_argument("--coefficient", type=float, default=4.0, help="times the vector added (default 4; 0: none)")
    p.add_argument("--json", action="store_true", help="print everything as one JSON object")
    p.set_defaults(fn=lambda a: cmd_steer(a, common))


def cmd_steer(a: argparse.Namespace, common) -> int:
    model = common.load(a)
    vec = steering_vector(model, a.positive, a.negative, a.layer, chat=a.chat)
    run = steer(model, common.run_settings(a), vec, a.coefficient)
    out = {**run.as_dict(), "vector": {k: v for k, v in vec.as_dict().items() if k != "vector"}}
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"steering at {vec.stage}, coefficient {run.coefficient:g} (vector norm {vec.norm:.3g})")
    print(f"plain:   {run.plain_text!r}")
    print(f"steered: {run.steered_text!r}")
    for s in run.steps:
        print(f"  step {s['step']:3d} {s['text']!r:16s} KL(steered||plain) {s['kl_steered_plain']:.3f}  "
              f"p {s['p_steered']:.3f} (plain {s['p_plain']:.3f}; plain's top {s['plain_top_text']!r})")
    return 0
