"""Compare two runs of one prompt and seed: different sampler settings, dtype (another load of the model), KV
cache on or off (off = the whole sequence recomputed at every step), or an intervention on a stage. Gives the
token-aligned view, the first step where the tokens differ, and every stage's difference at that step.

The stage differences come from replaying each configuration over the tokens both runs share up to the
divergence step, in its own way (cache on: prefill then one token at a time; off: one full forward),
capturing every stage at the position whose logits chose the diverging token.
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from fnmatch import fnmatchcase
from typing import Callable, Sequence

import pandas as pd
import plotly.graph_objects as go
import torch

from engine import GenerationResult, GenerationRun, InputError, Model, Probe, SamplingParams, Step, scale, zero_heads
from engine.inspection.stages import ATTENTION_MAPS, HEAD_STAGES, forward_stages
from engine.sampling import sampler_chain

TokenText = Callable[[int], str]
DIFF_COLUMNS = ["stage", "layer", "rel_error", "max_abs_diff", "differing", "norm_a", "norm_b"]


@dataclass(frozen=True)
class Intervention:
    """zero_heads: zero some heads of a [T, heads, hd] stage; scale: multiply a stage (glob) by a factor."""
    kind: str                      # "zero_heads" | "scale"
    stage: str                     # e.g. "blocks.3.attn.z", "blocks.*.mlp.act"
    heads: tuple[int, ...] = ()
    factor: float = 1.0

    def describe(self) -> str:
        return (f"zero heads {list(self.heads)} of {self.stage}" if self.kind == "zero_heads"
                else f"scale {self.stage} by {self.factor:g}")

    def apply(self, model: Model, probe: Probe) -> Probe:
        names = [n for n in model.hook_names() if fnmatchcase(n, self.stage)]
        if not names:
            raise InputError(f"no stage matches {self.stage!r}; stages are named like blocks.0.attn.z")
        if self.kind == "scale":
            return probe.replace(self.stage, scale(self.factor))
        if self.kind != "zero_heads":
            raise InputError(f"unknown intervention {self.kind!r} (zero_heads or scale)")
        if not all(n.endswith(HEAD_STAGES) for n in names):
            raise InputError(f"zero_heads needs a per-head stage ({', '.join(HEAD_STAGES)}), got {self.stage!r}")
        cfg = model.config
        n_heads = min(cfg.num_kv_heads if n.endswith(("attn.k", "attn.v", "attn.k_rot")) else cfg.num_heads
                      for n in names)
        if not self.heads or not all(0 <= h < n_heads for h in self.heads):
            raise InputError(f"heads must be in [0, {n_heads}) for {self.stage!r}, got {list(self.heads)}")
        return probe.replace(self.stage, zero_heads(*self.heads))


@dataclass(frozen=True)
class RunConfig:
    label: str = "A"
    _: KW_ONLY
    params: SamplingParams = field(default_factory=SamplingParams)
    dtype: str = "auto"            # which load of the model the page passes in (shown only)
    cache: bool = True
    intervention: Intervention | None = None

    def describe(self) -> str:
        p = ", ".join(f"{k}={v}" for k, v in self.params.changed().items())
        return (f"{self.label}: {p or 'greedy'} · dtype {self.dtype} · cache {'on' if self.cache else 'off'}"
                + (f" · {self.intervention.describe()}" if self.intervention else ""))

    def probe(self, model: Model) -> Probe | None:
        return None if self.intervention is None else self.intervention.apply(model, Probe())


def run_config(model: Model, prompt_ids: Sequence[int], cfg: RunConfig, *, max_new_tokens: int,
               seed: int = 0, on_token: Callable[[Step], object] | None = None) -> GenerationResult:
    """Generate with one configuration: the engine's generation loop (cache off: the whole sequence is
    recomputed at every step), its sampler and seeded draws either way. on_token(step) after each token
    (progress; returning engine.progress.STOP ends the run there)."""
    return GenerationRun(model, [int(i) for i in prompt_ids], params=cfg.params, max_new_tokens=max_new_tokens,
                         seed=seed, use_cache=cfg.cache, probe=cfg.probe(model), on_token=on_token).run()


def seconds(result: GenerationResult) -> float:
    return result.timings["tokenize"] + result.timings["prefill"] + result.timings["decode"]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first step whose tokens differ (a run that ended earlier differs where it ended); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def aligned_table(a: GenerationResult, b: GenerationResult, token_text: TokenText) -> pd.DataFrame:
    """One row per step: each run's token and probability, whether they match, whether the runs diverged."""
    d = first_divergence(a.token_ids, b.token_ids)
    rows = []
    for s in range(max(len(a.token_ids), len(b.token_ids))):
        ta = a.token_ids[s] if s < len(a.token_ids) else None
        tb = b.token_ids[s] if s < len(b.token_ids) else None
        rows.append({"step": s, "id_a": ta, "token_a": None if ta is None else token_text(ta),
                     "id_b": tb, "token_b": None if tb is None else token_text(tb), "same": ta == tb,
                     "diverged": d is not None and s >= d,
                     "prob_a": a.steps[s].prob if ta is not None else None,
                     "prob_b": b.steps[s].prob if tb is not None else None,
                     "model_prob_a": a.steps[s].model_prob if ta is not None else None,
                     "model_prob_b": b.steps[s].model_prob if tb is not None else None})
    return pd.DataFrame(rows, columns=["step", "id_a", "token_a", "id_b", "token_b", "same", "diverged",
                                       "prob_a", "prob_b", "model_prob_a", "model_prob_b"])


def from_divergence(table: pd.DataFrame, divergence: int | None, before: int = 2) -> pd.DataFrame:
    """The aligned table opened at the first divergence: `before` matching steps for context, then the rest (the
    whole table when the runs never diverge or diverge at once). The steps keep their numbers."""
    if divergence is None or divergence <= before:
        return table
    return table[table["step"] >= divergence - before]


def capture_step(model: Model, ids: Sequence[int], n_prompt: int, cfg: RunConfig, *,
                 attention_maps: bool = False) -> dict[str, torch.Tensor]:
    """Replay `ids` (prompt + the shared generated tokens before the step) as cfg would, and return every
    stage at the last position (the one whose logits choose the step's token), sampler stages included.

    attn.scores / attn.pattern are left out unless asked for: asking for them makes the engine leave its
    fused attention path, which would hide exactly the numerical differences a comparison looks for."""
    ids = [int(i) for i in ids]
    if not n_prompt <= len(ids):
        raise InputError(f"need the {n_prompt} prompt ids and the shared tokens, got {len(ids)} ids")
    pos = len(ids) - 1
    names = [n for n in forward_stages(model.config, maps=attention_maps)
             if not n.startswith("logits")]                    # the logits: taken from the forward's output
    probe = Probe().capture(names, positions=[pos])
    if cfg.intervention is not None:
        cfg.intervention.apply(model, probe)
    if cfg.cache:
        cache = model.new_cache(len(ids))
        chunks = [ids[:n_prompt]] + [[t] for t in ids[n_prompt:]]
        for s, chunk in enumerate(chunks):
            probe.step = s
            logits = model.forward(torch.tensor(chunk), cache, probe, last_only=True)[-1].float().cpu()
    else:
        probe.step = len(ids) - n_prompt
        logits = model.logits(ids, probe)[-1]
    out = {}
    for c in probe.recording.captures:
        if c.positions == [pos] and c.name not in out:
            row = c.value[:, 0] if c.name.endswith(ATTENTION_MAPS) else c.value[0]
            out[c.name] = row.float()
    out["logits"] = logits
    out.update(sampler_chain(logits, cfg.params, ids, ids[n_prompt:]))
    return out


def rel_error(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, int]:
    """(||a - b|| / ||a||, max |a - b|, elements that differ); equal infinities and NaN-vs-NaN count as equal."""
    a, b = a.double().flatten(), b.double().flatten()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    d = torch.where(same, 0.0, a - b).abs()
    d = torch.where(torch.isnan(d), float("inf"), d)
    ref = torch.linalg.vector_norm(torch.where(torch.isfinite(a), a, 0.0))
    err = float(torch.linalg.vector_norm(d))
    return (0.0 if err == 0 else err / max(float(ref), 1e-30)), float(d.max()) if d.numel() else 0.0, int((~same).sum())


def stage_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> pd.DataFrame:
    """One row per stage in a's (forward) order: relative error of b against a, max |diff|, how many differ."""
    rows = []
    for name, ta in a.items():
        layer = int(name.split(".")[1]) if name.startswith("blocks.") else None
        tb = b.get(name)
        if tb is None or tb.shape != ta.shape:
            rows.append({"stage": name, "layer": layer, "rel_error": float("nan"), "max_abs_diff": float("nan"),
                         "differing": None, "norm_a": float(ta.double().norm()), "norm_b": float("nan")})
            continue
        err, mx, n = rel_error(ta, tb)
        rows.append({"stage": name, "layer": layer, "rel_error": err, "max_abs_diff": mx, "differing": n,
                     "norm_a": float(torch.where(torch.isfinite(ta), ta, 0).double().norm()),
                     "norm_b": float(torch.where(torch.isfinite(tb), tb, 0).double().norm())})
    return pd.DataFrame(rows, columns=DIFF_COLUMNS)


def first_differing_stage(diff: pd.DataFrame, tol: float = 1e-6) -> str | None:
    """The first stage (forward order) whose relative error exceeds tol."""
    hit = diff[(diff["rel_error"] > tol) | diff["rel_error"].isna()]
    return None if hit.empty else str(hit["stage"].iloc[0])


def divergence_stages(model_a: Model, cfg_a: RunConfig, model_b: Model, cfg_b: RunConfig, prompt_ids: Sequence[int],
                      shared: Sequence[int], step: int, **kw) -> pd.DataFrame:
    """Stage differences at `step`: both configurations replayed over prompt + the first `step` shared tokens."""
    if step > len(shared):
        raise InputError(f"step {step} is past the {len(shared)} tokens both runs share")
    ids = list(prompt_ids) + list(shared[:step])
    return stage_differences(capture_step(model_a, ids, len(prompt_ids), cfg_a, **kw),
                             capture_step(model_b, ids, len(prompt_ids), cfg_b, **kw))


def tokens_figure(table: pd.DataFrame) -> go.Figure:
    """Each run's chosen token under the model's own distribution (the raw softmax) per step; the sampling
    probability in the hover. A greedy run's sampling probability is 1 at every step (its distribution is
    one-hot), so only the model's probability tells how sure the model was. The divergence step marked."""
    fig = go.Figure([go.Scatter(x=table["step"], y=table[f"model_prob_{k}"], mode="lines+markers",
                                name=f"run {k.upper()}", customdata=table[f"prob_{k}"],
                                hovertemplate="step %{x}<br>model p %{y:.4f}<br>sampling p %{customdata:.4f}"
                                              "<extra></extra>")
                     for k in ("a", "b")])
    div = table.loc[table["diverged"], "step"]
    if len(div):
        fig.add_vline(x=int(div.iloc[0]), line_dash="dash", line_color="#e4572e",
                      annotation_text=f"first divergence: step {int(div.iloc[0])}")
    fig.update_layout(xaxis_title="step", yaxis_title="model's probability of the chosen token",
                      yaxis_range=[0, 1.05], height=320, margin=dict(t=30, b=40))
    return fig


def differences_figure(diff: pd.DataFrame) -> go.Figure:
    """Relative error of every stage in forward order (log scale; exact zeros drawn at the floor)."""
    floor = 1e-12
    y = diff["rel_error"].clip(lower=floor).fillna(1.0)
    fig = go.Figure(go.Bar(x=diff["stage"], y=y, marker_color=["#e4572e" if v > 1e-6 else "#6c8ebf" for v in y],
                           customdata=diff["max_abs_diff"],
                           hovertemplate="%{x}<br>rel. error %{y:.3g}<br>max |diff| %{customdata:.3g}<extra></extra>"))
    fig.update_layout(yaxis_type="log", yaxis_title="relative error ||b - a|| / ||a||", height=380,
                      margin=dict(t=30, b=120), xaxis_tickangle=-60)
    return fig
