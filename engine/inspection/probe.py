"""Probe: the per-run set of hooks. Capture tensors, record statistics, or replace a stage's tensor.

A probe is a run's configuration (what to watch, what to replace) and the machinery the forward offers its
stages to; what it sees goes into its Recording (engine.inspection.recording: `probe.recording`), the part a
run record keeps. A probe is created for one run and passed to each forward call; nothing is ever attached to
the shared model. Stages are chosen by exact name or glob pattern ("blocks.*.attn.pattern"). Every stage tensor has
its positions first ([T, ...]) except attn.scores / attn.pattern ([heads, T, S]); sampler stages are
[vocab] for the one position being sampled.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable

import torch

from engine.errors import EngineError
from engine.family.slots import GLOBAL_WEIGHTS, SLOTS
from engine.inspection.interventions import HookContext, HookFn
from engine.inspection.plans import Plan, plan_stage, split_name
from engine.inspection.probe_views import NONE, LayerProbe
from engine.inspection.recording import Capture, Recording, Watched
from engine.inspection.row_stats import PYTORCH, StatsBackend
from engine.inspection.stat_sources import Given
from engine.inspection.stats import StatsBatcher
from engine.quant_matrix import QuantMatrix
from engine.weights import FLOAT_NOTE

WEIGHT_SLOTS = {s.probe: s.field for s in SLOTS}     # a block's weights by name (engine.family.slots)


def _as_set(xs: Iterable[int] | None) -> frozenset | None:
    return None if xs is None else frozenset(int(x) for x in xs)


class Probe:
    def __init__(self, *, timing: bool = False) -> None:
        self._capture_specs: list[tuple[list[str], frozenset | None, frozenset | None]] = []
        self._stats_specs: list[str] = []
        self._replace_specs: list[tuple[list[str], HookFn, frozenset | None]] = []
        self._additions: dict[int, torch.Tensor] = {}     # layer -> the vector added to its resid_post (add)
        self._plans: dict[str, Plan] = {}
        self._block_rows: dict[int, tuple] = {}
        self._fused: dict[int, tuple] = {}      # id(names) -> (names, whether a fused step serves this probe)
        self._batcher = StatsBatcher()
        self.stats_backend = PYTORCH           # the model's, from begin_call
        self._layer_views: dict[int, LayerProbe] = {}
        self.active = False                    # inside a forward call (hooks are call-scoped)
        self.timing = timing
        self.step = 0
        self.pos0 = 0
        self.recording = Recording()           # what this probe sees (engine.inspection.recording)
        self._cuda_marks: list[tuple[int, str, Any]] = []
        self._t0: Any = None
        self._weight_overrides: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        self._weight_cache: dict[str, torch.Tensor] = {}
        self._dequantised: dict[str, str] = {}     # overridden weights kept quantised -> their format (notes())
        self.norm_eps: float | None = None   # run-only RMSNorm epsilon (fault injection: eps 0 on a zero input)
        self.recording.watched = self.watched()

    # ---- configuration (before the run) -------------------------------------------------------
    def capture(self, patterns: str | list[str], *, layers: Iterable[int] | None = None,
                positions: Iterable[int] | None = None) -> "Probe":
        """Keep full tensors of matching stages (optionally only some layers / absolute positions)."""
        self._capture_specs.append((_patterns(patterns), _as_set(layers), _as_set(positions)))
        return self._replanned()

    def record_stats(self, patterns: str | list[str] = "*") -> "Probe":
        """Per-position min/max/mean/std/absmax/NaN/Inf of matching stages at every step."""
        self._stats_specs.extend(_patterns(patterns))
        return self._replanned()

    def override_weight(self, name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Probe":
        """For this run only, use fn(copy of weight) instead of a weight (fault injection, ablation).

        Names (matrices are stored (in, out)): embed.weight, final_norm.weight, lm_head.weight,
        blocks.{i}.attn_norm.weight, blocks.{i}.attn.wqkv, blocks.{i}.attn.wo, blocks.{i}.mlp_norm.weight,
        blocks.{i}.mlp.w_gate_up, blocks.{i}.mlp.w_down. The shared model's weights are never touched."""
        if split_name(name)[1] not in WEIGHT_SLOTS and name not in GLOBAL_WEIGHTS:
            raise EngineError(f"unknown weight {name!r}; weights are {', '.join(GLOBAL_WEIGHTS)} and "
                              f"blocks.{{i}}.{{{', '.join(WEIGHT_SLOTS)}}}")
        self._weight_overrides[name] = fn
        self._weight_cache.clear()
        return self

    def weight(self, name: str, original: torch.Tensor) -> torch.Tensor:
        """The weight this run uses: the original, or its override (computed once per run). A matrix kept quantised
        (QuantMatrix) is overridden on its dequantised value, in the layout a float model holds (embed.weight:
        (V, d); any other matrix (in, out)), and the run multiplies by the float result."""
        fn = self._weight_overrides.get(name)
        if fn is None:
            return original
        if isinstance(original, QuantMatrix):
            self._dequantised[name] = original.format
            original = original.dequantize() if name != "embed.weight" else original.dequantize().t().contiguous()
        if name not in self._weight_cache:
            w = fn(original.clone())
            if not isinstance(w, torch.Tensor) or w.shape != original.shape:
                raise EngineError(f"weight override {name!r} must return a tensor of shape {tuple(original.shape)}")
            self._weight_cache[name] = w.to(original.dtype)
        return self._weight_cache[name]

    def layer_weights(self, i: int, lw):
        """A block's weights with this run's overrides applied (the same object when there are none)."""
        if not self._weight_overrides:
            return lw
        changes = {slot_field: self.weight(f"blocks.{i}.{slot}", getattr(lw, slot_field))
                   for slot, slot_field in WEIGHT_SLOTS.items() if f"blocks.{i}.{slot}" in self._weight_overrides
                   and getattr(lw, slot_field) is not None}
        return dataclasses.replace(lw, **changes) if changes else lw

    def replace(self, patterns: str | list[str], fn: HookFn, *, layers: Iterable[int] | None = None) -> "Probe":
        """fn(tensor, HookContext) returns the tensor the forward continues with (or None: unchanged)."""
        self._replace_specs.append((_patterns(patterns), fn, _as_set(layers)))
        return self._replanned()

    def add(self, stage: str, vector: torch.Tensor) -> "Probe":
        """Add vector (d,) to the stage blocks.{i}.resid_post at every position: a declared addition (a steering
        vector), x + vector.to(x.dtype) as a replace hook would compute it, which a fused step that applies it may
        serve as well (served_by(names, adds=True): engine.native.step's batched rows); any other forward computes
        it on the PyTorch path (a forward that cannot apply it never serves this probe). One addition a layer."""
        layer, part = split_name(stage) if isinstance(stage, str) else (None, None)
        if layer is None or part != "resid_post":
            raise EngineError(f"Probe.add takes one stage blocks.{{i}}.resid_post, got {stage!r}")
        if not isinstance(vector, torch.Tensor) or vector.dim() != 1 or not vector.is_floating_point():
            raise EngineError(f"Probe.add's vector must be a 1-D float tensor, got "
                              f"{getattr(vector, 'shape', type(vector).__name__)}")
        if layer in self._additions:
            raise EngineError(f"this probe already adds a vector to {stage} (one addition a layer)")
        self._additions[layer] = vector.detach()
        return self._replanned()

    @property
    def additions(self) -> dict[int, torch.Tensor]:
        """layer -> the vector this probe adds to blocks.{layer}.resid_post (add); empty when none."""
        return dict(self._additions)

    def _hooks(self) -> list[tuple[list[str], HookFn, frozenset | None]]:
        """The replace specs the PyTorch forward applies: the replace hooks, then each addition as one."""
        return self._replace_specs + [([f"blocks.{i}.resid_post"], _adding(v), None) for i, v in self._additions.items()]

    def _replanned(self) -> "Probe":
        self._plans.clear()
        self._block_rows.clear()
        self._fused.clear()
        self._layer_views.clear()
        self.recording.watched = self.watched()
        return self

    def watched(self) -> Watched:
        """What this probe watches, as data (what a run record keeps of its configuration)."""
        return Watched(self.timing, tuple(self._stats_specs),
                       tuple((tuple(pats), layers, positions) for pats, layers, positions in self._capture_specs),
                       self.norm_eps)

    def interventions(self) -> list[str]:
        """What this probe changes, by name (replace patterns, overridden weights): the code itself is not kept."""
        return ([f"replace {'|'.join(pats)}" for pats, _, _ in self._replace_specs]
                + [f"add blocks.{i}.resid_post" for i in self._additions]
                + [f"weight {name}" for name in self._weight_overrides])

    def notes(self) -> list[str]:
        """What a run's user must be told about its interventions: a weight override on a matrix kept in a GGUF
        file's blocks (a model loaded as stored) worked on its dequantised float32 values, not on the blocks."""
        return [f"weight override {name} ({fmt}, kept quantized): {FLOAT_NOTE}; the run multiplies by the "
                "overridden float32 matrix" for name, fmt in self._dequantised.items()]

    @property
    def stats_batcher(self) -> StatsBatcher:
        """The batcher of this probe's statistics: the one door every stage's statistics enter by (add)."""
        return self._batcher

    @property
    def hook_count(self) -> int:
        return (len(self._capture_specs) + len(self._stats_specs) + len(self._replace_specs) + len(self._additions)
                + len(self._weight_overrides))

    # ---- called by the engine ------------------------------------------------------------------
    def plan(self, name: str) -> Plan:
        p = self._plans.get(name)
        if p is None:
            p = self._plans[name] = plan_stage(name, self._stats_specs, self._capture_specs, self._hooks())
        return p

    def wants(self, name: str) -> bool:
        return bool(self.plan(name))

    def need(self, name: str) -> int:
        """NONE, STATS, ROWS or FULL: the least of its tensor a stage must produce for this probe."""
        return self.plan(name).need

    def wants_stats(self, name: str) -> bool:
        return self.plan(name).stats

    def capture_positions(self, name: str) -> list[int] | None:
        """The absolute positions some capture of this stage keeps (None: no capture)."""
        caps = self.plan(name).capture
        if not caps:
            return None
        return sorted(set().union(*(positions or () for _, positions in caps)))

    def offer_stats(self, names: list[str], source) -> None:
        """Statistics of consecutive stages computed without materialising them (attention scores / pattern):
        a source (engine.inspection.stats.Given, or still to be combined: attention_partials.PendingAttention)
        giving exactly these stages, each of which this probe records statistics of. They take the stages'
        place in forward order, as if their tensors had been offered."""
        self._batcher.add(names, [self.plan(n).layer for n in names], source)

    def served_by(self, names: list[str], *, adds: bool = False) -> bool:
        """Whether a forward that offers exactly these stages whole, as statistics, with its logits and per-layer
        timing marks (the native decode step: engine.accelerator) gives this probe everything it asks for: no
        replacements, weight overrides or run-only epsilon, and no capture but of the logits. adds: the forward also
        applies this probe's additions (add) to the stages among `names` (the native batched rows given them:
        NativeDecoder.rows); without it, a probe that adds anything is not served (its addition would be lost)."""
        got = self._fused.get((id(names), adds))
        if got is None or got[0] is not names:
            ok = not (self._replace_specs or self._weight_overrides or self.norm_eps is not None) and \
                not any(self.plan(n).capture for n in names if n != "logits") and \
                (not self._additions or adds and all(f"blocks.{i}.resid_post" in names for i in self._additions))
            got = self._fused[(id(names), adds)] = (names, ok)
        return got[1]

    def offer_step(self, names: list[str], layers: list, values: torch.Tensor | None, logits: torch.Tensor,
                   marks: list[tuple[str, float]] | None, start: float) -> None:
        """What a fused step computed (see served_by): statistics (G, 1, 7) of its stages in forward order, its
        logits (captured where asked), and with timing its marks (label, seconds since `start`, a perf_counter
        reading taken just before it ran)."""
        if values is not None:
            self._offer_block(names, layers, values)
        for _, positions in self.plan("logits").capture:
            self.recording.captures.append(self._capture("logits", None, logits, positions, False))
        if marks is not None and self.timing and self._t0 != "cuda":
            base = start - self._t0
            self.recording.marks.append((self.step, "start", base))
            self.recording.marks.extend((self.step, label, base + t) for label, t in marks)

    def _offer_block(self, names: list[str], layers: list, values: torch.Tensor) -> None:
        """Statistics (G, T, 7) of whole stages (the native decode step) in forward order; keeps those asked for."""
        sel = self._block_rows.get(id(names))
        if sel is None or sel[0] is not names:
            keep = [g for g, n in enumerate(names) if self.plan(n).stats]
            index = None if len(keep) == len(names) else torch.tensor(keep, dtype=torch.long)
            sel = self._block_rows[id(names)] = (names, [names[g] for g in keep], [layers[g] for g in keep], index)
        _, kept, kept_layers, index = sel
        if kept:
            self._batcher.add(kept, kept_layers, Given(values if index is None else values[index]))

    def offer_rows(self, name: str, x: torch.Tensor, positions: list[int]) -> None:
        """Rows of a heads-first stage at the given absolute positions, (heads, len(positions), S), for
        captures limited to positions (each keeps the positions it asked for)."""
        p = self.plan(name)
        for _, wanted in p.capture:
            keep = [i for i, pos in enumerate(positions) if pos in wanted]
            value = x.index_select(1, torch.tensor(keep, dtype=torch.long, device=x.device))
            self.recording.captures.append(Capture(self.step, name, p.layer, [positions[i] for i in keep],
                                                   value.detach().to("cpu", copy=True)))

    def layer(self, i: int) -> "LayerProbe":
        """The view block i offers its stages through: "attn.q" arrives here as "blocks.{i}.attn.q"."""
        view = self._layer_views.get(i)
        if view is None:
            view = self._layer_views[i] = LayerProbe(self, i)
        return view

    def __call__(self, name: str, x: Any) -> Any:
        if not self.active:
            raise EngineError(f"probe offered stage {name!r} outside a forward call (hooks are call-scoped)")
        p = self._plans.get(name)
        if p is None:
            p = self.plan(name)
        if p.need == NONE:
            return x
        layer, heads_first = p.layer, p.heads_first
        if p.replace:
            self._batcher.forget_moments()
        for fn in p.replace:
            y = fn(x, HookContext(name, layer, self.step, self.pos0))
            if y is not None:
                if isinstance(x, torch.Tensor) and (not isinstance(y, torch.Tensor) or y.shape != x.shape):
                    raise EngineError(f"replace hook on {name!r} returned shape "
                                      f"{getattr(y, 'shape', type(y).__name__)}, expected {tuple(x.shape)}")
                x = y
        if p.stats and isinstance(x, torch.Tensor) and x.is_floating_point():
            t = x.transpose(0, 1) if heads_first else x
            self._batcher.add(name, layer, t, p.masked)
        for _, positions in p.capture:
            self.recording.captures.append(self._capture(name, layer, x, positions, heads_first))
        return x

    def offer_captures(self, name: str, x: torch.Tensor) -> None:
        """A stage's tensor for this probe's captures only, kept as a call keeps it (a batched step, engine.batch:
        its statistics of the stage reach the probe through offer_stats)."""
        p = self.plan(name)
        for _, positions in p.capture:
            self.recording.captures.append(self._capture(name, p.layer, x, positions, p.heads_first))

    def _capture(self, name, layer, x, positions, heads_first) -> Capture:
        if not isinstance(x, torch.Tensor):
            return Capture(self.step, name, layer, [self.pos0], x)
        if x.dim() == 0 or name.startswith("sampler."):
            return Capture(self.step, name, layer, [self.pos0], x.detach().to("cpu", copy=True))
        dim = 1 if heads_first else 0
        rows = list(range(self.pos0, self.pos0 + x.shape[dim]))
        if positions is not None:
            keep = [i for i, p in enumerate(rows) if p in positions]
            x = x.index_select(dim, torch.tensor(keep, device=x.device, dtype=torch.long))
            rows = [rows[i] for i in keep]
        return Capture(self.step, name, layer, rows, x.detach().to("cpu", copy=True))

    def mark(self, label: str) -> None:
        """Timing mark (per layer when timing is on): CUDA events on a GPU, a clock on the CPU."""
        if self._t0 == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._cuda_marks.append((self.step, label, ev))
        else:
            self.recording.marks.append((self.step, label, time.perf_counter() - self._t0))

    def begin_call(self, pos0: int, device: torch.device, stats: StatsBackend = PYTORCH) -> None:
        """A forward call starts at absolute position pos0; stats: the model's statistics backend
        (engine.accelerator, chosen when the model was built)."""
        self.active = True
        self.pos0 = pos0
        self.recording.watched = self.watched()
        self.stats_backend = self._batcher.backend = stats
        if self.timing:
            self._t0 = "cuda" if device.type == "cuda" else time.perf_counter()

    def move_to(self, pos0: int) -> None:
        """Later stages of this call start at absolute position pos0 (statistics so far keep theirs)."""
        if pos0 != self.pos0:
            self.recording.stats.extend(self._batcher.take(self.step, self.pos0))
            self.pos0 = pos0

    def end_call(self) -> None:
        self.active = False
        rec = self.recording
        rec.stats.extend(self._batcher.take(self.step, self.pos0))
        rec.step, rec.pos0 = self.step, self.pos0
        if self._cuda_marks:
            torch.cuda.synchronize()
            first = self._cuda_marks[0][2]
            rec.marks.extend((s, lbl, first.elapsed_time(ev) / 1e3) for s, lbl, ev in self._cuda_marks)
            self._cuda_marks = []


def _adding(vector: torch.Tensor) -> HookFn:
    """Probe.add's hook on the PyTorch forward: x + vector in x's dtype (the vector rounded to it first)."""
    def add(x: torch.Tensor, ctx) -> torch.Tensor:
        return x + vector.to(x.dtype).to(x.device)
    return add


def inspection_probe(*, timing: bool = True) -> Probe:
    """What the app records for every run: statistics of every stage at every step, and each step's logits
    (for the sampling views)."""
    return Probe(timing=timing).record_stats("*").capture("logits")


def _patterns(p: str | list[str]) -> list[str]:
    pats = [p] if isinstance(p, str) else list(p)
    if not pats or not all(isinstance(x, str) and x for x in pats):
        raise EngineError(f"hook pattern must be a non-empty string or list of strings, got {p!r}")
    return pats
