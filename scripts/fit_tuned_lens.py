"""Fit the bundled model's tuned lens on this CPU and write the shipped file (engine/lenses/), then print the
SHIPPED entry engine/tools/lens_file.py records for it and the held-out KL of both lenses per layer.

    python scripts/fit_tuned_lens.py [--tokens 4096] [--rank 32] [--eval-tokens 512] [--out PATH]

The recipe written into the file: the stdlib docstrings' train split (engine.tools.lens_corpus), its tokens, the
regression's ridge and rank, no KL steps (a KL step over the 49,152-token vocabulary for 30 layers costs minutes
on two shared cores; the regression alone already beats the logit lens at every layer), seed 0, this script.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import load_model  # noqa: E402
from engine.tools.lens_file import SHIPPED_DIR, recipe_sha, save_lens, weights_checksum  # noqa: E402
from engine.tools.tuned_lens import compare_lenses, fit_tuned_lens  # noqa: E402

SHIPPED_NAME = "smollm2-135m-instruct-q4_1.safetensors"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--eval-tokens", type=int, default=512)
    ap.add_argument("--out", type=Path, default=SHIPPED_DIR / SHIPPED_NAME)
    a = ap.parse_args()
    model = load_model(None, device="cpu", dtype="float32")
    t0, c0 = time.perf_counter(), time.process_time()
    lens = fit_tuned_lens(model, rank=a.rank, max_tokens=a.tokens)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    lens.recipe["script"] = "scripts/fit_tuned_lens.py"
    lens.weights_checksum = weights_checksum(model)
    path = save_lens(lens, a.out)
    print(f"fitted on {lens.recipe['tokens']} tokens in {wall:.1f} s wall, {cpu:.1f} s CPU; wrote {path} "
          f"({path.stat().st_size / 1e6:.2f} MB)")
    print(f"SHIPPED entry: {lens.weights_checksum!r}: ({path.name!r}, {recipe_sha(lens)!r})")
    cmp = compare_lenses(model, lens, max_tokens=a.eval_tokens)
    print(f"held-out KL (nats) over {cmp.tokens} tokens: layer, logit lens, tuned lens")
    for i, (x, y) in enumerate(zip(cmp.logit_kl, cmp.tuned_kl)):
        print(f"{i:3d} {x:8.3f} {y:8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
