"""Fit the bundled model's tuned lens on this CPU and write the shipped file (engine/lenses/), then print the
SHIPPED entry engine/tools/lens_file.py records for it and the held-out KL per layer of the logit lens, the fit's
least-squares start and the KL-trained lens.

    python scripts/fit_tuned_lens.py [--tokens 4096] [--rank 32] [--steps 32] [--batch 128] [--lr 1e-3] [--seed 0]
                                     [--eval-tokens 512] [--out PATH]

The recipe written into the file: the stdlib docstrings' train split (engine.tools.lens_corpus), its tokens, the
least-squares start's ridge and rank, then `steps` Adam steps on the exact mean KL(final || lens) over the whole
vocabulary at `batch` positions drawn per step (engine.tools.lens_kl), lr, seed, the layers that kept their trained
maps (those whose KL on the fit's validation texts went down), and this script.
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
from engine.tools.tuned_lens import BATCH, LR, compare_lenses, fit_stages  # noqa: E402

SHIPPED_NAME = "smollm2-135m-instruct-q4_1.safetensors"
SHIPPED_STEPS = 32            # with 4,096 tokens and 128 positions a step: about ten minutes on two cores


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--steps", type=int, default=SHIPPED_STEPS)
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-tokens", type=int, default=512)
    ap.add_argument("--out", type=Path, default=SHIPPED_DIR / SHIPPED_NAME)
    a = ap.parse_args()
    model = load_model(None, device="cpu", dtype="float32")
    t0, c0 = time.perf_counter(), time.process_time()

    def tell(p):
        print(f"  {time.perf_counter() - t0:7.1f} s  {p.what}", flush=True)

    fit = fit_stages(model, rank=a.rank, max_tokens=a.tokens, steps=a.steps, batch=a.batch, lr=a.lr, seed=a.seed,
                     on_progress=tell)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    lens = fit.lens
    lens.recipe["script"] = "scripts/fit_tuned_lens.py"
    lens.weights_checksum = weights_checksum(model)
    path = save_lens(lens, a.out)
    print(f"fitted on {lens.recipe['tokens']} tokens in {wall:.1f} s wall, {cpu:.1f} s CPU; wrote {path} "
          f"({path.stat().st_size / 1e6:.2f} MB)")
    print(f"method: {lens.recipe['method']}")
    print(f"SHIPPED entry: {lens.weights_checksum!r}: ({path.name!r}, {recipe_sha(lens)!r})")
    if fit.kl is not None:
        print("validation KL (nats): layer, least squares, trained, kept")
        for i, (x, y, k) in enumerate(zip(fit.kl.before, fit.kl.after, fit.kl.kept)):
            print(f"{i:3d} {x:8.3f} {y:8.3f} {'trained' if k else 'least squares'}")
    ls = compare_lenses(model, fit.least_squares, max_tokens=a.eval_tokens)
    cmp = compare_lenses(model, lens, max_tokens=a.eval_tokens)
    print(f"held-out KL (nats) over {cmp.tokens} tokens: layer, logit lens, least squares, KL-trained")
    for i, (x, y, z) in enumerate(zip(cmp.logit_kl, ls.tuned_kl, cmp.tuned_kl)):
        print(f"{i:3d} {x:8.3f} {y:8.3f} {z:8.3f}")
    half = len(cmp.logit_kl) // 2
    print(f"first half mean: logit {sum(cmp.logit_kl[:half]) / half:.3f}, least squares "
          f"{sum(ls.tuned_kl[:half]) / half:.3f}, KL-trained {sum(cmp.tuned_kl[:half]) / half:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
