"""python -m engine qk: why a head attends where it does — one pre-softmax attention score split exactly into
query-side x key-side components (embedding, every earlier head, every earlier MLP; engine.tools.qk_attribution).

    python -m engine qk "PROMPT" --layer L --head H --query I --key J [--top N] [--json]
        -> {layer, head, query, key, score, total, remainder, exact, why_inexact, top_pairs: [{query side, key side,
            term}], groups, by_group}
"""
from __future__ import annotations

import argparse
import json

from engine.generate import prompt_ids
from engine.tools.qk_attribution import qk_attribution


def add_commands(sub, common) -> None:
    p = sub.add_parser("qk", help="why head H at layer L attends from position I to J: the score split into "
                                  "query-side x key-side components")
    common.prompt_args(p), common.model_args(p)
    for flag, what in (("--layer", "the layer"), ("--head", "the query head"), ("--query", "the query position"),
                       ("--key", "the key position (at most the query's)")):
        p.add_argument(flag, type=int, required=True, help=what)
    p.add_argument("--top", type=int, default=15, help="pairs listed (default 15)")
    p.add_argument("--json", action="store_true", help="print everything as one JSON object")
    p.set_defaults(fn=lambda a: cmd_qk(a, common))


def cmd_qk(a: argparse.Namespace, common) -> int:
    model = common.load(a)
    ids = prompt_ids(model, a.prompt, chat=a.chat, system=a.system, allow_special=a.allow_special)
    r = qk_attribution(model, ids, a.layer, a.head, a.query, a.key)
    top = max(1, min(a.top, 500))
    if a.json:
        print(json.dumps(r.as_dict(top)))
        return 0
    tok = model.tokenizer
    print(f"layer {r.layer} head {r.head}: query {r.query} {tok.decode([ids[r.query]])!r} -> key {r.key} "
          f"{tok.decode([ids[r.key]])!r}: score {r.score:.5g} = {r.total:.5g} over the terms "
          f"(remainder {r.remainder:.2g}{'' if r.exact else '; not exact: ' + r.why_inexact})")
    for pair in r.top_pairs(top):
        print(f"  {pair['term']:+10.4f}  {pair['query side']:24s} x {pair['key side']}")
    return 0
