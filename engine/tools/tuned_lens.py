"""The tuned lens (Belrose et al. 2023, "Eliciting Latent Predictions from Transformers with the Tuned Lens") beside
the logit lens: each layer's residual stream h goes through its own affine translator h + A h + b before the
model's final norm and unembedding, fitted so that what it predicts is close (in KL) to the model's own final
distribution. The logit lens is the same read with A = 0, b = 0.

    lens = fit_tuned_lens(model, texts)                # texts: None reads engine.tools.lens_corpus("train")
    cmp = compare_lenses(model, lens, held_out_texts)  # cmp.logit_kl[i], cmp.tuned_kl[i]: mean nats per layer
    rows = lenses_at(model, ids, pos, lens, k)         # both lenses' top-k at one position, and each layer's KL

The fit, in two named stages (fit_stages returns both stages' lenses), reads residual streams only through the
public Probe capture (blocks.{i}.resid_post) that the logit lens reads:
1. least squares: per layer, ridge least squares of the final layer's residual, rescaled per token to the layer's
   own RMS (the final norm ignores scale), on h: r = y - h ~ A h + b; A is then cut to rank `rank` (reduced-rank
   regression in the metric of the unembedding, so the kept directions are those that move logits most).
   Closed form: the whole corpus in one pass of sums, no learning rate. It minimises squared error in the stream,
   not the KL: the final norm and the softmax make the two differ.
2. KL steps (engine.tools.lens_kl): `steps` Adam steps on the exact mean KL(final || lens) from stage 1's maps,
   `batch` positions drawn per step, every layer on its own loss; each layer then keeps whichever maps have the lower
   KL on the validation texts (every VALIDATION_EVERY-th), which no step drew. steps=0 keeps least squares.
Position 0 of every text is left out (its attention-sink activations are hundreds of times any other position's and
would dominate both stages). A is stored low-rank, A = U V^T, so a lens for a 30-layer 576-wide model is a few MB.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.errors import InputError
from engine.inspection.probe import Probe
from engine.memory import check_work_fits
from engine.progress import LayerProgress, tell_units
from engine.tools.lens_corpus import corpus_facts, docstrings
from engine.quant_matrix import QuantMatrix
from engine.tools.lens_kl import KLReport, LensHead, kl_train
from engine.weights import as_float

DEFAULT_RANK = 32
DEFAULT_TOKENS = 8192          # fit corpus, in tokens over all texts
TEXT_TOKENS = 256              # one text's forward
RIDGE = 1e-3                   # relative to the mean variance of h: keeps the normal equations well posed
EVAL_TOKENS = 1024
LR = 1e-3                      # Adam's step on U, V (balanced, see lens_kl.balanced) and b
BATCH = 128                    # positions per KL step: each costs 4 d V flops a layer (forward and backward)
VALIDATION_EVERY = 8           # every 8th fit text judges stage 2 per layer; no step draws it
ON_DEMAND_STEPS = 20           # the on-demand fit's KL steps (python -m engine lens --fit, the Activations page)
ON_DEMAND_FLOPS = 5e12         # ... fewer for a wide model: at the ~20 GFLOP/s two shared cores give, about 4 min


@dataclass
class TunedLens:
    """One translator per layer: translate(i, h) = h + (h @ V[i]) @ U[i].T + b[i]."""
    U: torch.Tensor                       # (L, d, rank) float32
    V: torch.Tensor                       # (L, d, rank)
    b: torch.Tensor                       # (L, d)
    recipe: dict = field(default_factory=dict)
    weights_checksum: str = ""

    @property
    def layers(self) -> int:
        return int(self.b.shape[0])

    @property
    def rank(self) -> int:
        return int(self.U.shape[2])

    def translate(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """(..., d) residual stream of blocks.{layer}.resid_post -> the translated stream (float32)."""
        h = h.float()
        return h + (h @ self.V[layer]) @ self.U[layer].T + self.b[layer]

    def identity_distance(self, layer: int) -> float:
        """||A||_F / sqrt(d) and ||b|| / sqrt(d) in one number (their max): 0 for the identity map."""
        a = (self.U[layer] @ self.V[layer].T).norm().item()
        d = self.b.shape[1]
        return max(a / d ** 0.5, self.b[layer].norm().item() / d ** 0.5)


def _resid_streams(model, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over ids -> (every layer's resid_post (L, T-1, d) float32, final log-probs (T-1, V)), position 0
    left out."""
    probe = Probe().capture("blocks.*.resid_post")
    t = torch.as_tensor([int(i) for i in ids], dtype=torch.long)
    logits = model.forward(t, model.new_cache(len(t)), probe)
    caps = sorted((c for c in probe.recording.captures if c.name.endswith(".resid_post")), key=lambda c: c.layer)
    if len(caps) != model.config.num_layers:
        raise InputError(f"the tuned lens reads every layer's resid_post; the probe captured {len(caps)} of "
                         f"{model.config.num_layers}")
    resid = torch.stack([c.value.float().cpu() for c in caps])[:, 1:]
    return resid, torch.log_softmax(logits.float().cpu()[1:], dim=-1)


def _encoded(model, texts: Sequence[str], max_tokens: int) -> list[list[int]]:
    out, used = [], 0
    for text in texts:
        ids = model.tokenizer.encode(text)[:TEXT_TOKENS]
        if len(ids) < 2 or used >= max_tokens:
            continue
        ids = ids[:max_tokens - used + 1]
        out.append(ids)
        used += len(ids) - 1
    if not out:
        raise InputError("the tuned lens needs at least one text of two or more tokens")
    return out


def _output_metric(model) -> torch.Tensor:
    """(d, d) how much a change of the normed stream moves the logits: diag(g) W W^T diag(g) / V, g the final norm's
    weight, W the (d, V) unembedding (dequantised when kept quantised); W W^T in float32 on the model's device (one
    (d, d) product), the rest in float64; a small multiple of I keeps it invertible."""
    w = model.weights
    head = as_float(w.lm_head).float()
    g = w.norm.double().cpu()
    ww = (head @ head.T).double().cpu()
    m = (g[:, None] * ww * g[None, :]) / head.shape[1]
    return m + 1e-6 * torch.trace(m) / m.shape[0] * torch.eye(m.shape[0], dtype=m.dtype)


def _sqrt_and_inverse(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    evals, evecs = torch.linalg.eigh(m)
    evals = evals.clamp_min(evals.max() * 1e-12)
    return (evecs * evals.sqrt()) @ evecs.T, (evecs / evals.sqrt()) @ evecs.T


def new_sums(d: int) -> dict:
    """Empty running sums of stage 1 for streams of width d."""
    z = torch.zeros
    return {"n": 0, "h": z(d, dtype=torch.float64), "r": z(d, dtype=torch.float64),
            "hh": z(d, d, dtype=torch.float64), "hr": z(d, d, dtype=torch.float64)}


def add_sums(sums: dict, h: torch.Tensor, y: torch.Tensor) -> None:
    """Add tokens (N, d) of input stream h and target stream y to sums (of h, r = y - h, h h^T, h r^T)."""
    h, r = h.double(), y.double() - h.double()
    sums["n"] += h.shape[0]
    sums["h"] += h.sum(0)
    sums["r"] += r.sum(0)
    sums["hh"] += h.T @ h
    sums["hr"] += h.T @ r


def solve_translator(sums: dict, metric: torch.Tensor, rank: int, ridge: float) -> tuple[torch.Tensor, ...]:
    """Stage 1 for one layer: the affine y ~ h + A h + b of least squares (ridge relative to h's mean variance),
    A cut to `rank` by reduced-rank regression in the (d, d) metric -> (U (d, rank), V (d, rank), b (d,)) float32,
    A = U V^T. A true map of rank <= `rank` is recovered whatever the metric."""
    n = sums["n"]
    if n < 2:
        raise InputError(f"a translator needs two or more tokens; got {n}")
    mh, mr = sums["h"] / n, sums["r"] / n
    sxx = sums["hh"] / n - torch.outer(mh, mh)
    sxr = sums["hr"] / n - torch.outer(mh, mr)
    d = sxx.shape[0]
    lam = ridge * torch.trace(sxx) / d
    coef = torch.linalg.solve(sxx + lam * torch.eye(d, dtype=sxx.dtype), sxr)      # (d, d): r ~ h @ coef
    a = coef.T                                                                      # r ~ A h
    root, inv_root = _sqrt_and_inverse(metric.double())
    fitted = root @ a @ sxx @ a.T @ root                                           # fitted values' covariance
    _, q = torch.linalg.eigh(fitted)
    q = q[:, -rank:]                                                                # the rank strongest directions
    u = inv_root @ q                                                                # A_r = U V^T = G^-1/2 Q Q^T G^1/2 A
    v = a.T @ root @ q
    b = mr - (u @ (v.T @ mh))
    return u.float(), v.float(), b.float()


@dataclass
class LensFit:
    """Both stages' lenses of one fit (the least-squares lens is stage 2's starting point) and what stage 2 did."""
    least_squares: TunedLens
    lens: TunedLens
    kl: KLReport | None               # None: no KL steps were taken


def default_steps(model, batch: int = BATCH) -> int:
    """The on-demand fit's KL steps: ON_DEMAND_STEPS, fewer where a step's head products (forward and backward over
    the vocabulary, batch positions, every layer but the last) would take the fit past ON_DEMAND_FLOPS."""
    cfg = model.config
    per_step = 4 * batch * cfg.hidden_size * cfg.vocab_size * max(cfg.num_layers - 1, 1)
    return int(min(ON_DEMAND_STEPS, ON_DEMAND_FLOPS // per_step))


def fit_stages(model, texts: Sequence[str] | None = None, *, rank: int = DEFAULT_RANK,
               max_tokens: int = DEFAULT_TOKENS, ridge: float = RIDGE, steps: int | None = None, lr: float = LR,
               batch: int = BATCH, seed: int = 0, on_progress=None) -> LensFit:
    """A tuned lens for model fitted on texts (None: the stdlib docstrings' train split): stage 1 (least squares)
    over up to max_tokens tokens, then `steps` Adam steps on the KL (stage 2, engine.tools.lens_kl; None: the
    on-demand default, default_steps). Every VALIDATION_EVERY-th text is stage 2's validation, which no step draws.
    on_progress hears each text's forward and each step as a unit (engine.progress.tell_units); a STOP between two
    raises Stopped (no half lens). With steps, every layer's stream at every token is held: (L, tokens, d) float32,
    283 MB for 30 layers of width 576 at 4,096 tokens; least squares alone holds one text's."""
    L, d = model.config.num_layers, model.config.hidden_size
    steps = default_steps(model, batch) if steps is None else steps
    if not 1 <= rank <= d:
        raise InputError(f"the tuned lens' rank must be 1..{d} (the model's width); got {rank}")
    if max_tokens < 2 or steps < 0 or batch < 1 or not ridge >= 0 or not lr > 0:
        raise InputError(f"the tuned lens wants max_tokens >= 2, steps >= 0, batch >= 1, ridge >= 0, lr > 0; got "
                         f"max_tokens={max_tokens}, steps={steps}, batch={batch}, ridge={ridge}, lr={lr}")
    # stage 1's float64 sums of every layer (h, r, h h^T, h r^T), the streams stage 2 trains on, the unembedding's
    # float32 values where it is kept quantised: allocated before the first forward (an 8B model's sums: 8.6 GB)
    head = model.weights.lm_head
    check_work_fits(L * (2 * d * d + 2 * d) * 8 + (L * max_tokens * d * 4 if steps else 0)
                    + (4 * math.prod(head.shape) if isinstance(head, QuantMatrix) else 0), "the tuned lens fit",
                    f"{L} layers' float64 sums of width {d}" + (f", {max_tokens:,} tokens of streams" if steps else ""))
    split_texts = list(texts) if texts is not None else docstrings("train")
    encoded = _encoded(model, split_texts, max_tokens)
    if steps and len(encoded) < 2:
        steps = 0                 # one text cannot be split into positions to train on and positions to judge by
    total = len(encoded) + steps
    judged = set(range(VALIDATION_EVERY - 1, len(encoded), VALIDATION_EVERY)) or {len(encoded) - 1}
    sums = [new_sums(d) for _ in range(L)]
    pooled, validation = [], []
    for k, ids in enumerate(encoded):
        tell_units(on_progress, k, total, f"text {k + 1} of {len(encoded)}")
        resid, _ = _resid_streams(model, ids)
        last = resid[-1].double()
        last_rms = last.pow(2).mean(-1, keepdim=True).sqrt()
        for layer in range(L):
            h = resid[layer].double()
            add_sums(sums[layer], h, last * (h.pow(2).mean(-1, keepdim=True).sqrt() / last_rms))  # final at h's scale
        if steps:
            pooled.append(resid)
            validation.append(torch.full((resid.shape[1],), k in judged))
    metric = _output_metric(model)
    parts = [solve_translator(s, metric, rank, ridge) for s in sums]
    ls = TunedLens(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]),
                   torch.stack([p[2] for p in parts]))
    report = None
    maps = (ls.U, ls.V, ls.b)
    if steps:
        maps, report = kl_train(LensHead.of(model), torch.cat(pooled, dim=1), maps, steps=steps, lr=lr, batch=batch,
                                seed=seed, validation=torch.cat(validation), on_progress=on_progress,
                                done=len(encoded), total=total)
        del pooled
    tell_units(on_progress, total, total, "done")
    facts = corpus_facts("train", split_texts) if texts is None else corpus_facts_of(split_texts)
    tokens = sum(len(i) - 1 for i in encoded)
    base = {"rank": rank, "tokens": tokens, "texts": len(encoded), "ridge": ridge, "seed": seed, **facts}
    ls.recipe = {**base, "method": f"tuned-lens/least-squares (ridge {ridge}, rank {rank}); no KL steps",
                 "steps": 0, "lr": 0.0, "batch": 0, "validation_every": 0, "kl_layers": []}
    if report is None:
        return LensFit(ls, TunedLens(ls.U.clone(), ls.V.clone(), ls.b.clone(), dict(ls.recipe)), None)
    kl_layers = [i for i, k in enumerate(report.kept) if k]
    method = (f"tuned-lens/least squares (ridge {ridge}, rank {rank}) init, then {steps} Adam steps on the mean "
              f"KL(final || lens), lr {lr}, {batch} positions per step (exact KL over the whole vocabulary), seed "
              f"{seed}; each layer keeps the maps with the lower KL on every {VALIDATION_EVERY}th text (held from "
              f"the steps): trained at {len(kl_layers)} of {L - 1} layers, the last layer the identity")
    lens = TunedLens(*maps, recipe={**base, "method": method, "steps": steps, "lr": lr, "batch": batch,
                                    "validation_every": VALIDATION_EVERY, "kl_layers": kl_layers})
    return LensFit(ls, lens, report)


def fit_tuned_lens(model, texts: Sequence[str] | None = None, **kwargs) -> TunedLens:
    """The tuned lens of fit_stages (same arguments): least squares, then KL steps."""
    return fit_stages(model, texts, **kwargs).lens


def corpus_facts_of(texts: Sequence[str]) -> dict:
    """The recipe's corpus fields for texts a caller supplied (not a named split)."""
    facts = corpus_facts("train", list(texts))
    return {**facts, "corpus": "caller-supplied texts", "modules": []}


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    return (p_log.exp() * (p_log - q_log)).sum(-1)


@dataclass
class LensComparison:
    logit_kl: list[float]             # per layer: mean nats of KL(final || logit lens) over the tokens
    tuned_kl: list[float]             # the same for the tuned lens
    tokens: int

    def as_dict(self) -> dict:
        return {"layers": len(self.logit_kl), "tokens": self.tokens,
                "kl": [{"layer": i, "logit_lens": a, "tuned_lens": b}
                       for i, (a, b) in enumerate(zip(self.logit_kl, self.tuned_kl))]}


def compare_lenses(model, lens: TunedLens, texts: Sequence[str] | None = None, *, max_tokens: int = EVAL_TOKENS,
                   on_progress=None) -> LensComparison:
    """Each layer's mean KL(final || lens) of the logit lens and the tuned lens over texts (None: the held-out
    split, which the fit never saw), position 0 of each text left out."""
    encoded = _encoded(model, list(texts) if texts is not None else docstrings("heldout"), max_tokens)
    L = model.config.num_layers
    logit, tuned, n = torch.zeros(L, dtype=torch.float64), torch.zeros(L, dtype=torch.float64), 0
    for k, ids in enumerate(encoded):
        tell_units(on_progress, k, len(encoded), f"held-out text {k + 1} of {len(encoded)}")
        resid, final = _resid_streams(model, ids)
        for layer in range(L):
            logit[layer] += _kl(final, torch.log_softmax(model.unembed(resid[layer]), -1)).double().sum()
            tuned[layer] += _kl(final, torch.log_softmax(model.unembed(lens.translate(layer, resid[layer])),
                                                         -1)).double().sum()
        n += final.shape[0]
    tell_units(on_progress, len(encoded), len(encoded), "done")
    return LensComparison((logit / n).tolist(), (tuned / n).tolist(), n)


def lenses_at(model, ids: Sequence[int], pos: int, lens: TunedLens, k: int = 10, *,
              on_progress=None) -> tuple[list[dict], list[dict]]:
    """Both lenses read at one position of ids: (top rows: {lens, layer, rank, id, token, prob} for k tokens per
    layer and lens; kl rows: {layer, logit_lens, tuned_lens} each layer's KL to the model's final distribution at
    that position). One forward of ids[:pos+1]; on_progress hears each block finish (engine.progress)."""
    if not 0 <= pos < len(ids):
        raise InputError(f"position {pos} is outside 0..{len(ids) - 1}")
    probe = Probe().capture("blocks.*.resid_post", positions=[pos])
    t = torch.as_tensor([int(i) for i in ids[:pos + 1]], dtype=torch.long)
    tell = LayerProgress(on_progress, len(t), model.config.num_layers)
    model.forward(t, model.new_cache(len(t)), probe, last_only=True, on_layer=tell.on_layer(0, len(t)))
    tell.chunk_done(0, len(t))
    caps = sorted((c for c in probe.recording.captures if c.name.endswith(".resid_post")), key=lambda c: c.layer)
    resid = torch.cat([c.value.float().cpu() for c in caps])                       # (L, d)
    reads = {"logit lens": torch.log_softmax(model.unembed(resid), -1),
             "tuned lens": torch.log_softmax(model.unembed(torch.stack(
                 [lens.translate(i, resid[i]) for i in range(len(caps))])), -1)}
    final = reads["logit lens"][-1]                       # the last layer's logit lens is the model's own output
    top_rows, kl_rows = [], []
    for name, logp in reads.items():
        top = torch.topk(logp, k, dim=-1)
        for layer, (vals, idx) in enumerate(zip(top.values.exp(), top.indices)):
            top_rows += [{"lens": name, "layer": layer, "rank": r, "id": int(i),
                          "token": model.tokenizer.decode([int(i)]), "prob": float(p)}
                         for r, (p, i) in enumerate(zip(vals, idx))]
    logit_kl, tuned_kl = _kl(final, reads["logit lens"]), _kl(final, reads["tuned lens"])
    kl_rows = [{"layer": i, "logit_lens": float(a), "tuned_lens": float(b)} for i, (a, b) in
               enumerate(zip(logit_kl, tuned_kl))]
    return top_rows, kl_rows
