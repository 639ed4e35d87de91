"""What a take-home report (engine.report.html) shows of one run, as plain data (lists, dicts, floats).

Everything is read from the run's Trace: steps and their candidates as recorded, layer statistics pooled over
positions as the Activations page pools them (mean of the means; RMS = sqrt(mean of mean² + std²)), findings
as the doctor finds them (first NaN/Inf, non-finite logits, loops), sampling distributions replayed with the
engine's own sampler chain from the captured logits. Only the attention maps need the model: one forward that
materialises the pattern of the chosen layers alone and stops after the last of them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import InputError
from engine.generate import nonfinite_stop
from engine.inspection.plans import split_name
from engine.inspection.probe import Probe
from engine.inspection.stat_columns import Col, nonfinite, pool
from engine.inspection.trace import Trace
from engine.progress import LayerProgress
from engine.sampling import sampler_chain
from engine.tools.doctor import Injection

MAX_SIDE = 256            # attention maps: most cells a side; longer runs are pooled into blocks of positions
ATTENTION_CHUNK = 512     # positions per forward call when computing attention maps (bounds the pattern's memory)
MAX_CELLS_LISTED = 50     # non-finite (step, position, stage) cells listed by name
VISIBLE = {" ": "·", "\n": "⏎", "\t": "→", "\r": "␍"}


def visible(text: str) -> str:
    """Whitespace made visible, one symbol per character."""
    return "".join(VISIBLE.get(c, c) for c in text)


def finite_or_none(x: float) -> float | None:
    """A float for JSON: NaN and ±Inf become None (null)."""
    x = float(x)
    return x if math.isfinite(x) else None


# ---- which layers and steps -----------------------------------------------------------------------
def parse_indices(text: str | None, flag: str) -> list[int] | None:
    """'0,5,-1' -> [0, 5, -1] (negative counts from the end); 'all' -> None; 'none' -> []; None -> None.
    InputError naming the flag for anything else."""
    if text is None or text.strip().lower() == "all":
        return None
    if text.strip().lower() == "none":
        return []
    out = []
    for part in text.split(","):
        try:
            out.append(int(part.strip()))
        except ValueError:
            raise InputError(f"{flag} {text!r}: expected whole numbers separated by commas (negative counts from "
                             f"the end), 'all' or 'none'; {part.strip()!r} is not a whole number") from None
    return out


def resolve_indices(idx: list[int] | None, count: int, flag: str, what: str) -> list[int]:
    """Indices into range(count), sorted, without repeats (None: all of them). InputError past either end."""
    if idx is None:
        return list(range(count))
    bad = [i for i in idx if not -count <= i < count]
    if bad:
        have = f"{what} 0..{count - 1}" if count else f"no {what}"
        raise InputError(f"{flag}: {bad[0]} is out of range; there are {have}")
    return sorted({i % count for i in idx})


def default_layers(num_layers: int) -> list[int]:
    """First, middle and last layer."""
    return sorted({0, num_layers // 2, num_layers - 1})


def default_steps(num_steps: int) -> list[int]:
    """First, middle and last step (none when the run made no step)."""
    return sorted({0, num_steps // 2, num_steps - 1}) if num_steps else []


# ---- tokens and steps -----------------------------------------------------------------------------
def token_piece(tokenizer, token_id: int) -> str:
    """A token's own text (its bytes; invalid UTF-8 shown as \\xNN escapes), whitespace made visible."""
    b = tokenizer.token_bytes(int(token_id))
    try:
        text = b.decode("utf-8")
    except UnicodeDecodeError:
        text = b.decode("utf-8", errors="backslashreplace")
    return visible(text)


def tokens(trace: Trace, tokenizer=None) -> list[dict]:
    """Every position of the run: position, id, its text, special, part (prompt / generated). Without a
    tokenizer a prompt token's text is its id in brackets and a generated one's the text of its step."""
    r = trace.result
    out = []
    for pos, i in enumerate(r.all_ids):
        gen = pos >= len(r.prompt_ids)
        if tokenizer is not None:
            text, special = token_piece(tokenizer, i), bool(tokenizer.is_special(int(i)))
        else:
            step = r.steps[pos - len(r.prompt_ids)] if gen and pos - len(r.prompt_ids) < len(r.steps) else None
            text, special = (visible(step.text) if step is not None else f"[{i}]"), False
        out.append({"position": pos, "id": int(i), "text": text, "special": special,
                    "part": "generated" if gen else "prompt"})
    return out


def steps(trace: Trace, tokenizer=None, top: int = 5) -> list[dict]:
    """One row per generation step, with the numbers the trace recorded (top: candidates kept per step)."""
    return [{"step": s.index, "position": s.position, "id": s.token_id,
             "token": token_piece(tokenizer, s.token_id) if tokenizer is not None else visible(s.text),
             "text": s.text, "prob": finite_or_none(s.prob), "model_prob": finite_or_none(s.model_prob),
             "entropy": finite_or_none(s.entropy), "kept": s.kept,
             "top": [{"id": c.id, "text": c.text, "prob": finite_or_none(c.prob)} for c in s.top[:top]]}
            for s in trace.result.steps]


# ---- findings -------------------------------------------------------------------------------------
def findings(trace: Trace) -> dict:
    """The first NaN/Inf (stage, layer, position, step), whether the logits went non-finite, the non-finite
    (step, position, stage) cells (the first MAX_CELLS_LISTED, and how many in all), and the loops."""
    cells, total = [], 0
    for b in (trace.recording.stats if trace.recording is not None else []):
        bad = nonfinite(b.values)                                                   # (G, T)
        hits = bad.nonzero().tolist()
        total += len(hits)
        for g, t in hits[:max(0, MAX_CELLS_LISTED - len(cells))]:
            cells.append({"step": b.step, "position": b.pos0 + t, "stage": b.names[g],
                          "nan": int(b.values[g, t, Col.NAN]), "inf": int(b.values[g, t, Col.INF])})
    nf = trace.first_nonfinite
    if nf is not None:
        nf = {**nf, "stats": {k: finite_or_none(v) for k, v in nf["stats"].items()}}
    return {"first_nonfinite": nf, "nonfinite_logits": nonfinite_stop(trace.result),
            "nonfinite_cells": cells, "nonfinite_cells_total": total,
            "loops": [lp.as_dict() for lp in trace.loops]}


# ---- activation statistics ------------------------------------------------------------------------
def layer_stats(trace: Trace) -> list[dict]:
    """One row per stage (per layer, and embed / final_norm / logits / sampler.*), its statistics pooled over
    every position of every step (engine.inspection.stat_columns.pool): positions, mean, std, rms, absmax, min,
    max, nan, inf (as the Activations page's table); None where nothing finite is left."""
    p = pool((b.names, b.values) for b in (trace.recording.stats if trace.recording is not None else []))
    cols = {k: x.tolist() for k, x in p.cols.items()}
    rows = []
    for g, name in enumerate(p.names):
        layer, stage = split_name(name)
        rows.append({"name": name, "stage": stage, "layer": layer, "positions": int(p.positions[g]),
                     **{k: finite_or_none(cols[k][g]) for k in ("mean", "std", "rms", "absmax", "min", "max")},
                     "nan": cols["nan"][g], "inf": cols["inf"][g]})
    return rows


# ---- sampling distributions -----------------------------------------------------------------------
def _step_logits(trace: Trace, step: int) -> torch.Tensor | None:
    caps = trace.recording.captured("logits", step=step) if trace.recording is not None else []
    return caps[0].value[-1].float() if caps and isinstance(caps[0].value, torch.Tensor) else None


def sampling(trace: Trace, chosen_steps: list[int], tokenizer=None) -> list[dict]:
    """For each chosen step: the recorded candidates (model probability, the trace's own), their probability
    under the run's sampler settings (replayed from the captured logits with engine.sampling.sampler_chain;
    None without captured logits), the chosen token, and how many tokens each sampler stage left."""
    r, out = trace.result, []
    for i in chosen_steps:
        s = r.steps[i]
        logits = _step_logits(trace, i)
        probs, kept = None, {}
        if logits is not None:
            context = list(r.prompt_ids) + list(r.token_ids[:i])
            chain = sampler_chain(logits, r.params, context, list(r.token_ids[:i]))
            probs = chain["sampler.probs"]
            kept = {k.removeprefix("sampler."): int(torch.isfinite(v).sum()) for k, v in chain.items()
                    if k != "sampler.probs"}
            kept["probs"] = int((probs > 0).sum())
        cands = [(c.id, c.text, c.prob) for c in s.top]
        if s.token_id not in {c[0] for c in cands}:
            cands.append((s.token_id, s.text, s.model_prob))
        out.append({"step": i, "position": s.position, "chosen": s.token_id,
                    "chosen_text": token_piece(tokenizer, s.token_id) if tokenizer is not None else visible(s.text),
                    "prob": finite_or_none(s.prob), "model_prob": finite_or_none(s.model_prob),
                    "entropy": finite_or_none(s.entropy), "kept": s.kept, "kept_by_stage": kept,
                    "candidates": [{"id": int(t), "text": visible(text), "model_prob": finite_or_none(p),
                                    "sampling_prob": None if probs is None else finite_or_none(probs[t])}
                                   for t, text, p in cands]})
    return out


# ---- attention maps -------------------------------------------------------------------------------
@dataclass
class AttentionMap:
    """One layer's attention pattern, averaged over heads: z[i, j] = attention of query block i on key block
    j (block = `block` positions starting at starts[k]); rows sum to 1 (mean over a block's queries of the
    mass on each key block). block 1: the exact (T, T) map."""
    layer: int
    z: np.ndarray          # (n, n) float64
    starts: list[int]
    block: int
    positions: int


def attention_maps(model, ids, layers: list[int], *, injections=(), norm_eps: float | None = None,
                   max_side: int = MAX_SIDE, on_progress=None) -> dict[int, AttentionMap]:
    """Head-averaged attention of each chosen layer over all positions of ids, pooled into at most max_side
    blocks a side. The run's faults (injections, norm_eps) are applied so the maps are the run's own. Forward
    calls of ATTENTION_CHUNK positions; each call materialises only the chosen layers' patterns and stops
    after the last of them (stop_after). on_progress(engine.progress.Progress) hears each block run finish, chunk by
    chunk (engine.progress)."""
    ids = [int(i) for i in ids]
    T, layers = len(ids), sorted(set(layers))
    if not layers or not T:
        return {}
    block = -(-T // max_side)
    n = -(-T // block)
    cols = torch.arange(T) // block
    sums = {layer: torch.zeros(n, n, dtype=torch.float64) for layer in layers}
    probe = Probe()
    for inj in injections:
        (Injection.parse(inj) if isinstance(inj, str) else inj).apply(probe, model)
    probe.norm_eps = norm_eps

    def keep(x: torch.Tensor, ctx) -> None:                  # x (heads, t, S) at positions ctx.pos0 ...
        m = x.float().mean(0).double().cpu()                 # (t, S)
        S, t = m.shape[1], m.shape[0]
        by_key = torch.zeros(t, n, dtype=torch.float64).index_add_(1, cols[:S], m)       # (t, n)
        sums[ctx.layer].index_add_(0, cols[ctx.pos0:ctx.pos0 + t], by_key)

    for layer in layers:
        probe.replace(f"blocks.{layer}.attn.pattern", keep, layers=[layer])
    cache, tell = model.new_cache(T), LayerProgress(on_progress, T, layers[-1] + 1)
    last = f"blocks.{layers[-1]}.attn.pattern"     # later chunks read only the cache rows of layers up to it
    for a in range(0, T, ATTENTION_CHUNK):
        chunk = torch.tensor(ids[a:a + ATTENTION_CHUNK], dtype=torch.long)
        model.forward(chunk, cache, probe, stop_after=last, on_layer=tell.on_layer(a, a + len(chunk)))
        tell.chunk_done(a, a + len(chunk))
    rows = torch.bincount(cols, minlength=n).double()[:, None]
    starts = list(range(0, T, block))
    return {layer: AttentionMap(layer, (sums[layer] / rows).numpy(), starts, block, T) for layer in layers}
