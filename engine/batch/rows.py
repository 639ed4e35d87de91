"""What Model.forward_rows talks to for a batch of runs: Rows (the batch's cache: each row's keys and values
written to its own run's KVCache and its attention computed against that cache alone, exactly as the run's own
one-token forward computes it) and FanProbe (the batch's probe: every stage tensor (B, ...) cut into its rows,
row b offered to run b's probe, each probe begun at its own run's position)."""
from __future__ import annotations

from typing import Any

import torch

from engine.attention import Where, explicit
from engine.inspection.probe_views import NO_PROBE, NONE, NoProbe


class Rows:
    """The caches of a batch's runs, one row each, at positions (B,)."""

    def __init__(self, model, caches: list, positions: list[int]) -> None:
        self.cfg, self.caches = model.config, caches
        # each row's own positions, rotary tables and masks: what its run alone would build for one token
        self.where = [Where(model.config, model.rope, torch.tensor([p], device=model.device)) for p in positions]

    def attend(self, i: int, qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p) -> torch.Tensor:
        """Layer i: qh (H, B, hd), k, v (B, K, hd) -> z (H, B, hd), row b against run b's cache, its scores and
        pattern (H, 1, S_b) offered to run b's probe. A global layer without a soft cap takes every row in one padded
        product (a row's keys padded to the longest with -inf scores: the same dot products, a softmax and a
        pattern @ V whose sums also run over the pad's zeros); a window layer or a soft cap row by row, as alone."""
        cfg, B = self.cfg, len(self.caches)
        got = []
        for b, cache in enumerate(self.caches):
            first, _ = cache.key_positions(i, 1)
            keys, values = cache.update(i, k[b:b + 1].transpose(0, 1), v[b:b + 1].transpose(0, 1))    # (K, S, hd)
            got.append((first, keys.to(qh.dtype), values.to(qh.dtype)))
        if cfg.layer_window[i] is not None or cfg.attn_softcap is not None or B == 1:
            return torch.cat([self._one(b, i, qh[:, b:b + 1], *got[b], p.part(b)) for b in range(B)], dim=1)
        return self._padded(qh, got, p)

    def _one(self, b: int, i: int, qh, first: int, keys, values, p) -> torch.Tensor:
        """Row b alone, exactly as its run's one-token forward computes it."""
        mask = self.where[b].mask(self.cfg.layer_window[i], first, keys.shape[1])
        return explicit(qh, keys, values, p, None if mask is None else mask.allowed, self.cfg.attn_scale,
                        self.cfg.attn_softcap, first)

    def _padded(self, qh: torch.Tensor, got: list, p) -> torch.Tensor:
        H, B, hd = qh.shape
        K, lengths = got[0][1].shape[0], [g[1].shape[1] for g in got]
        S = max(lengths)
        keys = qh.new_zeros(B, K, S, hd)
        values = qh.new_zeros(B, K, S, hd)
        for b, (_, kb, vb) in enumerate(got):
            keys[b, :, :lengths[b]] = kb
            values[b, :, :lengths[b]] = vb
        q = qh.transpose(0, 1).reshape(B, K, H // K, hd)                                 # (B, K, G, hd)
        scores = (q @ keys.transpose(-1, -2)).view(B, H, S) * self.cfg.attn_scale        # (B, H, S)
        pad = torch.arange(S, device=qh.device)[None, :] >= torch.tensor(lengths, device=qh.device)[:, None]
        scores = scores.masked_fill(pad[:, None, :], float("-inf"))
        pattern = torch.softmax(scores.float(), dim=-1).to(qh.dtype)
        for b, n in enumerate(lengths):
            part = p.part(b)
            part("attn.scores", scores[b, :, None, :n])
            part("attn.pattern", pattern[b, :, None, :n])       # offered only: nothing here replaces them
        z = pattern.view(B, K, H // K, S) @ values                                       # (B, K, G, hd)
        return z.reshape(B, H, hd).transpose(0, 1)

class FanLayer:
    """Block i of a FanProbe: "attn.q" of row b goes to run b's probe as blocks.{i}.attn.q."""
    guards_nan = True

    def __init__(self, parts: list) -> None:
        self.parts = parts

    def part(self, b: int):
        return self.parts[b]

    def __call__(self, stage: str, x: Any) -> Any:
        for b, p in enumerate(self.parts):
            if p is not NO_PROBE:
                p(stage, x[b:b + 1])       # no replace hook here (engine.batch.step runs those apart)
        return x

    def need(self, stage: str) -> int:
        return max((p.need(stage) for p in self.parts), default=NONE)


class FanProbe(NoProbe):
    """The batch's probe: parts[b] is run b's probe (or NO_PROBE); positions[b] its run's position. Weights, epsilon
    and positions are NoProbe's (the batch's own): a probe that would change them runs apart (engine.batch.step)."""

    def __init__(self, probes: list, positions: list[int]) -> None:
        self.top = FanLayer([NO_PROBE if p is None else p for p in probes])
        self.parts, self.positions = self.top.parts, positions
        self.timing = any(p.timing for p in self.parts)
        self._layers: dict[int, FanLayer] = {}

    @property
    def hook_count(self) -> int:
        return sum(p.hook_count for p in self.parts if p is not NO_PROBE)

    def begin_call(self, pos0: int, device: torch.device, stats) -> None:
        for p, pos in zip(self.parts, self.positions):
            if p is not NO_PROBE:
                p.begin_call(pos, device, stats)

    def end_call(self) -> None:
        for p in self.parts:
            if p is not NO_PROBE:
                p.end_call()

    def __call__(self, name: str, x: Any) -> Any:
        return self.top(name, x)

    def need(self, name: str) -> int:
        return self.top.need(name)

    def layer(self, i: int) -> FanLayer:
        view = self._layers.get(i)
        if view is None:
            view = self._layers[i] = FanLayer([p.layer(i) for p in self.parts])
        return view

    def mark(self, label: str) -> None:
        for p in self.parts:
            if p.timing:
                p.mark(label)
