"""The tuned lens (Belrose et al. 2023, "Eliciting Latent Predictions from Transformers with the Tuned Lens") beside
the logit lens: each layer's residual stream h goes through its own affine translator h + A h + b before the
model's final norm and unembedding, fitted so that what it predicts is close (in KL) to the model's own final
distribution. The logit lens is the same read with A = 0, b = 0.

    lens = fit_tuned_lens(model, texts)                # texts: None reads engine.tools.lens_corpus("train")
    cmp = compare_lenses(model, lens, held_out_texts)  # cmp.logit_kl[i], cmp.tuned_kl[i]: mean nats per layer
    rows = lenses_at(model, ids, pos, lens, k)         # both lenses' top-k at one position, and each layer's KL

The fit, in two named stages, reads residual streams only through the public Probe capture (blocks.{i}.resid_post)
that the logit lens reads:
1. regression: per layer, ridge least squares of the final layer's residual, rescaled per token to the layer's own
   RMS (the final norm ignores scale), on h: r = y - h ~ A h + b; A is then cut to rank `rank` (reduced-rank
   regression in the metric of the unembedding, so the kept directions are those that move logits most).
   Closed form: the whole corpus in one pass of sums, no learning rate.
2. kl_steps: `steps` Adam steps on the mean KL(final || lens) itself over the pooled tokens, from stage 1's maps
   (steps=0 keeps the regression).
Position 0 of every text is left out (its attention-sink activations are hundreds of times any other position's and
would dominate both stages). A is stored low-rank, A = U V^T, so a lens for a 30-layer 576-wide model is a few MB.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.errors import InputError
from engine.inspection.probe import Probe
from engine.norms import family_norm
from engine.progress import LayerProgress, tell_units
from engine.tools.lens_corpus import corpus_facts, docstrings
from engine.weights import as_float

DEFAULT_RANK = 32
DEFAULT_TOKENS = 8192          # fit corpus, in tokens over all texts
TEXT_TOKENS = 256              # one text's forward
RIDGE = 1e-3                   # relative to the mean variance of h: keeps the normal equations well posed
EVAL_TOKENS = 1024


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


def _head_logits(model, x: torch.Tensor) -> torch.Tensor:
    """The final norm and unembedding of model, differentiable (Model.unembed runs in inference mode): (N, d) ->
    (N, V) float32. Same weights and norm; stage 2 only."""
    w = model.weights
    x = x.to(w.norm.device)
    z = family_norm(model.config, x, w.norm.float(), None if w.norm_bias is None else w.norm_bias.float(),
                    model.config.rms_norm_eps)
    out = z @ as_float(w.lm_head).float()
    return (out if w.head_bias is None else out + w.head_bias.float()).cpu()


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


def _kl_steps(model, lens: TunedLens, pooled: list[tuple[torch.Tensor, torch.Tensor]], steps: int, lr: float,
              seed: int, batch: int, on_progress, done: int, total: int) -> None:
    """Stage 2: Adam on mean KL(final || tuned) over random batches of the pooled (resid, final log-probs) tokens,
    every layer each step; updates lens in place."""
    params = [lens.U.requires_grad_(), lens.V.requires_grad_(), lens.b.requires_grad_()]
    opt = torch.optim.Adam(params, lr=lr)
    resid = torch.cat([r for r, _ in pooled], dim=1)                                # (L, N, d)
    final = torch.cat([f for _, f in pooled])                                       # (N, V)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        tell_units(on_progress, done + step, total, f"KL step {step + 1} of {steps}")
        pick = torch.randperm(resid.shape[1], generator=g)[:batch]
        p_log = final[pick]
        opt.zero_grad()
        for layer in range(lens.layers):
            with torch.enable_grad():
                q_log = torch.log_softmax(_head_logits(model, lens.translate(layer, resid[layer, pick])), dim=-1)
                loss = (p_log.exp() * (p_log - q_log)).sum(-1).mean() / lens.layers
                loss.backward()
        opt.step()
    for p in params:
        p.requires_grad_(False)


def fit_tuned_lens(model, texts: Sequence[str] | None = None, *, rank: int = DEFAULT_RANK,
                   max_tokens: int = DEFAULT_TOKENS, ridge: float = RIDGE, steps: int = 0, lr: float = 1e-3,
                   batch: int = 64, seed: int = 0, on_progress=None) -> TunedLens:
    """A tuned lens for model fitted on texts (None: the stdlib docstrings' train split): stage 1 (regression) over
    up to max_tokens tokens, then `steps` KL steps (stage 2). on_progress hears each text's forward and each step as
    a unit (engine.progress.tell_units); a STOP between two raises Stopped (no half lens). With steps, every token's
    streams and final log-probs are held for the steps: (tokens, vocab) float32, 1.6 GB for 8,192 tokens of a
    49,152-token vocabulary; the regression alone holds one text's."""
    L, d = model.config.num_layers, model.config.hidden_size
    if not 1 <= rank <= d:
        raise InputError(f"the tuned lens' rank must be 1..{d} (the model's width); got {rank}")
    if max_tokens < 2 or steps < 0 or batch < 1 or not ridge >= 0:
        raise InputError(f"the tuned lens wants max_tokens >= 2, steps >= 0, batch >= 1, ridge >= 0; got "
                         f"max_tokens={max_tokens}, steps={steps}, batch={batch}, ridge={ridge}")
    split_texts = list(texts) if texts is not None else docstrings("train")
    encoded = _encoded(model, split_texts, max_tokens)
    total = len(encoded) + steps
    sums = [new_sums(d) for _ in range(L)]
    pooled = []
    for k, ids in enumerate(encoded):
        tell_units(on_progress, k, total, f"text {k + 1} of {len(encoded)}")
        resid, final = _resid_streams(model, ids)
        last = resid[-1].double()
        last_rms = last.pow(2).mean(-1, keepdim=True).sqrt()
        for layer in range(L):
            h = resid[layer].double()
            add_sums(sums[layer], h, last * (h.pow(2).mean(-1, keepdim=True).sqrt() / last_rms))  # final at h's scale
        if steps:
            pooled.append((resid, final))
    metric = _output_metric(model)
    parts = [solve_translator(s, metric, rank, ridge) for s in sums]
    lens = TunedLens(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]),
                     torch.stack([p[2] for p in parts]))
    if steps:
        _kl_steps(model, lens, pooled, steps, lr, seed, batch, on_progress, len(encoded), total)
    tell_units(on_progress, total, total, "done")
    facts = corpus_facts("train", split_texts) if texts is None else corpus_facts_of(split_texts)
    lens.recipe = {"method": "tuned-lens/regression+kl", "rank": rank, "tokens": sum(len(i) - 1 for i in encoded),
                   "texts": len(encoded), "ridge": ridge, "steps": steps, "lr": lr, "batch": batch, "seed": seed,
                   **facts}
    return lens


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
