"""The sampler, replayed from a run's captured logits: several settings side by side, the chain stage by
stage, and an empirical check of the draws. Nothing here runs the model (display-only by construction).
"""
from __future__ import annotations

import math
import time
from typing import Callable

import pandas as pd
import plotly.graph_objects as go
import torch

from engine.inspection.stages import SAMPLER_STAGES
from engine.sampling import SamplingParams, sampler_chain

TokenText = Callable[[int], str]
STAGES = SAMPLER_STAGES          # the chain's stages, in order (engine.inspection.stages)
KEPT, CUT, CHOSEN = "#3b6fb6", "#c7d2e0", "#e4572e"
# The sampling page's settings B, C, D, E (A is the run's own); also what the benchmark compares.
PRESETS = (dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_k=40, min_p=0.05),
           dict(temperature=1.5, top_p=0.95), dict(temperature=0.3))


def step_logits(recording, step: int) -> torch.Tensor:
    """The logits the run sampled from at a step: (V,) float32, from its recording's 'logits' captures."""
    caps = recording.captured("logits", step=step)
    if not caps:
        raise KeyError(f"no logits captured at step {step}")
    return caps[0].value[-1].float()


def step_context(result, step: int) -> tuple[list[int], list[int]]:
    """(context, generated) as the sampler saw them at a step: prompt + tokens before it, tokens before it."""
    generated = list(result.token_ids[:step])
    return list(result.prompt_ids) + generated, generated


def describe(p: SamplingParams) -> str:
    parts = ["greedy" if p.temperature == 0 else f"T={p.temperature:g}"]
    parts += [f"{name}={v:g}" for name, v, off in (("top-k", p.top_k, 0), ("top-p", p.top_p, 1.0),
              ("min-p", p.min_p, 0.0), ("rep", p.repetition_penalty, 1.0), ("freq", p.frequency_penalty, 0.0),
              ("pres", p.presence_penalty, 0.0), ("no-repeat", p.no_repeat_ngram, 0)) if v != off]
    return " ".join(parts)


def kept_count(probs: torch.Tensor) -> int:
    return int((probs > 0).sum())


TINY = 1e-30                # a probability no number of draws in a lesson (or a lifetime) would ever hit


def tiny_count(probs: torch.Tensor) -> int:
    """Tokens counted as kept (p > 0) whose probability is below TINY."""
    return int(((probs > 0) & (probs < TINY)).sum())


def chains(logits: torch.Tensor, settings: dict[str, SamplingParams], context: list[int],
           generated: list[int]) -> dict[str, dict[str, torch.Tensor]]:
    """engine.sampling.sampler_chain for each setting: {label: {stage: tensor}}."""
    return {label: sampler_chain(logits, p, context, generated) for label, p in settings.items()}


def entropy_nats(probs: torch.Tensor) -> float:
    """Shannon entropy in nats, 0 · log 0 = 0 (engine.sampling.entropy's value, in one fused op)."""
    return float(torch.special.entr(probs).sum())


def compare(logits: torch.Tensor, settings: dict[str, SamplingParams], context: list[int], generated: list[int],
            token_text: TokenText, top_n: int = 20, chosen: int | None = None,
            stages: dict[str, dict[str, torch.Tensor]] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Each setting's distribution over its top_n tokens, and one summary row per setting.

    Tokens are ranked by the logits after penalties and temperature (the order top-k, top-p and min-p cut
    in), so what a setting keeps is a prefix of its ranking. `before` is the probability before the
    truncating stages, `prob` the final sampling probability (0 for cut tokens). `stages` may pass
    chains() already computed for these settings."""
    stages = stages or chains(logits, settings, context, generated)
    tokens, summary = [], []
    for label, params in settings.items():
        probs, scaled = stages[label]["sampler.probs"], stages[label]["sampler.temperature"]
        before = torch.softmax(scaled, dim=-1)
        keep = probs > 0
        top = torch.topk(scaled, min(top_n, scaled.shape[-1])).indices.tolist()
        b, p = before[top].tolist(), probs[top].tolist()
        for rank, i in enumerate(top):
            tokens.append((label, rank + 1, i, token_text(i), b[rank], p[rank], p[rank] > 0, i == chosen))
        summary.append((label, describe(params), int(keep.sum()), tiny_count(probs), entropy_nats(probs),
                        entropy_nats(before), float(before[keep].sum()),
                        None if chosen is None else float(probs[chosen])))
    tok = pd.DataFrame(tokens, columns=["setting", "rank", "token_id", "token", "before", "prob", "kept", "chosen"])
    summ = pd.DataFrame(summary, columns=["setting", "params", "kept", "kept_tiny", "entropy", "entropy_before",
                                          "mass_kept", "chosen_prob"])
    return tok, summ


PROJECTOR_TOKENS = 10      # tokens per panel on a projector: ten horizontal 18-px labels fit one row
PROJECTOR_ROW, PROJECTOR_GAP = 260, 110      # px of a panel, and between panels (ticks, then the next title)


def _label(rank: int, text: str, projector: bool) -> str:
    """A token's x label: "3. ' the'" cut to 16 characters, or on a projector the rank over the token, each
    short enough to stand horizontally in the projector's type ("3." over "' the'", at most 8 characters)."""
    if not projector:
        return f"{rank}. {text!r}"[:16]
    t = repr(text)
    return f"{rank}.<br>{t if len(t) <= 8 else t[:7] + '…'}"


def _panels(n: int, projector: bool) -> tuple[dict, list[tuple[list[float], list[float]]]]:
    """The figure's layout and each panel's (x domain, y domain): side by side, or on a projector one per row
    (full width, one below another) with room for two-line labels and the next panel's title between rows."""
    if not projector:
        gap = 0.03
        width = (1 - gap * (n - 1)) / n
        return (dict(height=460, margin=dict(t=50, b=120), legend=dict(orientation="h", y=-0.5), barmode="overlay"),
                [([c * (width + gap), c * (width + gap) + width], [0.0, 1.0]) for c in range(n)])
    total = n * PROJECTOR_ROW + (n - 1) * PROJECTOR_GAP
    row, gap = PROJECTOR_ROW / total, PROJECTOR_GAP / total
    return (dict(height=total + 190, margin=dict(t=150, b=40), barmode="overlay",
                 legend=dict(orientation="h", x=0, y=1 + 45 / total, yanchor="bottom")),
            [([0.0, 1.0], [1 - c * (row + gap) - row, 1 - c * (row + gap)]) for c in range(n)])


def compare_figure(tokens: pd.DataFrame, summary: pd.DataFrame, projector: bool = False) -> go.Figure:
    """One panel per setting: bars of each token's probability before truncation (blue kept, grey cut, red
    the token the run chose), the final probability as dots, a dashed line where the kept set ends. Each
    colour is its own trace, so the legend names the colour it shows. projector: the panels one per row, at
    most PROJECTOR_TOKENS tokens each, labelled horizontally (a label of the projector's size at 45° in a
    third of the width was unreadable).

    Built in one go.Figure call: make_subplots + add_trace + add_vline validate the figure again at every
    step and cost ~8x more, which matters for a page redrawn at every slider move."""
    labels = list(summary["setting"])
    layout, domains = _panels(len(labels), projector)
    data, shapes, notes = [], [], []
    parts = (("kept (probability before the cut)", KEPT), ("cut by top-k / top-p / min-p", CUT),
             ("the run's token", CHOSEN))
    shown: set[int] = set()          # each legend entry once, from the first panel that has such bars
    for c, (label, kept, h) in enumerate(zip(labels, summary["kept"], summary["entropy"])):
        ax = "" if c == 0 else str(c + 1)
        d = tokens[tokens["setting"] == label]
        d = d[d["rank"] <= PROJECTOR_TOKENS] if projector else d
        x = [_label(r, t, projector) for r, t in zip(d["rank"], d["token"])]
        kind = [2 if ch else (0 if k else 1) for ch, k in zip(d["chosen"], d["kept"])]
        before, ids = d["before"].tolist(), d["token_id"].tolist()
        for j, (name, colour) in enumerate(parts):
            sel = [i for i, k in enumerate(kind) if k == j]
            first = bool(sel) and j not in shown
            shown.update([j] if sel else [])
            data.append(go.Bar(x=[x[i] for i in sel], y=[before[i] for i in sel], marker_color=colour, name=name,
                               legendgroup=name, showlegend=first, customdata=[ids[i] for i in sel],
                               xaxis="x" + ax, yaxis="y" + ax,
                               hovertemplate="%{x}<br>id %{customdata}<br>p before cut %{y:.4f}<extra></extra>"))
        data.append(go.Scatter(x=x, y=d["prob"].tolist(), mode="markers", marker=dict(color="black", size=7),
                               name="final sampling probability", legendgroup="final", showlegend=c == 0,
                               xaxis="x" + ax, yaxis="y" + ax, hovertemplate="%{x}<br>p %{y:.4f}<extra></extra>"))
        (x0, x1), (y0, y1) = domains[c]
        layout["xaxis" + ax] = dict(domain=[x0, x1], anchor="y" + ax, tickangle=0 if projector else -60,
                                    categoryorder="array", categoryarray=x)
        layout["yaxis" + ax] = dict(domain=[y0, y1], anchor="x" + ax, **(
            {"title": "probability"} if c == 0 else {"matches": "y", "showticklabels": projector}))
        notes.append(dict(text=f"{label}: kept {int(kept):,}, H={h:.2f}", x=(x0 + x1) / 2, y=y1, xref="paper",
                          yref="paper", xanchor="center", yanchor="bottom", showarrow=False))
        n_kept = int(d["kept"].sum())
        if 0 < n_kept < len(d):   # the cut falls inside the shown tokens
            shapes.append(dict(type="line", x0=n_kept - 0.5, x1=n_kept - 0.5, y0=0, y1=1, xref="x" + ax,
                               yref=f"y{ax} domain", line=dict(dash="dash", color=CHOSEN)))
    return go.Figure(data=data, layout=dict(layout, shapes=shapes, annotations=notes))


def _tokens(n: int) -> str:
    return f"{n:,} token" + ("" if n == 1 else "s")


def unfiltered(p: SamplingParams) -> bool:
    """A sampled setting with no top-k, top-p or min-p: nothing is cut, whatever its temperature."""
    return p.temperature > 0 and p.top_k == 0 and p.top_p >= 1 and p.min_p == 0


def underflow_note(probs: torch.Tensor) -> str:
    """Why a setting without a filter "keeps" nearly the whole vocabulary: kept means p > 0 in float32, and
    a low temperature leaves most tokens with probabilities far below anything a draw can hit, while those
    below float32's smallest number (about 1e-45) become exactly 0, the only ones not counted."""
    kept, tiny, zero = kept_count(probs), tiny_count(probs), int((probs == 0).sum())
    ranked = torch.sort(probs.double(), descending=True).values
    core = min(int(torch.searchsorted(torch.cumsum(ranked, 0), torch.tensor(0.999, dtype=torch.float64))) + 1,
               kept)
    mass = float(probs[(probs > 0) & (probs < TINY)].double().sum())
    note = (f"No top-k, top-p or min-p here, so nothing is cut: *kept* counts every token whose probability is above "
            f"0. 99.9 % of the probability is on the top {_tokens(core)}; of the {kept:,} kept, {tiny:,} "
            f"{'has' if tiny == 1 else 'have'} p below 1e-30")
    note += f" (together {mass:.1e}: never drawn in practice)" if tiny else ""
    if zero:
        note += (f", and {_tokens(zero)} underflowed to exactly 0 in float32 (below about 1e-45): the only "
                 "ones not counted")
    return note + "."


def chain_notes(settings: dict[str, SamplingParams], stages: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    """The chain order, with this step's numbers: per setting, the top token's probability after temperature,
    how many tokens top-p needs to reach its mass, and how many survive; then every pair where a setting with
    a smaller top-p keeps more tokens than another because its temperature is higher (temperature comes
    first: it flattens the distribution that top-p then cuts)."""
    lines, kept = [], {}
    for label, p in settings.items():
        probs_t = torch.softmax(stages[label]["sampler.temperature"], dim=-1)
        kept[label] = kept_count(stages[label]["sampler.probs"])
        top1 = float(probs_t.max())
        nucleus = kept_count(torch.softmax(stages[label]["sampler.top_p"], -1))
        what = "greedy: only the most likely token" if p.temperature == 0 else (
            f"T={p.temperature:g} leaves the top token at p={top1:.3f}"
            + (f"; top-p {p.top_p:g} then needs {_tokens(nucleus)} to reach its mass" if p.top_p < 1 else ""))
        lines.append(f"**{label}**: {what}; **{_tokens(kept[label])}** kept in the end."
                     + (" " + underflow_note(stages[label]["sampler.probs"]) if unfiltered(p) else ""))
    for a, pa in settings.items():
        for b, pb in settings.items():
            if (pa.temperature > pb.temperature > 0 and pa.top_p < pb.top_p and kept[a] > kept[b]):
                lines.append(f"**{a}** keeps more tokens ({kept[a]:,}) than **{b}** ({kept[b]:,}) although its top-p "
                             f"is smaller ({pa.top_p:g} < {pb.top_p:g}): its temperature {pa.temperature:g} flattened "
                             "the distribution first, so the same share of probability is spread over more tokens.")
    return lines


def chain_table(stages: dict[str, torch.Tensor], token_text: TokenText, top_n: int = 5) -> pd.DataFrame:
    """One row per stage in order: tokens still in play, entropy, and the top tokens at that stage."""
    rows = []
    for name in STAGES:
        x = stages[name]
        probs = x if name == "sampler.probs" else torch.softmax(x, dim=-1)
        kept = kept_count(probs)
        top = torch.topk(probs, min(top_n, kept))
        rows.append((name.removeprefix("sampler."), kept, entropy_nats(probs),
                     ", ".join(f"{token_text(int(i))!r} {float(p):.3f}" for p, i in zip(top.values, top.indices))))
    return pd.DataFrame(rows, columns=["stage", "kept", "entropy", "top tokens (prob at this stage)"])


def chain_figure(chain: pd.DataFrame) -> go.Figure:
    return go.Figure(go.Bar(x=chain["stage"].tolist(), y=chain["kept"].tolist(), text=chain["kept"].tolist(),
                            marker_color=KEPT),
                     layout=dict(yaxis=dict(type="log", title="tokens kept"), height=280, margin=dict(t=20, b=40)))


def empirical(probs: torch.Tensor, n: int = 1000, seed: int = 0, token_text: TokenText | None = None,
              top_n: int = 15) -> tuple[pd.DataFrame, dict[str, float]]:
    """n seeded draws (torch.multinomial with a torch.Generator, as engine.sampling.draw does) against probs.

    Table: the most likely tokens plus any drawn, observed count/frequency vs probability. Stats: total
    variation distance, and Pearson's chi-square over tokens expected >= 5 times (the rest pooled)."""
    g = torch.Generator().manual_seed(int(seed))
    draws = torch.multinomial(probs, n, replacement=True, generator=g)
    counts = torch.bincount(draws, minlength=probs.shape[0]).double()
    freq, p = counts / n, probs.double()
    stats = {"draws": float(n), "tv_distance": float(0.5 * (freq - p).abs().sum())}
    stats.update(chi_square(counts, p * n))
    shown = torch.topk(p, min(top_n, kept_count(probs))).indices.tolist()
    shown += [i for i in torch.nonzero(counts).flatten().tolist() if i not in shown]
    shown = sorted(shown, key=lambda i: -float(p[i]))
    df = pd.DataFrame({"token_id": shown,
                       "token": [token_text(i) if token_text else str(i) for i in shown],
                       "count": [int(counts[i]) for i in shown],
                       "observed": [float(freq[i]) for i in shown],
                       "probability": [float(p[i]) for i in shown]})
    df["difference"] = df["observed"] - df["probability"]
    return df, stats


def pass_rate(probs: torch.Tensor, n: int = 1000, seeds: int = 200, alpha: float = 0.05) -> dict[str, float]:
    """The empirical check repeated with draw seeds 0..seeds-1: the share of p-values below alpha. For a
    sampler that draws exactly from probs this share is about alpha (a p-value is uniform under the null),
    so one small p-value at one seed says nothing; a share far above alpha would."""
    p = probs.double()
    below = 0
    for s in range(seeds):
        g = torch.Generator().manual_seed(s)
        counts = torch.bincount(torch.multinomial(probs, n, replacement=True, generator=g),
                                minlength=probs.shape[0]).double()
        pv = chi_square(counts, p * n)["p_value"]
        below += pv == pv and pv < alpha
    return {"seeds": float(seeds), "alpha": alpha, "below": float(below), "share_below": below / seeds}


def chi_square(observed: torch.Tensor, expected: torch.Tensor) -> dict[str, float]:
    """Pearson's chi-square; cells expected < 5 are pooled into one (dropped if that one is still < 5)."""
    big = expected >= 5
    obs, exp = observed[big].tolist(), expected[big].tolist()
    rest_o, rest_e = float(observed[~big].sum()), float(expected[~big].sum())
    if rest_e >= 5:
        obs.append(rest_o)
        exp.append(rest_e)
    dof = len(obs) - 1
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    # p = Q(dof/2, stat/2), the upper regularised incomplete gamma (torch has it; no scipy needed)
    pval = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64))) if dof > 0 else math.nan
    return {"chi_square": stat, "dof": float(dof), "p_value": pval}


def redraw(logits: torch.Tensor, settings: dict[str, SamplingParams], chain_setting: str, context: list[int],
           generated: list[int], token_text: TokenText, chosen: int | None = None, n_draws: int = 1000,
           seed: int = 0, top_n: int = 20, stages: dict[str, dict[str, torch.Tensor]] | None = None,
           draws: tuple[pd.DataFrame, dict[str, float]] | None = None, projector: bool = False) -> dict:
    """Everything the sampling page shows for one step: comparison, chain, empirical check (and figures;
    projector: the comparison laid out for a projector, see compare_figure).
    stages (chains() of these settings) and draws (empirical() of the chain setting) may come from a cache:
    a slider move changes one setting, and the others' chains and the draws need not be recomputed."""
    stages = stages or chains(logits, settings, context, generated)
    tokens, summary = compare(logits, settings, context, generated, token_text, top_n, chosen, stages)
    chain = chain_table(stages[chain_setting], token_text)
    emp, stats = draws or empirical(stages[chain_setting]["sampler.probs"], n_draws, seed, token_text)
    return {"tokens": tokens, "summary": summary, "compare_fig": compare_figure(tokens, summary, projector),
            "chain": chain, "chain_fig": chain_figure(chain), "empirical": emp, "stats": stats,
            "notes": chain_notes(settings, stages)}


def redraw_seconds(logits: torch.Tensor, settings: dict[str, SamplingParams] | None = None,
                   context: list[int] | None = None, generated: list[int] | None = None,
                   token_text: TokenText | None = None, n_draws: int = 1000, repeats: int = 5,
                   threads: int | None = None) -> float:
    """Best-of-`repeats` wall time of `redraw` (three or more settings + chain + n_draws draws, figures
    included): the server-side cost of redrawing the sampling page from cached logits (V,).

    Defaults: the page's opening settings for a greedy run (A greedy, B T=0.7 top-p 0.9, C T=1 top-k 40
    min-p 0.05), an empty context, token ids as text. threads: run the measurement with that many torch
    intra-op threads (restored afterwards); for benchmarks only, never in the server (the setting is
    process-wide). At 49k-element tensors the work is the same on one thread, and on an oversubscribed
    machine the thread pool's waits dominate."""
    settings = settings or default_settings(SamplingParams())
    context, generated, token_text = list(context or []), list(generated or []), token_text or str
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            redraw(logits, settings, next(iter(settings)), context, generated, token_text, n_draws=n_draws)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return best


def default_settings(run_params: SamplingParams, n: int = 3) -> dict[str, SamplingParams]:
    """What the sampling page opens with: A = the run's own settings, then the presets."""
    return {"ABCDE"[i]: run_params if i == 0 else SamplingParams(**PRESETS[i - 1]) for i in range(n)}


def redraw_seconds_for_run(model, record, step: int | None = None, n_draws: int = 1000, repeats: int = 5,
                           threads: int | None = None) -> float:
    """redraw_seconds on an inspected run (engine.Trace) with the page's opening settings, at
    `step` (default: the last, whose context is longest): the benchmark's entry point."""
    result = record.result
    step = len(result.steps) - 1 if step is None else step
    context, generated = step_context(result, step)
    tok = model.tokenizer
    return redraw_seconds(step_logits(record.recording, step), default_settings(result.params), context, generated,
                          lambda i: tok.decode([i]), n_draws=n_draws, repeats=repeats, threads=threads)
