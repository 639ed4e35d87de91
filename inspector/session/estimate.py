"""How long a run will take on this server, and how sure that is; and how far a prefill is, by its work.

A prefill costs a fixed part (setting up the probe and cache, the last position's sampling), a part linear in
the prompt's positions (the weights' matmuls) and a quadratic part (each position attends to every earlier
one): t(n) = c0 + c1·n + c2·n², fitted by non-negative least squares on this server's measured runs of one model.
Without the fixed term, a fit on short prompts only (where the fixed part is most of the time) read that part
as a cost per position and predicted 941 s for a 578-token prompt that took 173 s (issue 21, item 4).

The same quadratic weights a running prefill's progress: chunk [a, b) costs c1·(b − a) + c2·(b² − a²), so the
later chunks, which attend to more positions, take longer than the early ones; an ETA that assumes equal chunks
is optimistic early on."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.config import ModelConfig
from engine.progress import Progress

FULL_TERMS = 3           # prompt lengths needed to tell the fixed, linear and quadratic parts apart
BEYOND = 1.25            # an estimate for a prompt longer than this × the longest measured is an extrapolation
# The terms tried with fewer lengths than FULL_TERMS (then exact fits tie): first the ones that predict least wildly
# beyond the data (a fixed part plus a cost per position), as the full fit's order of preference among equals.
SUBSETS = [(0, 1, 2), (0, 1), (1, 2), (0, 2), (1,), (0,), (2,)]


@dataclass(frozen=True)
class PrefillFit:
    """t(n) = c0 + c1·n + c2·n² seconds, fitted on `lengths` distinct prompt lengths up to `longest` positions;
    spread: the largest relative miss of the fit on its own measurements (None: as many numbers as terms, so
    the fit says nothing about its own accuracy)."""
    c0: float
    c1: float
    c2: float
    lengths: int
    longest: int
    spread: float | None

    def seconds(self, n: int) -> float:
        return self.c0 + self.c1 * n + self.c2 * n * n

    def rough(self, n: int) -> str | None:
        """Why an estimate for an n-position prompt is rough, in words; None when it is not."""
        if self.lengths < FULL_TERMS:
            return (f"rough: measured on {self.lengths} prompt length{'s' if self.lengths > 1 else ''} only, "
                    f"up to {self.longest:,} tokens")
        if n > BEYOND * self.longest:
            return f"rough: measured only on prompts up to {self.longest:,} tokens"
        if self.spread is None:
            return "rough: too few runs measured to say how far off it may be"
        return None


def fit_prefill(samples: list[tuple[int, float]]) -> PrefillFit | None:
    """The non-negative least-squares fit of c0 + c1·n + c2·n² to (positions, seconds) samples (None without
    any). With fewer than three distinct lengths the terms cannot all be told apart: only as many terms as
    lengths are fitted (one length: proportional; two: a fixed part plus a cost per position, when that fits)."""
    pts = [(int(n), float(t)) for n, t in samples if n > 0 and t >= 0]
    if not pts:
        return None
    lengths = len({n for n, _ in pts})
    scale = float(max(n for n, _ in pts))                   # columns of similar size: a well-conditioned solve
    x = np.array([[1.0, n / scale, (n / scale) ** 2] for n, _ in pts])
    y = np.array([t for _, t in pts])
    if lengths == 1:
        best: tuple = ((0.0, float(y.mean() / x[0, 1]), 0.0), 0)
    else:
        best = _best_subset(x, y, lengths)
    (c0, c1, c2), used = best
    fit = PrefillFit(c0, c1 / scale, c2 / scale ** 2, lengths, int(scale), None)
    if len(pts) > used:
        fit = PrefillFit(fit.c0, fit.c1, fit.c2, lengths, int(scale),
                         max(abs(t / fit.seconds(n) - 1) if fit.seconds(n) > 0 else 0.0 for n, t in pts))
    return fit


def _best_subset(x: np.ndarray, y: np.ndarray, lengths: int) -> tuple[tuple[float, float, float], int]:
    """The smallest squared error over the term subsets with non-negative coefficients (the NNLS optimum is the
    plain least squares of its own positive terms, so trying every subset finds it); near-ties go to the
    earlier subset of SUBSETS. Returns the coefficients (of the scaled columns) and how many terms are used."""
    tol = 1e-12 * float(y @ y) + 1e-300
    found = []
    for rank, terms in enumerate(SUBSETS):
        if len(terms) > lengths:
            continue
        cols = list(terms)
        coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if (coef < 0).any():
            continue
        full = [0.0, 0.0, 0.0]
        for i, c in zip(cols, coef):
            full[i] = float(c)
        err = float(((x @ np.array(full)) - y) @ ((x @ np.array(full)) - y))
        found.append((err, rank, tuple(full), len(cols)))
    least = min(f[0] for f in found)                  # never empty: n alone always fits non-negatively
    _, _, coef, used = min((f for f in found if f[0] <= least + tol), key=lambda f: f[1])
    return coef, used


@dataclass(frozen=True)
class Estimate:
    """A run's expected seconds: prefill + decode, the range the measurements allow, and why it is rough."""
    n_prompt: int
    max_new: int
    prefill: float
    decode: float
    low: float
    high: float
    rough: str | None

    @property
    def total(self) -> float:
        return self.prefill + self.decode

    def caption(self) -> str:
        span = f"{self.low:,.0f}–{self.high:,.0f} s; " if round(self.high) > round(self.low) else ""
        return (f"Estimate: ≈ {self.total:,.0f} s ({span}{self.n_prompt:,} prompt tokens ≈ {self.prefill:,.1f} s, "
                f"then up to {self.max_new:,} tokens ≈ {self.decode:,.1f} s; measured on this server)"
                + ("" if self.rough is None else f" · {self.rough}"))


def estimate(prefills: list[tuple[int, float]], per_token: list[float], n_prompt: int,
             max_new: int) -> Estimate | None:
    """The estimate from measured (prompt positions, prefill seconds) and seconds per decoded token."""
    fit = fit_prefill(prefills)
    if fit is None:
        return None
    pre, steps = fit.seconds(n_prompt), max(0, max_new - 1)
    mean = sum(per_token) / len(per_token) if per_token else 0.0
    dec = mean * steps
    miss = fit.spread or 0.0
    low = pre * max(0.0, 1 - miss) + (min(per_token) if per_token else 0.0) * steps
    high = pre * (1 + miss) + (max(per_token) if per_token else 0.0) * steps
    return Estimate(n_prompt, max_new, pre, dec, low, high, fit.rough(n_prompt))


# ---- a running prefill's progress, by work --------------------------------------------------------------
def flop_shape(config: ModelConfig) -> tuple[float, float]:
    """(c1, c2) from the model's arithmetic, for a model not yet measured here: per position, the blocks'
    matmuls; per (query, key) pair, the scores and the weighted sum (n²/2 pairs)."""
    d, q = config.hidden_size, config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    return 2.0 * (d * q + 2 * d * kv + q * d + 3 * d * config.intermediate_size), 2.0 * q


def work_fraction(p: Progress, c1: float, c2: float) -> float:
    """The share of the prefill's work done at p, chunk [a, b) weighing c1·(b − a) + c2·(b² − a²) and each
    layer of a chunk an equal part of it."""
    def work(n: int) -> float:
        return c1 * n + c2 * n * n
    total = work(p.total)
    if total <= 0 or p.layers <= 0:
        return p.fraction
    return (work(p.done) + (work(p.chunk_end) - work(p.done)) * p.layer / p.layers) / total


def prefill_left(p: Progress, spent: float, shape: tuple[float, float]) -> float | None:
    """Seconds left in a prefill that has run `spent` seconds to p, at this run's own pace so far (None while too
    little is done to tell)."""
    f = work_fraction(p, *shape)
    return spent * (1 - f) / f if f > 0.02 else None
