"""What Model.forward_segments talks to for a packed prefill (engine.batch.prefill): Segments, the batch's cache
(run b's rows [start_b, end_b) write their keys and values to run b's own KVCache and attend against it exactly as
its own prefill does: Model.attend with the run's positions and mask), and SegmentProbe, the batch's probe (every
stage tensor (T, ...) cut into the runs' rows, each run's probe offered its own rows by the same calls its own
prefill makes, so that its statistics are computed from the same rows in the same way).

A run's on_progress is asked before each block, as in its own prefill; one that answers STOP is silenced from that
block on (its probe is offered nothing more, as if its forward had ended there: engine.progress.Stopped) and its
cache is not advanced; the others go on. One whose on_progress raises (or whose probe or attention does: the fence of
engine.batch.rows) fails there the same way, the error its own (SegmentProbe.failed)."""
from __future__ import annotations

from typing import Callable

import torch

from engine.attention import Where
from engine.batch.rows import FanProbe
from engine.batch.shared_stats import SharedStats
from engine.inspection.probe_views import NO_PROBE
from engine.progress import STOP


class SegmentProbe(FanProbe):
    """The batch's probe: FanProbe over the runs' prompts (parts[b]: run b's probe, its rows prompt_bounds[b], from
    position positions[b]); the statistics of each stage computed once over every run's rows and each run handed its
    own (the same per-row statistics its own prefill computes). Weights, epsilon and positions are the batch's own:
    a probe that would change them is not packed (engine.batch.prefill.prefill_reason). After move_to (the forward
    kept each run's last row) run b's row is b."""

    def __init__(self, probes: list, lengths: list[int], positions: list[int]) -> None:
        ends = torch.tensor(lengths).cumsum(0).tolist()
        self.prompt_bounds = [(e - n, e) for n, e in zip(lengths, ends)]     # run b's rows of the call
        super().__init__(probes, positions, self.prompt_bounds)
        self._stats_backend = None

    def begin_call(self, pos0: int, device: torch.device, stats) -> None:
        self._stats_backend = stats
        super().begin_call(pos0, device, stats)

    def silence(self, b: int) -> None:
        """Run b's forward has ended (its on_progress answered STOP): its call ends here, as its own forward's would,
        and its probe is offered nothing more."""
        p = self.parts[b]
        if p is not NO_PROBE:
            self.close(b)
            if self.parts[b] is not NO_PROBE:
                self.guard(b, p.end_call)
            self.drop(b)

    def move_to(self, pos0: int) -> None:
        """The forward keeps each run's last row (Segments.last_rows): row b is run b's last position. What each run
        was told so far is handed to it at its prompt's positions first."""
        for b, p in enumerate(self.parts):
            if p is not NO_PROBE:
                self.close(b)
                s, e = self.prompt_bounds[b]
                if self.parts[b] is not NO_PROBE:
                    self.guard(b, p.move_to, self.positions[b] + e - s - 1)
        self.bounds = [(b, b + 1) for b in range(len(self.parts))]
        self.shared = SharedStats()              # one row a run from here on
        self.shared.batcher.backend = self._stats_backend


class Segments:
    """The caches of a packed prefill's runs: run b's tokens are rows probe.prompt_bounds[b] of the call, at its
    cache's next positions; asks[b](i): run b's on_progress before block i (None: nothing to ask)."""

    def __init__(self, model, caches: list, probe: SegmentProbe, asks: list[Callable[[int], object] | None]) -> None:
        self.model, self.caches, self.probe, self.asks = model, caches, probe, asks
        self.bounds = probe.prompt_bounds
        self.last_rows = [e - 1 for _, e in self.bounds]
        self.where = [Where(model.config, model.rope, (c.get_pos() + torch.arange(e - s)).to(model.device))
                      for c, (s, e) in zip(caches, self.bounds)]
        self.stopped = [False] * len(caches)

    def attend(self, i: int, qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p) -> torch.Tensor:
        """Layer i: qh (H, T, hd), k, v (T, K, hd) -> z (H, T, hd), run b's rows against run b's cache alone (what
        they raise is run b's failure: FanLayer.fenced)."""
        return torch.cat([p.fenced(b, lambda view, b=b, s=s, e=e, cache=cache: self.model.attend(
                              view, qh[:, s:e].transpose(0, 1), k[s:e], v[s:e], cache, i, self.where[b]), qh[:, s:e])
                          for b, ((s, e), cache) in enumerate(zip(self.bounds, self.caches))], dim=1)

    def on_layer(self, i: int) -> None:
        """Before block i (== layers: the forward's end): each run still going is asked; STOP silences it, and so
        does an on_progress that raises (its run's failure: probe.failed)."""
        for b, ask in enumerate(self.asks):
            if ask is None or self.stopped[b] or self.probe.failed[b] is not None:
                continue
            try:
                answer = ask(i)
            except Exception as e:      # run b's own failure: its thread raises it, the pack goes on
                self.probe.fail(b, e)
                continue
            if answer is STOP:
                self.stopped[b] = True
                self.probe.silence(b)
