"""How far two float32 evaluations of the same forward may differ: the bounds the reference tier holds the native
decode step's statistics to against the PyTorch forward's, and a run's logits to another evaluation's
(tests/reference/test_native_reference.py, test_fidelity.py's cached decode: logits_bound).

The two paths compute the same function and differ only in rounding:

- the order in which each matrix product adds its K terms (decode.c: each thread's block of rows, four rows at a
  time, then the blocks' partial sums; the PyTorch forward: MKL's kernels over engine/matmul.py's tiles of 8
  rows), and the order of the other sums (RMSNorm's, the softmax's);
- the elementwise operations' last bits (exp within 2 ulp of expf, engine/native/vexp.h; silu, rope, the norm's
  scale, fused multiply-adds);
- the statistics' own sums (engine/native/rowstat.h: 32 lanes over the row, then the lanes, in double; the PyTorch
  moments of engine/inspection/moment_stats.py: Σx and ‖x‖, std from Σx²/n - mean²).

A worst-case bound (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., §3.1: a sum of K terms in
any order is within γ_K = K u / (1 - K u) of exact, relative to Σ|terms|) holds for one product but is useless
here: with K = 576 it is already 3.4e-5 of Σ|x_i w_i|, often 10-30 times the product itself, and it compounds
through 30 layers past the values themselves. Rounding errors behave as independent, mean-zero variables instead
(Higham & Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019: the
error of a length-K sum grows as √K u, not K u, with a probability of exceeding λ times that which falls as
exp(-λ²/2)). The difference of two evaluations in two orders is then a sum of many such errors carried through the
network: near-normal, with a standard deviation σ per statistic that depends on the network and the input, not on
the order chosen. We measure σ the way Monte Carlo arithmetic does (Parker, Pierce & Eggert, "Monte Carlo
arithmetic", Comput. Sci. Eng. 2(4), 2000): DRAWS evaluations of the PyTorch forward whose one-row products are
summed in random orders (`reordered_mm`: the same terms, split at random points into 2-12 pieces added in a random
order, which is what the native step's thread blocks are), each compared with the plain PyTorch forward.

The bound for each statistic is K_SIGMA σ̂ plus `floor`, what the draws cannot vary because every draw shares it:
the statistics' own sums (both within γ_m of Σ|x|, m = n/32 + 17 the longest chain of additions in rowstat.h's
sum over n values: n/32 a lane, then the lanes; torch's vectorised and cascaded sums have shorter chains) and the
elementwise operations' last bits (ELEMENTWISE_ULPS of the stage's largest value)."""
from __future__ import annotations

from typing import Callable
from unittest import mock

import torch

import engine.model

U = 2.0 ** -24              # float32's unit roundoff
DRAWS = 8                   # reordered PyTorch forwards; σ̂ pools a stage's draws over the decode steps compared
K_SIGMA = 15.0              # a normal tail beyond 15σ is 1e-50 a statistic (t with 23 degrees of freedom, σ̂ from
                            # 24 draws: 1e-13), for about 7,700 compared. The draws reorder the products only; the
                            # native step's other sums (RMSNorm's d squares one after another: a relative error of
                            # about √d u shared by the row's every value; the softmax's) add errors of the same kind
                            # that they do not vary. Measured (2026-12-07) with 1, 2, 3, 5 and 8 threads (each its
                            # own split of the native products): the native differences reached 0.42-0.68 of
                            # 10 σ̂ + floor, so 15 leaves at least twice the largest seen
ELEMENTWISE_ULPS = 16.0     # exp 2 ulp, then silu's or the softmax's multiply, divide and FMA: a few ulps a value
COLUMNS = ("min", "max", "mean", "std", "absmax")
LOGITS_DRAWS = 4            # reordered forwards of a whole run (prefill and decode) for a logits comparison
K_NORM = 10.0               # a run's logits against another implementation's: the relative error at each position
                            # within K_NORM times the draws' rms (pooled over the run's decoded positions). Not a
                            # normal tail: a position's error is dominated by a few directions of the residual
                            # stream, so one position's draws spread 3x. Measured (2026-12-07, 1 and 2 threads):
                            # the native step against transformers reached 1.8-2.4 times that rms (0.18-0.24 of
                            # the bound, 2.0e-5-2.5e-5), and one term of layer 14's down product left out 4.6-43x


def reordered_mm(real, gen: torch.Generator, every_product: bool = False):
    """engine.model's product (real: engine.matmul.mm) with every one-row product summed in another order drawn from
    gen: K split at random points into 2-12 pieces, each piece's product by `real`, the pieces added in a random
    order. A product of several rows (prefill) is left as it is (both paths share it) unless every_product."""
    def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != 1 and not every_product:
            return real(x, w)
        K = w.shape[0]
        pieces = int(torch.randint(2, 13, (1,), generator=gen))
        cuts = [0, *sorted(set(torch.randint(1, K, (pieces - 1,), generator=gen).tolist())), K]
        parts = [x[:, a:b] @ w[a:b] for a, b in zip(cuts, cuts[1:])]
        order = torch.randperm(len(parts), generator=gen).tolist()
        out = parts[order[0]]
        for i in order[1:]:
            out = out + parts[i]
        return out
    return mm


def stage_width(name: str, cfg, positions: int) -> int:
    """The number of values one position's statistics of stage `name` are taken over (positions: keys attended)."""
    stage = name.split(".", 2)[-1] if name.startswith("blocks.") else name
    if stage in ("attn.q", "attn.q_rot", "attn.z"):
        return cfg.num_heads * cfg.head_dim
    if stage in ("attn.k", "attn.v", "attn.k_rot"):
        return cfg.num_kv_heads * cfg.head_dim
    if stage in ("attn.scores", "attn.pattern"):
        return cfg.num_heads * positions
    if stage.startswith("mlp.") and stage != "mlp_out":
        return cfg.intermediate_size
    return cfg.vocab_size if stage == "logits" else cfg.hidden_size


def floor(stats: torch.Tensor, n: int) -> torch.Tensor:
    """stats (5,) = min, max, mean, std, absmax of one position's stage over n values (the PyTorch forward's) -> the
    part of the bound (5,) no reordering of the products varies: the elementwise operations' last bits on every
    column; for the mean, both paths' sums within γ_m of Σ|x| <= n absmax; for the std, the moments' variance
    Σx²/n - mean² within 2 γ_m (std² + mean²) <= 2 γ_m absmax² and the two-pass's within γ_m std², each moving the
    std by its variance's error / (2 std), and the mean's error moving the moments' std by |mean| / std times it.
    Min, max and absmax are values of the stage, chosen without rounding."""
    m = n / 32 + 17
    gamma = m * U / (1 - m * U)
    lo, hi, mean, std, amax = stats.double().tolist()
    base = ELEMENTWISE_ULPS * U * amax
    d_mean = 2 * gamma * amax
    d_std = (gamma * amax ** 2 + gamma * std ** 2 / 2 + abs(mean) * d_mean) / max(std, 1e-30)
    return torch.tensor([base, base, base + d_mean, base + d_std, base], dtype=torch.float64)


def reordered_runs(run: Callable[[], torch.Tensor], draws: int, every_product: bool = True,
                   seed: int = 0) -> list[torch.Tensor]:
    """run() `draws` times with engine.model's products reordered (reordered_mm, drawn from one seeded generator:
    the same draws every time)."""
    gen = torch.Generator().manual_seed(seed)
    with mock.patch.object(engine.model, "mm", reordered_mm(engine.model.mm, gen, every_product)):
        return [run() for _ in range(draws)]


def logits_bound(draws: list[torch.Tensor], want: torch.Tensor, positions) -> float:
    """K_NORM times the rms, over the draws and the positions, of a draw's relative error against want (T, V): the
    bound on a position's relative error for another evaluation of the same logits."""
    errs = [float((d[t].double() - want[t].double()).norm() / want[t].double().norm()) for d in draws
            for t in positions]
    return K_NORM * float(torch.tensor(errs).square().mean().sqrt())
