"""Stage 2 of the tuned lens (engine.tools.tuned_lens): Adam steps on the mean KL(final || lens) itself, from the
least-squares maps of stage 1, every layer's translator trained on its own loss (the loss is a sum over layers of
terms that each depend on one layer's map only, so one Adam over all maps is every layer trained alone).

    head = LensHead.of(model)                          # the final norm and unembedding, fp32, weights read once
    maps, report = kl_train(head, resid, maps, steps=40, lr=1e-3, batch=128, seed=0, validation=mask)

What is exact and what is sampled. Each step draws `batch` positions (the same for every layer, from a seeded
generator) and computes, for those only, the final distribution p (from the last layer's stream through the head)
and each layer's lens distribution q over the whole vocabulary: the loss is the exact mean of KL(p || q) over the
drawn positions, no top-k truncation, so it is an unbiased estimate of the corpus' mean KL. Its gradient is exact
too, written out rather than left to autograd over the (batch, vocab) logits: dKL/dz = softmax(z) - p (through
Granite's logits divisor and Gemma 2's soft cap where a family has them), one product with the unembedding back to
the normed stream, and autograd only through the final norm and the (d)-wide translator.

The last layer is not trained: its map is the identity (stage 1 regresses the final stream on itself), where q = p,
KL = 0 and the gradient is exactly zero. After the steps each layer keeps the maps (trained or least squares) with
the lower mean KL on the validation positions, which no step drew: training is kept only where it helped on text it
did not fit, and the report says which layers kept it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import InputError
from engine.norms import family_norm
from engine.progress import tell_units
from engine.weights import as_float

EVAL_CHUNK = 256            # positions per head product when judging: bounds the (chunk, vocab) float32 logits


@dataclass
class LensHead:
    """The model's final norm and unembedding in float32, weights dequantised once (a step reads them 2L times)."""
    cfg: object
    norm_w: torch.Tensor
    norm_b: torch.Tensor | None
    eps: float
    W: torch.Tensor                   # (d, V) float32
    bias: torch.Tensor | None         # (V,)
    divisor: float
    softcap: float | None

    @classmethod
    def of(cls, model) -> "LensHead":
        w, cfg = model.weights, model.config
        return cls(cfg, w.norm.float().cpu(), None if w.norm_bias is None else w.norm_bias.float().cpu(),
                   cfg.rms_norm_eps, as_float(w.lm_head).float().cpu().contiguous(),
                   None if w.head_bias is None else w.head_bias.float().cpu(), float(cfg.logits_divisor),
                   cfg.final_softcap)

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        """(N, d) stream -> the final-normed stream (differentiable)."""
        return family_norm(self.cfg, x, self.norm_w, self.norm_b, self.eps)

    def logits(self, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed (N, d) -> (logits (N, V), d logits / d pre-cap logits (N, V) or a scalar) without autograd."""
        with torch.no_grad():
            z = n @ self.W
            if self.bias is not None:
                z += self.bias
            if self.divisor != 1.0:
                z /= self.divisor
            if self.softcap is None:
                return z, torch.tensor(1.0 / self.divisor)
            z = torch.tanh(z / self.softcap)
            slope = (1 - z * z) / self.divisor
            return z * self.softcap, slope

    def log_probs(self, x: torch.Tensor) -> torch.Tensor:
        """(N, d) stream -> (N, V) log-probabilities, no autograd."""
        with torch.no_grad():
            return torch.log_softmax(self.logits(self.normed(x))[0], dim=-1)


def translate(u: torch.Tensor, v: torch.Tensor, b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """One layer's translator h + (h V) U^T + b (the same map as TunedLens.translate)."""
    return h + (h @ v) @ u.T + b


def balanced(u: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """U, V rescaled column by column to equal norms, U V^T unchanged: Adam's steps are about lr in every entry, so
    a U a thousand times smaller than V (as least squares leaves them) would move a thousand times too fast."""
    s = (v.norm(dim=0) / u.norm(dim=0).clamp_min(1e-12)).sqrt().clamp_min(1e-12)
    return u * s, v / s


def add_kl_grad(head: LensHead, u, v, b, h: torch.Tensor, p: torch.Tensor) -> None:
    """Accumulate into u.grad, v.grad, b.grad the exact gradient of the mean KL(p || lens) over h's positions, p the
    final distribution (B, V). The loss' value is not needed for a step, so it is not computed (two passes over
    (B, V) saved); d KL / d logits = softmax(logits) - p, made in place."""
    with torch.enable_grad():
        n = head.normed(translate(u, v, b, h))                                      # (B, d), autograd from here
    z, slope = head.logits(n.detach())                                              # (B, V)
    grad_z = torch.softmax(z, dim=-1)
    del z
    grad_z.sub_(p).mul_(slope / h.shape[0])
    n.backward(grad_z @ head.W.T)                                                  # (B, d)


def mean_kl(head: LensHead, u, v, b, h: torch.Tensor, final: torch.Tensor) -> float:
    """Mean KL(final's distribution || the layer's lens) over the positions of h and final (N, d) streams."""
    total = 0.0
    for s in range(0, h.shape[0], EVAL_CHUNK):
        p_log = head.log_probs(final[s:s + EVAL_CHUNK])
        with torch.no_grad():
            q_log = head.log_probs(translate(u, v, b, h[s:s + EVAL_CHUNK]))
        total += float((p_log.exp() * (p_log - q_log)).sum(-1).double().sum())
    return total / h.shape[0]


@dataclass
class KLReport:
    """What stage 2 did, per layer: the validation KL of the least-squares maps and of the trained ones, and
    whether the trained ones were kept (the lower of the two)."""
    before: list[float]
    after: list[float]
    kept: list[bool]


def kl_train(head: LensHead, resid: torch.Tensor, maps: tuple[torch.Tensor, torch.Tensor, torch.Tensor], *,
             steps: int, lr: float, batch: int, seed: int, validation: torch.Tensor, on_progress=None,
             done: int = 0, total: int = 0) -> tuple[tuple[torch.Tensor, ...], KLReport]:
    """`steps` Adam steps on every layer but the last, each on `batch` positions drawn (seeded) from the positions
    of resid (L, N, d) not in validation (a (N,) bool mask), the final distribution read from resid[-1]; then each
    layer keeps whichever of its least-squares and trained maps has the lower validation KL. maps: (U, V, b) of
    stage 1, (L, d, r), (L, d, r), (L, d); returns new tensors and the report. on_progress hears each step as a
    unit (done + step of total); a STOP between two steps raises Stopped."""
    L = resid.shape[0]
    train_at = torch.nonzero(~validation).squeeze(1)
    val_at = torch.nonzero(validation).squeeze(1)
    if len(train_at) < 1 or len(val_at) < 1:
        raise InputError(f"KL steps need positions to train on and to validate on; got {len(train_at)} and "
                         f"{len(val_at)}")
    init_u, init_v, init_b = (m.float().clone() for m in maps)
    pairs = [balanced(init_u[i], init_v[i]) for i in range(L - 1)]
    params = [[pu.clone().requires_grad_(), pv.clone().requires_grad_(), init_b[i].clone().requires_grad_()]
              for i, (pu, pv) in enumerate(pairs)]
    opt = torch.optim.Adam([t for layer in params for t in layer], lr=lr)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        tell_units(on_progress, done + step, total, f"KL step {step + 1} of {steps}")
        pick = train_at[torch.randperm(len(train_at), generator=g)[:batch]]
        p = head.log_probs(resid[-1, pick]).exp_()                                 # (B, V), the same for all layers
        opt.zero_grad(set_to_none=False)
        for layer, (u, v, b) in enumerate(params):
            add_kl_grad(head, u, v, b, resid[layer, pick], p)
        opt.step()
    out_u, out_v, out_b = init_u.clone(), init_v.clone(), init_b.clone()
    before, after, kept = [], [], []
    final_val = resid[-1, val_at]
    for layer, (u, v, b) in enumerate(params):
        h = resid[layer, val_at]
        before.append(mean_kl(head, init_u[layer], init_v[layer], init_b[layer], h, final_val))
        after.append(mean_kl(head, u.detach(), v.detach(), b.detach(), h, final_val))
        kept.append(after[-1] < before[-1])
        if kept[-1]:
            out_u[layer], out_v[layer], out_b[layer] = u.detach(), v.detach(), b.detach()
    before.append(0.0), after.append(0.0), kept.append(False)        # the last layer: the identity, untouched
    return (out_u, out_v, out_b), KLReport(before, after, kept)
