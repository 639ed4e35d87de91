"""Why A and not B at one step: direct logit attribution (DLA) and what each sampler stage did to A and B.

DLA: the final residual stream at the step's position is the sum of the embedding, every layer's attention
output and every layer's MLP output. Freezing the final norm's scale at its value for that position makes
the map from the residual stream to logit(A) - logit(B) linear, so the difference splits exactly into those
parts; attention splits further into heads, because attn_out = z.reshape(T, H*hd) @ wo is a sum over heads
of z[:, h] @ wo[rows of head h]. A LayerNorm family (GPT-2, GPT-NeoX, StableLM, Phi) adds terms no head owns:
GPT-2's learned position, each layer's attention output bias, the final norm's bias and Phi's head bias, each a
term of its own (engine.tools.dla). One forward with captures at that one position gives every part.

The step-N convention of a run: the logits at step N come from prompt_ids + token_ids[:N] at the last
position, and token_ids[N] was drawn from them.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

from engine.errors import InputError
from engine.inspection.probe import Probe
from engine.sampling import SamplingParams, sampler_chain
from engine.tools import dla


def _num(x: float) -> float | None:
    """JSON has no NaN or infinity: those become null."""
    return float(x) if math.isfinite(x) else None


def _token(model, tid: int) -> str:
    return model.tokenizer.decode([int(tid)])


# ---- sampler stages ------------------------------------------------------------------------------------
@dataclass
class SamplerEffect:
    """A and B after one sampler stage ('model' = the raw logits), and what the stage changed."""
    stage: str
    value_a: float          # the stage's output for A: a logit (a probability at 'probs'); -inf = removed
    value_b: float
    prob_a: float           # the distribution after this stage (softmax of its logits; 'probs' itself)
    prob_b: float
    rank_a: int             # 1 = highest after this stage
    rank_b: int
    d_diff: float           # change of value_a - value_b made by this stage (NaN at 'probs' or once removed)
    d_prob_a: float
    d_prob_b: float
    order_changed: bool     # A and B swapped places
    removed: str            # what this stage cut (-inf): "", "A", "B" or "A and B"
    changed: bool           # anything about A or B differs from the stage before

    def as_dict(self) -> dict:
        return {k: (_num(v) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def _rank(x: torch.Tensor, i: int) -> int:
    return 1 + int((x > x[i]).sum())


def _effect(name: str, x: torch.Tensor, a: int, b: int, prev: SamplerEffect | None) -> SamplerEffect:
    """A and B in one stage's output x (V,), compared with the stage before."""
    probs = x if name == "probs" else torch.softmax(x, -1)                      # (V,); -inf -> 0
    va, vb, pa, pb = float(x[a]), float(x[b]), float(probs[a]), float(probs[b])
    ra, rb = _rank(x, a), _rank(x, b)
    if prev is None:
        return SamplerEffect(name, va, vb, pa, pb, ra, rb, 0.0, 0.0, 0.0, False, "", False)
    gap, prev_gap = va - vb, prev.value_a - prev.value_b
    # probabilities are not logits, and a removed token has no finite gap: no logit difference to compare
    d = gap - prev_gap if name != "probs" and math.isfinite(gap) and math.isfinite(prev_gap) else float("nan")
    cut = [t for t, v, before in (("A", va, prev.value_a), ("B", vb, prev.value_b))
           if name != "probs" and v == float("-inf") and before != float("-inf")]
    order = (prev.rank_a < prev.rank_b) != (ra < rb) and ra != rb
    changed = bool(order or cut or abs(pa - prev.prob_a) > 1e-9 or abs(pb - prev.prob_b) > 1e-9
                   or (not math.isnan(d) and abs(d) > 1e-6) or (ra, rb) != (prev.rank_a, prev.rank_b))
    return SamplerEffect(name, va, vb, pa, pb, ra, rb, d, pa - prev.prob_a, pb - prev.prob_b, order,
                         " and ".join(cut), changed)


def sampler_effects(logits: torch.Tensor, params: SamplingParams, context: list[int], generated: list[int],
                    a: int, b: int) -> list[SamplerEffect]:
    """Run the engine's sampler chain on fp32 logits (V,) and follow A and B through each stage."""
    stages = sampler_chain(logits.float(), params, context, generated)
    out: list[SamplerEffect] = []
    for name, x in [("model", logits.float())] + [(n.removeprefix("sampler."), t) for n, t in stages.items()]:
        out.append(_effect(name, x, a, b, out[-1] if out else None))
    return out


# ---- direct logit attribution ---------------------------------------------------------------------------
@dataclass
class Explanation:
    ids: list[int]                 # the context the logits came from
    step: int | None               # the run's step (None for a bare context)
    target: int                    # A
    versus: int                    # B
    target_text: str
    versus_text: str
    logit_a: float
    logit_b: float
    logit_diff: float              # logit(A) - logit(B) from the forward's logits
    contributions: dict[str, float]   # embed, blocks.{i}.attn.head.{h}, blocks.{i}.mlp, ...: these sum to `total`
    num_layers: int
    num_heads: int
    norm_scale: float              # the frozen final norm factor 1/sqrt(mean(x^2)+eps) (LayerNorm: var(x)) here
    sampler: list[SamplerEffect] = field(default_factory=list)
    seconds: float = 0.0
    experts: dict[str, float] = field(default_factory=dict)   # blocks.{i}.mlp.expert.{e}: chosen experts' shares
    uncapped_diff: float | None = None   # Gemma 2: the difference before the final soft cap (what the parts sum to)

    @property
    def exactness(self) -> str:
        """Whether the parts sum to the logit difference, and if not by how much and why."""
        if self.uncapped_diff is None:
            return f"exact: the parts sum to the logit difference (rounding {self.residual_error:.1e})"
        return (f"not exact: the final soft cap bends the logits after the sum. The parts sum to the uncapped "
                f"difference {self.uncapped_diff:.4f} (rounding {self.total - self.uncapped_diff:.1e}); the capped "
                f"difference is {self.logit_diff:.4f}, {self.residual_error:+.4f} from the sum")

    @property
    def total(self) -> float:
        return math.fsum(self.contributions.values())

    @property
    def residual_error(self) -> float:
        """Sum of the parts minus the forward's logit difference (fp32 rounding of the forward only)."""
        return self.total - self.logit_diff

    def head(self, layer: int, h: int) -> float:
        return self.contributions[f"blocks.{layer}.attn.head.{h}"]

    def attn(self, layer: int) -> float:
        """The layer's attention output's share: its heads and, where it has one, its output bias."""
        return math.fsum([*(self.head(layer, h) for h in range(self.num_heads)),
                          self.contributions.get(f"blocks.{layer}.attn.bias", 0.0)])

    def mlp(self, layer: int) -> float:
        return self.contributions[f"blocks.{layer}.mlp"]

    @property
    def attn_totals(self) -> dict[str, float]:
        return {f"blocks.{i}.attn": self.attn(i) for i in range(self.num_layers)}

    def as_dict(self) -> dict:
        return {"ids": self.ids, "step": self.step, "position": len(self.ids) - 1,
                "target": {"id": self.target, "text": self.target_text, "logit": self.logit_a},
                "versus": {"id": self.versus, "text": self.versus_text, "logit": self.logit_b},
                "logit_diff": self.logit_diff, "sum": self.total, "residual_error": self.residual_error,
                "norm_scale": self.norm_scale, "contributions": self.contributions, "experts": self.experts,
                "uncapped_diff": self.uncapped_diff, "exactness": self.exactness,
                "attn_totals": self.attn_totals, "sampler": [e.as_dict() for e in self.sampler],
                "seconds": self.seconds}


def runner_up(logits: torch.Tensor, a: int) -> int:
    """The highest-logit token other than A."""
    top = torch.topk(logits, 2).indices.tolist()
    return top[1] if top[0] == a else top[0]


def explain_logits(model, ids: list[int], target: int | None = None, versus: int | None = None, *,
                   params: SamplingParams | None = None, generated: list[int] | None = None,
                   step: int | None = None) -> Explanation:
    """DLA of logit(A) - logit(B) at the last position of ids, and the sampler stages' effects on A and B
    (with the run's params; context = ids, generated = the run's tokens so far). A defaults to the top
    logit, B to the runner-up."""
    cfg, T = model.config, len(ids)
    if T == 0:
        raise InputError("nothing to explain: the context is empty")
    for name, tid in (("target", target), ("versus", versus)):
        if tid is not None and not 0 <= int(tid) < cfg.vocab_size:
            raise InputError(f"{name} token id {tid} is outside the vocabulary [0, {cfg.vocab_size})")
    t0 = time.perf_counter()
    last = cfg.num_layers - 1
    probe = Probe().capture(dla.capture_names(model, last), positions=[T - 1])
    logits = model.forward(torch.tensor(ids), model.new_cache(T), probe, last_only=True)[0].float().cpu()
    a = int(torch.argmax(logits)) if target is None else int(target)
    b = runner_up(logits, a) if versus is None else int(versus)
    if a == b:
        raise InputError("A and B are the same token; pick two different tokens to compare")
    got = {c.name: c.value[-1].to(torch.float64) for c in probe.recording.captures}      # each (...) at position T-1
    direction, scale = dla.direction(model, got[f"blocks.{last}.resid_post"], a, b)
    parts, experts = dla.parts(model, got, direction, T - 1)
    parts |= dla.constants(model, a, b)
    raw = got.get("logits_uncapped")
    effects = sampler_effects(logits, params or SamplingParams(), list(ids), list(generated or []), a, b)
    return Explanation(list(ids), step, a, b, _token(model, a), _token(model, b), float(logits[a]),
                       float(logits[b]), float(logits[a]) - float(logits[b]), parts, cfg.num_layers,
                       cfg.num_heads, scale, effects, time.perf_counter() - t0, experts,
                       None if raw is None else float(raw[a] - raw[b]))


def explain_step(model, prompt_ids: list[int], token_ids: list[int], step: int, *, target: int | None = None,
                 versus: int | None = None, params: SamplingParams | None = None) -> Explanation:
    """Explain step `step` of a run: A defaults to the token chosen there, B to the runner-up."""
    if not 0 <= step < len(token_ids):
        raise InputError(f"step {step} is not in this run: it generated {len(token_ids)} tokens "
                         f"(steps 0 to {len(token_ids) - 1})")
    a = token_ids[step] if target is None else target
    return explain_logits(model, list(prompt_ids) + list(token_ids[:step]), a, versus, params=params,
                          generated=list(token_ids[:step]), step=step)


def single_token(model, text: str, what: str = "target") -> int:
    """The id of a text that is exactly one token (InputError otherwise)."""
    ids = model.tokenizer.encode(text)
    if len(ids) != 1:
        pieces = ", ".join(repr(model.tokenizer.decode([i])) for i in ids) or "none"
        raise InputError(f"the {what} {text!r} is {len(ids)} tokens ({pieces}); give the text of exactly one token")
    return ids[0]
