"""python -m engine atlas: every attention head scored on the classic patterns (previous-token, first-token, self,
duplicate-token, entropy over the project's own docs; induction over repeated random tokens; engine.tools.head_atlas).

    python -m engine atlas [--text T ...] [--repeats N] [--length N] [--seed S] [--top N] [--recompute] [--json]
        -> {layers, heads, tokens, repeats, length, seed, texts, scores, heads_scored: [{layer, head, <score>...,
            top text (previous-token), top text (duplicate-token)}], top: {score: [[layer, head], ...]},
            windows: {score: [{layer, head, windows: [{sequence, query, key, score}]}]} (the top heads' best
            windows), source: "disk" | "computed", file, note}

Computed once per model and kept beside its imports (engine.tools.atlas_store); --recompute computes it again and
rewrites the file.
"""
from __future__ import annotations

import argparse
import json
import math

from engine.cli.prescribe import job_progress
from engine.tools.atlas_store import kept_head_atlas
from engine.tools.head_atlas import SCORE_NAMES


def add_commands(sub, common) -> None:
    p = sub.add_parser("atlas", help="every attention head scored: previous-token, first-token, self, "
                                     "duplicate-token, induction, entropy")
    common.model_args(p)
    p.add_argument("--text", action="append", default=None,
                   help="a text to score on (repeatable; default: prose paragraphs of the project's docs)")
    p.add_argument("--repeats", type=int, default=4, help="repeated random sequences for induction (default 4)")
    p.add_argument("--length", type=int, default=64, help="tokens in each copy of a random sequence (default 64)")
    p.add_argument("--seed", type=int, default=0, help="the random tokens' seed (default 0)")
    p.add_argument("--top", type=int, default=5, help="heads listed per score (default 5)")
    p.add_argument("--recompute", action="store_true",
                   help="compute the atlas again even when a valid one is kept on disk, and rewrite it")
    p.add_argument("--json", action="store_true", help="print everything as one JSON object")
    p.set_defaults(fn=lambda a: cmd_atlas(a, common))


def cmd_atlas(a: argparse.Namespace, common) -> int:
    model = common.load(a)
    kept = kept_head_atlas(model, a.text, repeats=a.repeats, length=a.length, seed=a.seed, recompute=a.recompute,
                           on_progress=job_progress("atlas"))
    atlas = kept.atlas
    if a.json:
        d = atlas.as_dict() | {"source": kept.source, "file": str(kept.path) if kept.path else None,
                               "note": kept.note}
        for row in d["heads_scored"]:           # JSON has no NaN: a score with nothing to measure is null
            row.update({k: None for k, v in row.items() if isinstance(v, float) and math.isnan(v)})
        print(json.dumps(d))
        return 0
    if kept.note:
        print(f"note: {kept.note}")
    print(("read from " if kept.source == "disk" else "computed, kept at ") + str(kept.path) if kept.path else
          "computed (the model has no folder to keep it beside)")
    print(f"{atlas.layers} layers x {atlas.heads} heads over {len(atlas.texts)} texts ({atlas.tokens} tokens) and "
          f"{atlas.repeats} x 2 x {atlas.length} repeated random tokens (seed {atlas.seed})")
    for name in SCORE_NAMES:
        best = ", ".join(f"L{r['layer']}H{r['head']} {r[name]:.3f}" for r in atlas.ranked(name, max(1, a.top)))
        print(f"  {name:16s} {'(lowest first) ' if name == 'entropy' else ''}{best}")
    return 0
