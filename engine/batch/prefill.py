"""Packed prefills: the prompts of runs that wait for their prefill at the same moment go through one forward
(Model.forward_batch over Batch.packed): every matmul reads the weights once for all their rows (this 2-core CPU: ~230
GFLOP/s for one prompt's forty rows, ~370 at a thousand), each run's attention is computed against its own cache and
its probe is offered its own rows (engine.batch.segments), and each run's on_progress is asked before every block as
in its own prefill (a STOP ends that run alone). Then each run finishes its prefill step (sampling, detokenizing,
on_token) with its own logits row, in its own thread.

    gate = PrefillGate()
    step = gate.prefill(run)      # run's prefill step (prefill_reason(run) is None), packed with those waiting
    steps = prefill_together(runs)         # or in one thread: one forward, then each run's step

Who waits: the first run to arrive while no packed prefill is under way leads at once (a run alone never waits and
is prefilled exactly as alone, by its own step); the runs that arrive while it computes wait, and the first of them
then leads them all (up to PACK_TOKENS prompt rows; the rest wait for the next). Arithmetic: each row's values
come from the same operations as in its own prefill, except that the matmuls run over more rows, which a kernel may
sum in another order (measured in tests/unit/test_packed_prefill.py and tests/model/test_batch_bundled.py);
max_rows=1 on the barrier (the server's exact switch) prefills and steps every run alone.

One run's own failure (its on_progress, its probe, its sampler, its on_token) ends that run only: pack_forward keeps
the other runs' rows (engine.batch.segments). What follows the packed forward for each run (its cache advanced, its
last progress report, its sampling, its on_token: finish_prefill) is done in its own thread once the gate has handed
it its row, so that a slow callback there holds up no other run's prefill. A run that comes while a prefill is under
way waits for it at most PREFILL_WAIT_S (a slow on_progress in it), then the waiting runs' prefill goes beside it.
A packed run's on_progress before each block is answered in a thread of the run's own (engine.batch.segments.Asker)
and waited for at most ASK_WAIT_S (0.25 s), so a slow one there holds up the other runs of the pack once, by that
bound; a slow run's answer (STOP, or what it raised) is heard at a later block, or, after the last, when the run
finishes (finish_prefill waits for its own callbacks, in its thread)."""
from __future__ import annotations

import threading
import time

import torch

from engine.batch.segments import SegmentProbe, Segments
from engine.batch.step import Outcome, guarded, shared_forward_reason
from engine.forward_batch import Batch
from engine.generate import GenerationRun
from engine.matmul import PREFILL_TILE, TILED_ROWS, tiled
from engine.progress import PREFILL_CHUNK, STOP, Stopped
from engine.results import Step

PACK_TOKENS = PREFILL_CHUNK     # the most prompt rows in one packed forward (a long prompt's chunk)
PREFILL_WAIT_S = 1.0            # the longest a run waits for a prefill under way (at the gate, to be packed after
                                # it; at the step barrier, for its runs to join a step): then it goes on beside it


def prefill_reason(run: GenerationRun) -> str | None:
    """Why this run's next step cannot be packed with other runs' prefills (None: it can)."""
    if run.prefill_input() is None:
        return "its next step is no prefill in one piece on its cache"
    if len(run.prefill_input()) == 1:
        return ("its prompt is one position after any template opening: alone, its products are one-row products "
                "(engine.matmul's decode tiles), so it is prefilled alone")
    if len(run.prefill_input()) > TILED_ROWS:
        return (f"its prompt ({len(run.prefill_input())} positions after any template opening) is longer than "
                f"{TILED_ROWS}: its products are one untiled product alone (engine.matmul), so it is prefilled alone")
    return shared_forward_reason(run)


def prefill_together(runs: list[GenerationRun]) -> list[Outcome]:
    """Each run's prefill step (runs: prefill_reason None, one model), in order: its Step, None (it stopped), or the
    exception its step raised: pack_forward, then each run's finish_prefill."""
    rows, seconds, askers = pack_forward(runs)
    return [row if failed(row) else guarded(finish_prefill, run, row, seconds, asker)
            for run, row, asker in zip(runs, rows, askers)]


def pack_forward(runs: list[GenerationRun]) -> tuple[list[torch.Tensor | Stopped | BaseException], float, list]:
    """The forward half of a packed prefill (runs: prefill_reason None, one model) -> (rows, seconds, askers): rows[b]
    run b's logits row (V,), Stopped (its on_progress answered STOP in the forward), or the exception that is its
    outcome; askers[b] the Asker that answered its on_progress in the forward (None: it has none, or never got to
    it); run b then finishes with finish_prefill(runs[b], rows[b], seconds, askers[b]), in any thread (the gate: the
    run's own). A failed forward (memory) is every run's exception, with no cache advanced. A run's own failure is its
    outcome alone: its preparation's leaves it out of the forward; its on_progress's or its probe's in the forward
    (engine.batch.segments, the fence of engine.batch.rows) leaves its cache where it was while the other runs' rows
    stand."""
    model = runs[0].model
    if any(r.model is not model for r in runs):
        raise ValueError("runs of one packed prefill must share one model")
    rows: list = [guarded(_prepare, run) for run in runs]
    askers: list = [None] * len(runs)
    go = [b for b, o in enumerate(rows) if o is None]       # the runs whose preparation went through
    if not go:
        return rows, 0.0, askers
    batch = [runs[b] for b in go]
    prompts = [r.prefill_input() for r in batch]
    lengths, starts = [len(p) for p in prompts], [r.cache.get_pos() for r in batch]
    probe = SegmentProbe([r.probe for r in batch], lengths, starts)
    segments = Segments(model, [r.cache for r in batch], probe,
                        [r.prefill_ask if r.on_progress is not None else None for r in batch])
    positions = torch.cat([p + torch.arange(n) for p, n in zip(starts, lengths)])
    for g, b in enumerate(go):
        askers[b] = segments.askers[g]
    t0 = time.perf_counter()
    try:
        with tiled(PREFILL_TILE):    # each prompt's products as its lone prefill's (engine.matmul: tiles of 16)
            logits = model.forward_batch(Batch.packed(torch.tensor([t for p in prompts for t in p]), positions,
                                                      segments, probe, model.device))
    except Exception as e:
        return [e if o is None else o for o in rows], time.perf_counter() - t0, askers
    finally:
        segments.close_askers()
    for g, b in enumerate(go):
        rows[b] = probe.failed[g] if probe.failed[g] is not None else Stopped() if segments.stopped[g] else logits[g]
    return rows, time.perf_counter() - t0, askers


def failed(row) -> bool:
    """Whether a row of pack_forward is its run's failure (not its logits, nor the Stopped its STOP made)."""
    return isinstance(row, BaseException) and not isinstance(row, Stopped)


def _prepare(run: GenerationRun) -> None:
    """A run's own part of a packed prefill before its forward: room in its cache, its template opening in it (copied
    from the prefix cache or computed by its own forward, as alone: GenerationRun.fill_prefix; a STOP there is its
    outcome), its probe told the step. The packed forward then covers prefill_input(), from the cache's position."""
    run.cache.check_room(len(run.prompt_ids))
    run.fill_prefix()
    if run.probe is not None:
        run.probe.step = 0


def finish_prefill(run: GenerationRun, got: torch.Tensor | Stopped, seconds: float, asker=None) -> Step | None:
    """A run's prefill step after its packed forward (pack_forward's row and asker): its own on_progress's answers in
    the forward settled (waited for here, in the caller's thread: a STOP heard late stops it, what it raised is
    raised), its cache advanced over its prompt (unless it stopped), its on_progress asked after the last block as
    its own prefill asks it, then its step (sampling, on_token)."""
    late = None if asker is None or isinstance(got, Stopped) else asker.settle()
    if isinstance(late, Exception):
        raise late                      # its own failure: its cache not advanced
    if late is STOP:
        got = Stopped()
    if not isinstance(got, Stopped):
        run.cache.advance(len(run.prefill_input()))      # the rows of its packed forward (after the opening)
        if run.on_progress is not None and run.prefill_ask(run.model.config.num_layers) is STOP:
            got = Stopped()
    return run.step(got, seconds=seconds)


class _Waiter:
    """A run waiting at the gate: outcome (a Step or None of a prefill alone, or a row of pack_forward, with seconds),
    done, wake."""
    __slots__ = ("run", "outcome", "seconds", "asker", "done", "wake")

    def __init__(self, run: GenerationRun) -> None:
        self.run, self.outcome, self.seconds, self.done, self.wake = run, None, 0.0, False, threading.Event()
        self.asker = None


class PrefillGate:
    """Runs waiting for their prefill (see the module docstring). packs / packed: packed forwards taken and the
    runs they served (a run prefilled alone counts in neither)."""

    def __init__(self, pack_tokens: int = PACK_TOKENS, wait_s: float = PREFILL_WAIT_S) -> None:
        """wait_s: how long the first waiting run waits for the prefill under way before it leads the waiting runs'
        prefill beside it (a slow callback in the one under way holds up no run that came after it)."""
        self.pack_tokens, self.wait_s = pack_tokens, wait_s
        self._lock = threading.Lock()
        self._waiting: list[_Waiter] = []
        self._leader: _Waiter | None = None
        self.packs = self.packed = 0
        self.serves = 0        # prefills begun (alone or packed): which one is under way
        self.serving = 0       # runs whose prefill is under way (until each is handed its row or step): the decode
                               # barrier's leader waits for them to join its next step (engine.batch.barrier)

    @property
    def waiting(self) -> int:
        """Runs waiting for their prefill (the one under way not counted)."""
        return len(self._waiting)

    def prefill(self, run: GenerationRun) -> Step | None:
        """`run`'s prefill step (prefill_reason(run) is None), packed with the prefills waiting beside it. What
        follows its forward (its last progress report, its sampling, its on_token) is done here, in the caller's
        thread: the one that leads waits on no other run's callbacks."""
        me = _Waiter(run)
        with self._lock:
            self._waiting.append(me)
            if self._leader is None:
                self._leader = me
        while not me.done:
            if self._leader is me:
                self._serve(me)
            elif me.wake.wait(self.wait_s):
                me.wake.clear()
            else:
                self._take_over(me)
        if isinstance(me.outcome, (torch.Tensor, Stopped)):       # its row of a packed forward
            return finish_prefill(run, me.outcome, me.seconds, me.asker)
        if isinstance(me.outcome, BaseException):
            raise me.outcome
        run.tell_token(me.outcome)
        return me.outcome

    def _take_over(self, me: _Waiter) -> None:
        """me waited wait_s: if it is the first waiting and the prefill under way is still going (a slow callback in
        it), me leads the waiting runs beside it."""
        with self._lock:
            if self._waiting and self._waiting[0] is me and (self._leader is None or self._leader not in self._waiting):
                self._leader = me

    def _serve(self, me: _Waiter) -> None:
        """(Leading) the waiting runs' prefills, first come first, up to pack_tokens prompt rows (at least one run);
        then the lead passes to the first run still waiting (unless another took it over meanwhile)."""
        with self._lock:
            batch, rows = [], 0
            while self._waiting and (not batch or rows + len(self._waiting[0].run.prefill_input()) <= self.pack_tokens):
                batch.append(self._waiting.pop(0))
                rows += len(batch[-1].run.prefill_input())
            self.serving, self.serves = self.serving + len(batch), self.serves + 1
        try:
            seconds, askers = 0.0, [None] * len(batch)
            if len(batch) == 1:
                outcomes = [guarded(batch[0].run.step, tell=False)]
            else:
                outcomes, seconds, askers = pack_forward([w.run for w in batch])
                self.packs, self.packed = self.packs + 1, self.packed + len(batch)
        except BaseException as e:     # an interrupt in the leader: every run of the batch hears it
            outcomes = [e] * len(batch)
        with self._lock:
            for w, outcome, asker in zip(batch, outcomes, askers):
                w.outcome, w.seconds, w.asker, w.done = outcome, seconds, asker, True
                w.wake.set()
            self.serving -= len(batch)
            if self._leader is me:
                self._leader = self._waiting[0] if self._waiting else None
                if self._leader is not None:
                    self._leader.wake.set()
