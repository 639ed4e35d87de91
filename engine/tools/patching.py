"""Activation patching (causal tracing) and a per-head ablation scan, through the engine's own blocks.

A grid cell is "run the corrupted prompt with one activation restored from the clean run". As separate
forwards that is 1080 forwards for a 12-token prompt (30 layers x 12 positions x 3 sites) plus 270 for the
heads, about 0.1 s each on two CPU cores: over two minutes. Two facts make it cheap:
- a patch at (layer i, position t) leaves every layer below i and every position before t exactly as in the
  run it starts from (the model is causal), so a patched run only computes layers >= i at positions >= t;
- many such partial runs can share one span of the model's blocks (`Model.run_blocks`, the same code as every
  forward) when their rows are packed along the position axis with a block-diagonal causal mask: a row
  attends to the base run's keys before its run's first position and to its own run's rows up to itself.
A packed call is a batched GEMM over hundreds of rows instead of hundreds of one-row calls, each of which
would re-read every weight. Patches are replace hooks on a Probe, as in any other run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.cache_protocol import RunCache
from engine.errors import InputError
from engine.inspection.interventions import zero_heads
from engine.inspection.probe import Probe
from engine.progress import OnProgress, tell_units

SITES = ("resid_post", "attn_out", "mlp_out")
MAX_ROWS = 256          # rows per packed call: large enough for efficient GEMMs, small enough that the
                        # (rows x rows) attention of a packed call stays cheap next to the MLP


# ---- base runs and packed partial runs ------------------------------------------------------------------
@dataclass
class Base:
    """One full forward, kept as what partial runs start from (every tensor on the model's device)."""
    ids: list[int]
    resid_pre: list[torch.Tensor]      # per layer (T, d): the residual stream entering the layer
    keys: list[torch.Tensor]           # per layer (K, T, hd): rotated keys, as the KV cache holds them
    values: list[torch.Tensor]         # per layer (K, T, hd)
    acts: dict[str, torch.Tensor]      # other captured stages by full name, (T, ...)
    logits: torch.Tensor               # (V,) fp32 CPU at the last position


def base_run(model, ids: list[int], extra: tuple[str, ...] = ()) -> Base:
    """One forward of ids capturing what packed runs need, plus the stages matching `extra`."""
    L = model.config.num_layers
    probe = Probe().capture(["embed", "blocks.*.resid_post", "blocks.*.attn.k_rot", "blocks.*.attn.v", *extra])
    logits = model.logits(ids, probe)[-1]                                       # (V,)
    got = {c.name: c.value.to(model.device) for c in probe.recording.captures}
    resid_pre = [got["embed"]] + [got[f"blocks.{i}.resid_post"] for i in range(L - 1)]
    keys = [got[f"blocks.{i}.attn.k_rot"].transpose(0, 1) for i in range(L)]  # (K, T, hd)
    values = [got[f"blocks.{i}.attn.v"].transpose(0, 1) for i in range(L)]
    return Base(list(ids), resid_pre, keys, values, got, logits)


@dataclass
class PackedRun:
    """A partial run: the base run with some change at layer `start`, recomputed from there on."""
    start: int                         # first layer computed (earlier layers are the base run's)
    pos0: int                          # first position computed (earlier positions are the base run's)
    entry: torch.Tensor | None = None  # (T - pos0, d) residual entering layer `start`; None: the base run's
    edits: tuple = ()                  # ((stage in layer `start`, fn(rows) -> rows), ...) as replace hooks


class PrefixKV(RunCache):
    """The keys and values one packed block call reads (run_blocks takes a Cache; this one a RunCache over its own
    store): the base run's keys of the shared prefix, then the packed rows' own keys (the mask decides who sees
    what)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values                                   # (K, P, hd)

    def key_positions(self, layer: int, T: int) -> tuple[int, int]:
        return 0, self.keys.shape[1] + T

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        return torch.cat([self.keys, k.to(self.keys.dtype)], 1), torch.cat([self.values, v.to(self.values.dtype)], 1)


def _groups(runs: list[PackedRun], T: int, max_rows: int) -> list[list[int]]:
    """Run indices in packs of at most max_rows rows, ordered by start layer so a pack's runs start close."""
    order = sorted(range(len(runs)), key=lambda k: (runs[k].start, runs[k].pos0))
    groups, rows = [[]], 0
    for k in order:
        n = T - runs[k].pos0
        if groups[-1] and rows + n > max_rows:
            groups, rows = groups + [[]], 0
        groups[-1].append(k)
        rows += n
    return [g for g in groups if g]


def _edit_probe(layer: int, edits: list[tuple[str, slice, Callable]]) -> Probe:
    """A probe whose replace hooks apply each run's edits to that run's rows only."""
    probe = Probe()
    stages: dict[str, list[tuple[slice, Callable]]] = {}
    for stage, rows, fn in edits:
        stages.setdefault(stage, []).append((rows, fn))
    for stage, items in stages.items():
        def apply(x, ctx, items=items):
            y = x.clone()
            for rows, fn in items:
                y[rows] = fn(x[rows])
            return y
        probe.replace(f"blocks.{layer}.{stage}", apply)
    return probe


def _run_pack(model, base: Base, runs: list[PackedRun]) -> torch.Tensor:
    """The last position's logits (len(runs), V), fp32 CPU, of runs packed into one block call per layer."""
    cfg, dev, T = model.config, model.device, len(base.ids)
    first = min(r.start for r in runs)
    # (R, d) packed rows, in the dtype of the stream entering the first layer computed (fp32 past a plan's resid)
    x = torch.empty(0, cfg.hidden_size, device=dev, dtype=base.resid_pre[first].dtype)
    run_of = torch.empty(0, dtype=torch.long, device=dev)                             # (R,) run of each row
    pos = torch.empty(0, dtype=torch.long, device=dev)                                # (R,) its position
    spans: list[slice] = [slice(0, 0)] * len(runs)
    pos0 = torch.tensor([r.pos0 for r in runs], device=dev)
    for j in range(first, cfg.num_layers):
        edits = []
        for k, r in enumerate(runs):
            if r.start != j:
                continue
            rows = r.entry if r.entry is not None else base.resid_pre[j][r.pos0:]
            spans[k] = slice(x.shape[0], x.shape[0] + T - r.pos0)
            x = torch.cat([x, rows.to(dev, x.dtype)])
            run_of = torch.cat([run_of, torch.full((T - r.pos0,), k, device=dev)])
            pos = torch.cat([pos, torch.arange(r.pos0, T, device=dev)])
            edits += [(stage, spans[k], fn) for stage, fn in r.edits]
        P = int(pos0[run_of].max())                                              # shared prefix length
        see_prefix = torch.arange(P, device=dev)[None, :] < pos0[run_of][:, None]                # (R, P)
        see_packed = (run_of[None, :] == run_of[:, None]) & (pos[None, :] <= pos[:, None])       # (R, R)
        mask = torch.cat([see_prefix, see_packed], 1)                                            # (R, P + R)
        kv = PrefixKV(base.keys[j][:, :P], base.values[j][:, :P])
        x = model.run_blocks(x, kv, j, j + 1, _edit_probe(j, edits), positions=pos, mask=mask)
    last = torch.tensor([s.stop - 1 for s in spans], device=dev)                # each run's position T-1
    return model.unembed(x[last])


def packs(runs: list[PackedRun], T: int, max_rows: int = MAX_ROWS) -> int:
    """How many packed calls run_packed makes for these runs (its progress counts them)."""
    return len(_groups(runs, T, max_rows))


def run_packed(model, base: Base, runs: list[PackedRun], *, max_rows: int = MAX_ROWS,
               on_progress: OnProgress | None = None, what: str = "runs",
               part: tuple[int, int] | None = None) -> torch.Tensor:
    """Final-position logits (len(runs), V) fp32 CPU of partial runs from `base`, in the order given.
    on_progress (engine.progress) hears each packed call before it runs; part = (packs done before, packs in
    the whole job) when these runs are one part of a larger job; the end (done == total) is told after the last
    part. A STOP answer raises engine.progress.Stopped before the next pack."""
    T = len(base.ids)
    out = torch.empty(len(runs), model.config.vocab_size)
    groups = _groups(runs, T, max_rows)
    before, total = part or (0, len(groups))
    for n, g in enumerate(groups):
        tell_units(on_progress, before + n, total, f"{what}: pack {n + 1} of {len(groups)}")
        out[g] = _run_pack(model, base, [runs[k] for k in g])
    if before + len(groups) >= total:
        tell_units(on_progress, total, total, f"{what}: done")
    return out


# ---- single full-forward reference runs (one cell, for checks and for anyone wanting just one) -------------
def restored_prob(model, clean_ids: list[int], corrupt_ids: list[int], target: int, stage: str,
                  positions: list[int]) -> float:
    """p(target) at the last position of the corrupted prompt with `stage` restored from the clean run at
    the given positions: two plain forwards with a capture and a replace hook."""
    cap = Probe().capture(stage)
    model.logits(clean_ids, cap)
    clean = cap.recording.captures[0].value.to(model.device)                              # (T, ...)

    def restore(x, ctx):
        y = x.clone()
        y[positions] = clean[positions].to(x.dtype)
        return y
    logits = model.logits(corrupt_ids, Probe().replace(stage, restore))[-1]
    return float(torch.softmax(logits, -1)[target])


def ablated_logit(model, ids: list[int], target: int, layer: int, head: int) -> float:
    """logit(target) at the last position with one head's output (its attn.z) zeroed at every position."""
    probe = Probe().replace(f"blocks.{layer}.attn.z", zero_heads(head))
    return float(model.logits(ids, probe)[-1, target])


# ---- the grid and the head scan ---------------------------------------------------------------------------
@dataclass
class PatchingResult:
    clean_ids: list[int]
    corrupt_ids: list[int]
    target: int
    target_text: str
    p_clean: float
    p_corrupt: float
    logit_clean: float                            # logit(target), clean run
    grid: dict[str, list[list[float]]]            # site -> [layer][position] -> recovered p(target)
    head_scan: list[list[float]] | None           # [layer][head] -> logit change when the head is zeroed
    seconds: dict[str, float] = field(default_factory=dict)
    runs: int = 0                                 # partial runs computed (cells before the first changed
                                                  # position are p_corrupt without a run)

    def as_dict(self) -> dict:
        return {"clean_ids": self.clean_ids, "corrupt_ids": self.corrupt_ids, "target": self.target,
                "target_text": self.target_text, "p_clean": self.p_clean, "p_corrupt": self.p_corrupt,
                "logit_clean": self.logit_clean, "grid": self.grid, "head_scan": self.head_scan,
                "seconds": self.seconds, "runs": self.runs}


def _restore_first(value: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """Edit: the run's first row (its position pos0) becomes the clean value."""
    return lambda rows: torch.cat([value[None].to(rows.dtype), rows[1:]])


def _zero_head(h: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(rows):                                                               # (n, H, hd)
        rows = rows.clone()
        rows[:, h] = 0
        return rows
    return fn


def head_runs(model) -> list[PackedRun]:
    """The head scan's partial runs: every (layer, head) zeroed at its attn.z, from that layer on."""
    L, H = model.config.num_layers, model.config.num_heads
    return [PackedRun(i, 0, edits=(("attn.z", _zero_head(h)),)) for i in range(L) for h in range(H)]


def head_scan(model, ids: list[int], target: int, *, base: Base | None = None,
              on_progress: OnProgress | None = None, part: tuple[int, int] | None = None) -> list[list[float]]:
    """[layer][head]: logit(target) at the last position with that head's output zeroed at every position,
    minus the unablated logit. A head at layer i leaves layers below i untouched, so each run starts there.
    on_progress and part as in run_packed."""
    L, H = model.config.num_layers, model.config.num_heads
    base = base or base_run(model, ids)
    logits = run_packed(model, base, head_runs(model), on_progress=on_progress, what="head scan", part=part)
    return (logits[:, target] - float(base.logits[target])).view(L, H).tolist()                # (L, H)


def check_pair(model, clean_ids: list[int], corrupt_ids: list[int], target: int) -> None:
    if not clean_ids or len(clean_ids) != len(corrupt_ids):
        raise InputError(f"the clean and corrupted prompts must have the same number of tokens "
                         f"(clean {len(clean_ids)}, corrupted {len(corrupt_ids)})")
    if not 0 <= int(target) < model.config.vocab_size:
        raise InputError(f"target token id {target} is outside the vocabulary")


def patching_grid(model, clean_ids: list[int], corrupt_ids: list[int], target: int, *,
                  sites: tuple[str, ...] = SITES, heads: bool = True, skip_unchanged: bool = True,
                  on_progress: OnProgress | None = None) -> PatchingResult:
    """Every layer x position x site restored from clean into the corrupted run (recovered p(target)), and
    every head zeroed in the clean run (change in logit(target)). on_progress (engine.progress) hears each
    packed call of the grid and the scan before it runs, and the end; a STOP answer raises
    engine.progress.Stopped before the next one (no result).

    skip_unchanged: positions before the first token that differs hold identical activations in both runs
    (causality), so their cells are p_corrupt without computing them."""
    check_pair(model, clean_ids, corrupt_ids, target)
    if bad := [s for s in sites if s not in SITES]:
        raise InputError(f"unknown patching site {bad[0]!r}; sites are {', '.join(SITES)}")
    L, H, T = model.config.num_layers, model.config.num_heads, len(clean_ids)
    t0 = time.perf_counter()
    clean = base_run(model, clean_ids, extra=tuple(f"blocks.*.{s}" for s in sites if s != "resid_post"))
    corrupt = base_run(model, corrupt_ids)
    p_clean = float(torch.softmax(clean.logits, -1)[target])
    p_corrupt = float(torch.softmax(corrupt.logits, -1)[target])
    first = next((t for t in range(T) if clean_ids[t] != corrupt_ids[t]), T) if skip_unchanged else 0
    cells = [(s, i, t) for s in sites for i in range(L) for t in range(first, T)]
    runs = [PackedRun(i, t, edits=((s, _restore_first(clean.acts[f"blocks.{i}.{s}"][t])),)) for s, i, t in cells]
    t1 = time.perf_counter()
    n_grid, n_heads = packs(runs, T), packs(head_runs(model), T) if heads else 0
    total = n_grid + n_heads
    probs = torch.softmax(run_packed(model, corrupt, runs, on_progress=on_progress, what="patching grid",
                                     part=(0, total)), -1)
    grid = {s: [[p_corrupt] * T for _ in range(L)] for s in sites}
    for (s, i, t), p in zip(cells, probs[:, target].tolist()):
        grid[s][i][t] = p
    t2 = time.perf_counter()
    scan = head_scan(model, clean_ids, target, base=clean, on_progress=on_progress,
                     part=(n_grid, total)) if heads else None
    t3 = time.perf_counter()
    return PatchingResult(list(clean_ids), list(corrupt_ids), int(target), model.tokenizer.decode([int(target)]),
                          p_clean, p_corrupt, float(clean.logits[target]), grid, scan,
                          {"base": t1 - t0, "grid": t2 - t1, "heads": t3 - t2, "total": t3 - t0},
                          len(runs) + (L * H if heads else 0))


def replace_span(ids: list[int], start: int, end: int, replacement: list[int]) -> list[int]:
    """A corrupted prompt: ids with tokens [start, end) replaced by as many replacement tokens."""
    if not 0 <= start < end <= len(ids):
        raise InputError(f"token span [{start}, {end}) is not inside the prompt's {len(ids)} tokens")
    if len(replacement) != end - start:
        raise InputError(f"the replacement is {len(replacement)} tokens; the span is {end - start} "
                         "(patching needs prompts of the same length)")
    return list(ids[:start]) + [int(i) for i in replacement] + list(ids[end:])
