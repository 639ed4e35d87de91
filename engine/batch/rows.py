"""What Model.forward_batch talks to for a batched decode step (engine.forward_batch.Batch.rows): Rows (the batch's
cache: each row's keys and values written to its own run's KVCache and its attention computed against that cache
alone, exactly as the run's own one-token forward computes it) and FanProbe (the batch's probe: every stage tensor (B,
...) cut into its rows, each probe begun at its own run's position: the statistics of every stage computed once over
all rows (engine.batch.shared_stats) and row b's handed to run b's probe, captures of row b kept by run b's probe).

A fence around each run's own code: whatever run b's probe raises when the batch calls it (offered a stage, its
statistics, its captures, its call's start or end), and whatever row b's attention raises (its probe is offered the
scores there), is run b's failure, not the batch's: FanProbe.fail records it (failed[b]), silences run b's probe for
the rest of the forward and hands row b zeros where its attention failed. Every row's values depend on its own row
alone and no probe here changes a tensor, so the other rows' results are those of the forward without the failure;
the caller gives run b its error and leaves its cache where it was (engine.batch.step, engine.batch.prefill)."""
from __future__ import annotations

from typing import Any

import torch

from engine.attention import Where, attend
from engine.attention_math import padded_attention
from engine.batch.shared_stats import RowSource, SharedStats
from engine.inspection.probe_views import NO_PROBE, NONE, NoProbe


class Rows:
    """The caches of a batch's runs, one row each, at positions (B,): the forward's Cache (engine.cache_protocol)."""

    def __init__(self, model, caches: list, positions: list[int]) -> None:
        self.cfg, self.caches, self._model, self._positions = model.config, caches, model, positions
        self._where: list[Where] | None = None

    @property
    def where(self) -> list[Where]:
        """Each row's own positions, rotary tables and masks: what its run alone would build for one token (made on
        the PyTorch path's first use; the native batched step needs none)."""
        if self._where is None:
            m = self._model
            self._where = [Where(m.config, m.rope, torch.tensor([p], device=m.device)) for p in self._positions]
        return self._where

    def last_rows(self, T: int) -> slice:
        """Every row is its run's last (one token each)."""
        return slice(0, T)

    def attend(self, i: int, qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p, at: Where) -> torch.Tensor:
        """Layer i: qh (H, B, hd), k, v (B, K, hd) -> z (H, B, hd), row b against run b's cache (at: the batch's
        positions; each row's own masks are in `where`), its scores and pattern (H, 1, S_b) offered to run b's
        probe: in one padded product where `padded` says so (engine.attention_math.padded_attention), else row by
        row, as alone (engine.attention.attend)."""
        B = len(self.caches)
        got = []
        for b, cache in enumerate(self.caches):
            first, _ = cache.key_positions(i, 1)
            keys, values = cache.update(i, k[b:b + 1].transpose(0, 1), v[b:b + 1].transpose(0, 1))    # (K, S, hd)
            got.append((first, keys.to(qh.dtype), values.to(qh.dtype)))
        if not self.padded(i, qh.device):
            return torch.cat([p.fenced(b, lambda view, b=b: self._one(b, i, qh[:, b:b + 1], *got[b], view),
                                       qh[:, b:b + 1]) for b in range(B)], dim=1)
        lengths = [g[1].shape[1] for g in got]
        return padded_attention(qh, [g[1] for g in got], [g[2] for g in got], scale=self.cfg.attn_scale,
                                softcap=self.cfg.attn_softcap,
                                offer=lambda stage, x, pad: p.maps(stage, x, lengths, pad))

    def padded(self, i: int, device: torch.device) -> bool:
        """Whether layer i takes every row in one padded product: a global layer without a soft cap, more than one
        row, on an accelerator. A window layer (its rows keep different key ranges) and a soft cap (the explicit
        path's) go row by row, and so does every layer on the CPU: the padded sums (the softmax's, pattern @ V's,
        the scores' statistics over the pad) add in another order than the row's alone, and on the CPU a row's
        result is its run's alone, bit for bit (batch invariance)."""
        cfg = self.cfg
        return cfg.layer_window[i] is None and cfg.attn_softcap is None and len(self.caches) > 1 \
            and device.type != "cpu"

    def _one(self, b: int, i: int, qh, first: int, keys, values, p) -> torch.Tensor:
        """Row b alone, exactly as its run's one-token forward computes it (engine.attention.attend)."""
        mask = self.where[b].mask(self.cfg.layer_window[i], first, keys.shape[1])
        return attend(p, qh, keys, values, mask, first, scale=self.cfg.attn_scale, softcap=self.cfg.attn_softcap)


class FanLayer:
    """Block i of a FanProbe: a stage's tensor (B, ...) of block i, its statistics computed once for every row that a
    probe records statistics of (each probe told its row's values, as blocks.{i}.<stage>), row b captured by run
    b's probe where it captures the stage. No replace hook here (engine.batch.step runs those apart)."""
    guards_nan = True

    def __init__(self, fan: "FanProbe", parts: list, names: dict | None = None) -> None:
        self.fan, self.parts = fan, parts
        self.names = names               # stage -> full name (a block's: its LayerProbe's); None: the stage's own

    def part(self, b: int):
        """Run b's own view, for a call on its row alone (the statistics shared with it so far handed to it first,
        so that its records stay in forward order)."""
        self.fan.close(b)
        return self.parts[b]

    def fenced(self, b: int, attend, like: torch.Tensor) -> torch.Tensor:
        """attend(run b's view): row b's attention, its probe offered the scores; what it raises is run b's failure
        (FanProbe.fail) and row b's z is then zeros like `like` (nothing but run b's discarded rows reads it)."""
        try:
            return attend(self.part(b))
        except Exception as e:      # run b's own failure: its thread raises it (engine.batch.step, .prefill)
            self.fan.fail(b, e)
            return torch.zeros_like(like)

    def plans(self, stage: str):
        """(row, probe, plan) of every run whose probe wants the stage, in row order."""
        for b, p in enumerate(self.parts):
            if p is not NO_PROBE:
                try:
                    plan = p.plan(stage)
                except Exception as e:      # run b's own failure
                    self.fan.fail(b, e)
                    continue
                if plan.need != NONE:
                    yield b, p, plan

    def __call__(self, stage: str, x: Any) -> Any:
        bounds = self.fan.bounds
        rows = isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() > 1 and x.shape[0] == bounds[-1][1]
        entry = None
        for b, p, plan in self.plans(stage):
            s, e = bounds[b]
            try:
                if not rows or plan.heads_first:
                    self.part(b)(stage, x[s:e])
                    continue
                if plan.capture:
                    p.offer_captures(stage, x[s:e])
            except Exception as err:        # run b's own failure
                self.fan.fail(b, err)
                continue
            if plan.stats:
                if entry is None:
                    name = self.names[stage] if self.names else stage
                    entry, wanting = self.fan.shared.add(name, plan.layer, x, plan.masked), []
                wanting.append(b)
        if entry is not None:
            self.fan.rows(wanting, name, entry)
        return x

    def maps(self, stage: str, x: torch.Tensor, lengths: list[int], pad: torch.Tensor) -> None:
        """Attention scores or pattern (B, H, S) of every row, row b's first lengths[b] keys its own (pad (B, S):
        the rest). Row b alone offers (H, 1, lengths[b]); its statistics are those of its H x lengths[b] entries,
        so the shared ones leave the pad out as masked entries (-inf: the pattern's zeros there become -inf in a
        copy). A probe that captures the stage takes its row alone."""
        entry = None
        for b, _, plan in self.plans(stage):
            if plan.capture or not plan.stats:
                self.fan.guard(b, lambda b=b: self.part(b)(stage, x[b, :, None, :lengths[b]]))
                continue
            if entry is None:
                name = self.names[stage] if self.names else stage
                masked = x if plan.masked else x.masked_fill(pad[:, None, :], float("-inf"))
                entry, wanting = self.fan.shared.add(name, plan.layer, masked, True), []
            wanting.append(b)
        if entry is not None:
            self.fan.rows(wanting, name, entry)

    def need(self, stage: str) -> int:
        need = NONE
        for b, p in enumerate(self.parts):
            if p is not NO_PROBE:
                try:
                    need = max(need, p.need(stage))
                except Exception as e:      # run b's own failure
                    self.fan.fail(b, e)
        return need


class FanProbe(NoProbe):
    """The batch's probe: parts[b] is run b's probe (or NO_PROBE); positions[b] its run's position; bounds[b] its
    rows of the call's stage tensors (a decode step's: row b alone; a packed prefill's, engine.batch.segments: its
    prompt's). Weights, epsilon and positions are NoProbe's (the batch's own): a probe that would change them runs
    apart (engine.batch.step). shared: the statistics of the batch's stages (engine.batch.shared_stats); run b's
    consecutive shared stages are handed to its probe as one source (RowSource) before anything else it is offered,
    and at the call's end. failed[b]: what run b's own probe or row raised in this forward (fail), else None."""

    def __init__(self, probes: list, positions: list[int], bounds: list[tuple[int, int]] | None = None) -> None:
        self.parts = [NO_PROBE if p is None else p for p in probes]
        self.failed: list[BaseException | None] = [None] * len(self.parts)
        self.bounds = bounds or [(b, b + 1) for b in range(len(self.parts))]
        self.positions, self.shared = positions, SharedStats()
        self.top = FanLayer(self, self.parts)
        self.timing = any(p.timing for p in self.parts)
        self._layers: dict[int, FanLayer] = {}
        self._open: list[RowSource | None] = [None] * len(self.parts)

    @property
    def hook_count(self) -> int:
        return sum(p.hook_count for p in self.parts if p is not NO_PROBE)

    @property
    def watching(self) -> bool:
        """Whether any row's run has a probe (the native step then computes every row's statistics)."""
        return any(p is not NO_PROBE for p in self.parts)

    def served_by(self, names: list[str]) -> bool:
        """Whether a fused step (Probe.served_by) serves every row's probe."""
        return all(p is NO_PROBE or self.guard(b, p.served_by, names) is not False for b, p in enumerate(self.parts))

    def offer_step(self, names: list[str], layers: list, values, logits: torch.Tensor, marks, start: float) -> None:
        """A fused step's rows (engine.native: statistics (B, G, 7), logits (B, V)), row b to run b's probe as a
        lone step's (Probe.offer_step); the step's timing marks to each."""
        for b, p in enumerate(self.parts):
            if p is not NO_PROBE:
                self.guard(b, p.offer_step, names, layers, None if values is None else values[b].unsqueeze(1),
                           logits[b:b + 1], marks, start)

    def guard(self, b: int, fn, *args):
        """fn(*args), a call into run b's own code: what it raises is run b's failure (fail), and None comes back."""
        try:
            return fn(*args)
        except Exception as e:      # run b's own failure: its thread raises it, the batch goes on
            self.fail(b, e)
            return None

    def fail(self, b: int, error: BaseException) -> None:
        """Run b's own code raised `error` in this forward: it is run b's outcome (failed[b]; the first error
        stands), and its probe is offered nothing more."""
        if self.failed[b] is None:
            self.failed[b] = error
        self.drop(b)

    def drop(self, b: int) -> None:
        """Run b's probe is offered nothing more in this forward (shared statistics not yet handed to it included)."""
        self._open[b] = None
        self.parts[b] = NO_PROBE
        for view in self._layers.values():
            view.parts[b] = NO_PROBE

    def rows(self, parts: list[int], name: str, entry: int) -> None:
        """These runs' probes record the statistics of shared entry `entry` (stage `name`) next."""
        opened = self._open
        for b in parts:
            if self.parts[b] is NO_PROBE:       # it failed since it asked (fail)
                continue
            src = opened[b]
            if src is None:
                src = opened[b] = RowSource(self.shared, *self.bounds[b])
            src.names.append(name)
            src.entries.append(entry)

    def close(self, b: int) -> None:
        """Hand run b's probe the shared stages it has been told of since the last close (one source)."""
        src = self._open[b]
        if src is not None:
            self._open[b] = None
            self.guard(b, self.parts[b].offer_stats, src.names, src)

    def begin_call(self, pos0: int, device: torch.device, stats) -> None:
        self.shared.batcher.backend = stats
        for b, (p, pos) in enumerate(zip(self.parts, self.positions)):
            if p is not NO_PROBE:
                self.guard(b, p.begin_call, pos, device, stats)

    def end_call(self) -> None:
        for b, p in enumerate(self.parts):
            if p is not NO_PROBE:
                self.close(b)
                if self.parts[b] is not NO_PROBE:
                    self.guard(b, p.end_call)

    def __call__(self, name: str, x: Any) -> Any:
        return self.top(name, x)

    def need(self, name: str) -> int:
        return self.top.need(name)

    def layer(self, i: int) -> FanLayer:
        view = self._layers.get(i)
        if view is None:
            parts = [p if p is NO_PROBE else self.guard(b, p.layer, i) or NO_PROBE for b, p in enumerate(self.parts)]
            names = next((p.names for p in parts if p is not NO_PROBE), None)
            view = self._layers[i] = FanLayer(self, parts, names)
        return view

    def mark(self, label: str) -> None:
        for b, p in enumerate(self.parts):
            if p.timing:
                self.guard(b, p.mark, label)
