"""What Model.forward_batch talks to for a packed prefill (engine.batch.prefill; engine.forward_batch.Batch.packed):
Segments, the batch's cache (run b's rows [start_b, end_b) write their keys and values to run b's own KVCache and
attend against it exactly as its own prefill does: the run's KVCache.attend with the run's positions and masks), and
SegmentProbe, the batch's probe (every stage tensor (T, ...) cut into the runs' rows, each run's probe offered its own
rows by the same calls its own prefill makes, so that its statistics are computed from the same rows in the same way).

A run's on_progress is asked before each block, as in its own prefill, but in a thread of the run's own (Asker), and
its answer waited for at most ASK_WAIT_S (a run that takes longer is heard from at a later block from then on, so a
slow callback holds the other runs of the pack up once, by that bound): one that answers STOP is silenced from there
on (its probe is offered nothing more, as if its forward had ended there: engine.progress.Stopped) and its
cache is not advanced; the others go on. One whose on_progress raises (or whose probe or attention does: the fence of
engine.batch.rows) fails there the same way, the error its own (SegmentProbe.failed). An answer that comes after the
forward's last block is the run's to hear when it finishes (engine.batch.prefill.finish_prefill: Asker.settle, in
the run's own thread)."""
from __future__ import annotations

import queue
import threading
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
        """The forward keeps each run's last row (Segments.last_rows(T)): row b is run b's last position. What each run
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


ASK_WAIT_S = 0.25      # the longest a packed forward waits for one run's on_progress to answer a block; a run that
                       # has not answered by then is heard from at a later block from there on (Asker.slow)


class Asker:
    """One run's on_progress during a packed forward, answered in a thread of its own: ask(i) posts block i; wait(i)
    waits (at most ASK_WAIT_S) for its answer; answer is None, STOP or the exception the callback raised (the first
    such answer ends the asking: later blocks are not asked, as a run's own prefill stops asking at STOP or an
    error). slow: it once took longer than ASK_WAIT_S; the forward no longer waits for it."""

    def __init__(self, ask: Callable[[int], object]) -> None:
        self._ask, self._blocks = ask, queue.SimpleQueue()
        self._done = threading.Condition()
        self.answer: object = None
        self.answered, self.slow = -1, False
        self._thread = threading.Thread(target=self._answer, name="llmi-progress", daemon=True)
        self._thread.start()

    def _answer(self) -> None:
        while (i := self._blocks.get()) is not None:
            answer = None
            if self.answer is None:
                try:
                    answer = STOP if self._ask(i) is STOP else None
                except Exception as e:       # the run's own failure
                    answer = e
            with self._done:
                if self.answer is None:
                    self.answer = answer
                self.answered = i
                self._done.notify_all()

    def ask(self, i: int) -> None:
        self._blocks.put(i)

    def wait(self, i: int) -> None:
        """Block i's answer, waited for at most ASK_WAIT_S unless the run is slow (then: not waited for)."""
        if not self.slow:
            with self._done:
                if not self._done.wait_for(lambda: self.answered >= i, ASK_WAIT_S):
                    self.slow = True

    def close(self) -> None:
        """No more blocks (the forward has ended); the thread ends once it has answered those posted."""
        self._blocks.put(None)

    def settle(self) -> object:
        """The final answer, once every block posted is answered (waited for in the caller's thread: the run's own)."""
        self.close()
        self._thread.join()
        return self.answer


class Segments:
    """The caches of a packed prefill's runs, the forward's Cache (engine.cache_protocol): run b's tokens are rows
    probe.prompt_bounds[b] of the call, at its cache's next positions; asks[b](i): run b's on_progress before block i
    (None: nothing to ask), answered in its Asker (askers[b]; close_askers at the forward's end)."""

    def __init__(self, model, caches: list, probe: SegmentProbe, asks: list[Callable[[int], object] | None]) -> None:
        self.model, self.caches, self.probe, self.asks = model, caches, probe, asks
        self.bounds = probe.prompt_bounds
        self._last = [e - 1 for _, e in self.bounds]
        self.where = [Where(model.config, model.rope, (c.get_pos() + torch.arange(e - s)).to(model.device))
                      for c, (s, e) in zip(caches, self.bounds)]
        self.stopped = [False] * len(caches)
        self.askers = [None if ask is None else Asker(ask) for ask in asks]

    def last_rows(self, T: int) -> list[int]:
        """Each run's last row of the call's T."""
        return self._last

    def attend(self, i: int, qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p, at: Where) -> torch.Tensor:
        """Layer i: qh (H, T, hd), k, v (T, K, hd) -> z (H, T, hd), run b's rows against run b's cache alone, at its
        own positions (where[b]; `at`, the pack's, is not theirs), as its own prefill computes them (what they raise
        is run b's failure: FanLayer.fenced)."""
        return torch.cat([p.fenced(b, lambda view, b=b, s=s, e=e, cache=cache: cache.attend(
                              i, qh[:, s:e], k[s:e], v[s:e], view, self.where[b]), qh[:, s:e])
                          for b, ((s, e), cache) in enumerate(zip(self.bounds, self.caches))], dim=1)

    def on_layer(self, i: int) -> None:
        """Before block i: each run still going is asked block i in its Asker, and its answer waited for (at most
        ASK_WAIT_S; not at all for a slow one, heard at a later block): STOP silences it, and so does an on_progress
        that raised (its run's failure, probe.failed)."""
        going = [b for b, a in enumerate(self.askers) if a is not None and self._hear(b)]
        for b in going:
            self.askers[b].ask(i)
        for b in going:
            self.askers[b].wait(i)
            self._hear(b)

    def _hear(self, b: int) -> bool:
        """Run b's answers so far acted on; whether it is still going."""
        if self.stopped[b] or self.probe.failed[b] is not None:
            return False
        answer = self.askers[b].answer
        if isinstance(answer, Exception):      # run b's own failure: its thread raises it, the pack goes on
            self.probe.fail(b, answer)
            return False
        if answer is STOP:
            self.stopped[b] = True
            self.probe.silence(b)
            return False
        return True

    def close_askers(self) -> None:
        for asker in self.askers:
            if asker is not None:
                asker.close()
