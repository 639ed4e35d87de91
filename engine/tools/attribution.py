"""Which prompt tokens a prediction rests on: occlusion and gradient x input, each checked by a deletion curve.

- Occlusion: replace one token by a neutral token and measure the drop in log p(target) at the last
  position. Each occluded run differs from the prompt only from that position on, so all of them are partial
  runs packed through the model's block function (engine.tools.patching.run_packed), not one forward each.
- Gradient x input: one forward with grad=True whose replace hook on "embed" hands in a leaf tensor, then
  backward of log p(target); a token's score is its embedding row dotted with that row's gradient.
- Deletion curve: remove tokens (replace them by the neutral token) cumulatively in attribution order and
  follow log p(target). The area under it (the mean over 0..T removed tokens) is low when the order puts
  the tokens that matter first; the same area for random orders is the yardstick, so a user sees which
  method is faithful for this prompt.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from engine.errors import InputError
from engine.inspection.probe import Probe
from engine.progress import OnProgress, tell_units
from engine.tools.patching import Base, PackedRun, base_run, packs, run_packed

METHODS = ("occlusion", "grad_x_input")


def neutral_token(model) -> int:
    """The default stand-in for a removed token: a lone space when that is one token (it carries little
    meaning and keeps the text's shape), else the end-of-text token."""
    ids = model.tokenizer.encode(" ")
    if len(ids) == 1:
        return ids[0]
    eos = list(model.config.eos_token_ids) or list(model.tokenizer.eos_ids)
    return int(eos[0]) if eos else 0


def _logp(logits: torch.Tensor, target: int) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1)[..., target]


def _removed_run(base: Base, embed_row: torch.Tensor, removed: list[int]) -> PackedRun:
    """A partial run from layer 0 with the removed positions' embeddings replaced by the neutral one."""
    pos0 = min(removed)
    entry = base.resid_pre[0][pos0:].clone()                                    # (T - pos0, d)
    entry[[p - pos0 for p in removed]] = embed_row.to(entry.dtype)
    return PackedRun(0, pos0, entry=entry)


def occlusion(model, ids: list[int], target: int, neutral: int, base: Base | None = None, *,
              on_progress: OnProgress | None = None, part: tuple[int, int] | None = None) -> list[float]:
    """log p(target) with the prompt minus log p(target) with token t replaced by `neutral`, for every t
    (positive: the token supports the target). on_progress and part as in engine.tools.patching.run_packed."""
    base = base or base_run(model, ids)
    row = model.weights.embed_rows(neutral)
    logits = run_packed(model, base, [_removed_run(base, row, [t]) for t in range(len(ids))],
                        on_progress=on_progress, what="occlusion", part=part)
    return (float(_logp(base.logits, target)) - _logp(logits, target)).tolist()


def grad_x_input(model, ids: list[int], target: int) -> list[float]:
    """Per position: embedding row . d log p(target) / d embedding row (one forward and one backward)."""
    leaf: dict[str, torch.Tensor] = {}

    def make_leaf(x, ctx):
        leaf["e"] = x.detach().clone().requires_grad_(True)                      # (T, d)
        return leaf["e"]
    probe = Probe().replace("embed", make_leaf)
    logits = model.forward(torch.tensor(ids), model.new_cache(len(ids)), probe, last_only=True, grad=True)
    _logp(logits[0], target).backward()
    e = leaf["e"]
    return (e.grad * e.detach()).sum(-1).float().cpu().tolist()


def deletion_curves(model, ids: list[int], target: int, orders: list[list[int]], neutral: int,
                    base: Base | None = None, *, on_progress: OnProgress | None = None,
                    done: int = 0) -> list[list[float]]:
    """For each order: log p(target) after removing its first k tokens, k = 0..T (all orders in one pack).
    on_progress hears each packed call, counted after `done` units of the job, and the job's end."""
    base = base or base_run(model, ids)
    row, T = model.weights.embed_rows(neutral), len(ids)
    runs = [_removed_run(base, row, order[:k]) for order in orders for k in range(1, T + 1)]
    lp = _logp(run_packed(model, base, runs, on_progress=on_progress, what="deletion curves",
                          part=(done, done + packs(runs, T))), target).view(len(orders), T)      # (orders, T)
    start = float(_logp(base.logits, target))
    return [[start] + r for r in lp.tolist()]


def area(curve: list[float]) -> float:
    """Mean log p over the curve's points (0..T tokens removed): lower = the order found what matters sooner."""
    return sum(curve) / len(curve)


@dataclass
class InputAttribution:
    ids: list[int]
    target: int
    target_text: str
    neutral: int
    logp: float                                   # log p(target) with the whole prompt
    scores: dict[str, list[float]]                # method -> per-position score (higher = supports target)
    deletion: dict[str, list[float]]              # method (and "random") -> log p after k removed, k = 0..T
    areas: dict[str, float]                       # method -> deletion area; "random": mean over random orders
    random_areas: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def order(self, method: str) -> list[int]:
        """Positions from the highest score down (ties: earlier position first)."""
        s = self.scores[method]
        return sorted(range(len(s)), key=lambda t: (-s[t], t))

    @property
    def faithful(self) -> str:
        """The method whose deletion curve falls fastest (lowest area)."""
        return min(METHODS, key=lambda m: self.areas[m])

    def as_dict(self) -> dict:
        return {"ids": self.ids, "target": self.target, "target_text": self.target_text, "neutral": self.neutral,
                "logp": self.logp, "scores": self.scores, "deletion": self.deletion, "areas": self.areas,
                "random_areas": self.random_areas, "faithful": self.faithful, "seconds": self.seconds}


def attribute_inputs(model, ids: list[int], target: int, *, neutral: int | None = None, random_orders: int = 4,
                     seed: int = 0, on_progress: OnProgress | None = None) -> InputAttribution:
    """Occlusion and gradient x input side by side, each with its deletion curve, and random orders' areas.
    on_progress (engine.progress) hears each unit (the base forward, each packed call, the gradient) before it
    runs and the end; the total is an upper bound until the deletion curves' packs are known. A STOP answer
    raises engine.progress.Stopped before the next unit (no result)."""
    if not ids:
        raise InputError("nothing to attribute: the prompt is empty")
    V = model.config.vocab_size
    neutral = neutral_token(model) if neutral is None else int(neutral)
    for name, tid in (("target", target), ("neutral", neutral)):
        if not 0 <= int(tid) < V:
            raise InputError(f"{name} token id {tid} is outside the vocabulary [0, {V})")
    t0 = time.perf_counter()
    T = len(ids)
    n_occ = packs([PackedRun(0, t) for t in range(T)], T)
    total = 2 + n_occ + packs([PackedRun(0, 0)] * ((len(METHODS) + random_orders) * T), T)    # at most
    tell_units(on_progress, 0, total, "the prompt's forward")
    base = base_run(model, ids)
    occluded = occlusion(model, ids, target, neutral, base, on_progress=on_progress, part=(1, total))
    tell_units(on_progress, 1 + n_occ, total, "gradient × input: one forward and one backward")
    scores = {"occlusion": occluded, "grad_x_input": grad_x_input(model, ids, target)}
    rng = random.Random(seed)
    randoms = [rng.sample(range(len(ids)), len(ids)) for _ in range(random_orders)]
    orders = [sorted(range(len(ids)), key=lambda t, s=scores[m]: (-s[t], t)) for m in METHODS] + randoms
    curves = deletion_curves(model, ids, target, orders, neutral, base, on_progress=on_progress, done=2 + n_occ)
    deletion = dict(zip(METHODS, curves))
    random_areas = [area(c) for c in curves[len(METHODS):]]
    if randoms:     # the mean random curve, for the plot
        deletion["random"] = [sum(c[k] for c in curves[len(METHODS):]) / len(randoms) for k in range(len(ids) + 1)]
    areas = {m: area(deletion[m]) for m in METHODS}
    areas["random"] = sum(random_areas) / len(random_areas) if random_areas else float("nan")
    return InputAttribution(list(ids), int(target), model.tokenizer.decode([int(target)]), neutral,
                            float(_logp(base.logits, target)), scores, deletion, areas, random_areas,
                            time.perf_counter() - t0)
