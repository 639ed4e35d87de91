"""The determinism doctor: does a request give one answer whoever else is running, and where do two runs' arithmetics
part? The same request is run K times alone (the first is the reference), inside batches of other runs (its forward
shared with them: a packed prefill and batched decode steps, engine.batch), on one thread and on the process's
thread count, on the other decode path (the native step off, or on where it was off), and in another dtype when the
caller gives that model. Every trial differs from the reference in one setting only, so a trial that parts from it
names its cause (its axis). Each is compared with the reference bit for bit: its tokens, each step's logits, and
every statistic of every stage (the app's full-inspection probe), in forward order; the first step whose logits
differ and by how much, and the first stage whose statistics differ, are reported. Nothing is estimated: a trial
that is bit-identical says so because every tensor compared was torch.equal.

Entry point: check_determinism(model, settings, ...) -> DeterminismReport (compare: one trial's comparison). Work is bounded (MAX_TRIAL_RUNS runs in
all, MAX_NEW_TOKENS tokens each)."""
from __future__ import annotations

import threading
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch

from engine.accelerator import PLAIN
from engine.batch import StepBarrier
from engine.errors import InputError
from engine.generate import GenerationRun
from engine.inspection.probe import inspection_probe
from engine.model import Model
from engine.progress import OnProgress, tell_units
from engine.settings import RunSettings
from engine.threads import one_thread

MAX_REPEATS = 8
MAX_BATCH = 30
MAX_TRIAL_RUNS = 80            # every run of every trial, the batches' other runs counted
MAX_NEW_TOKENS = 64
# The other users of a batch: prompts of different lengths, each leaving after its own number of tokens.
OTHERS = ("Hi", "Write a short poem about the sea.", "List three prime numbers and say why each is prime.",
          "The history of the bicycle, in one paragraph:", "Translate 'good morning' into French and Spanish.",
          "def fibonacci(n):", "What is the capital of Australia, and why is it not Sydney?",
          "Once upon a time, in a village at the edge of a forest, there lived")
WHY = {"repeat": "the same request run again, alone",
       "batch": "its forward shared with {n} other runs (a packed prefill and batched decode steps)",
       "threads": "one thread instead of {n}",
       "path": "the {path} instead of the {ref_path}",
       "dtype": "{dtype} instead of {ref_dtype}"}


@dataclass
class DeterminismTrial:
    label: str
    axis: str                        # the one setting in which it differs from the reference (WHY's keys)
    why: str
    token_ids: list[int]
    text: str
    same_tokens: bool
    bit_identical: bool              # tokens, every step's logits and every statistic torch.equal to the reference
    first_step: int | None = None    # the first step whose logits differ from the reference's
    logits_max_abs: float = 0.0      # ... the largest difference there
    first_stage: dict | None = None  # the first statistic (forward order) that differs: step, stage, position, by
    notes: list[str] = field(default_factory=list)


@dataclass
class DeterminismReport:
    prompt: str
    reference: str                   # how the reference ran (path, threads, dtype)
    token_ids: list[int]
    text: str
    trials: list[DeterminismTrial]
    skipped: list[str]               # axes not tried here, and why

    @property
    def distinct_outputs(self) -> int:
        """Distinct token sequences among the reference and the trials in its dtype."""
        return len({tuple(self.token_ids)} | {tuple(t.token_ids) for t in self.trials if t.axis != "dtype"})

    @property
    def headline(self) -> str:
        same = [t for t in self.trials if t.axis != "dtype"]
        exact = sum(t.bit_identical for t in same)
        parted = sorted({t.axis for t in same if not t.bit_identical})
        head = (f"{len(same) + 1} runs, {self.distinct_outputs} distinct output(s); {exact + 1} of {len(same) + 1} "
                f"bit-identical to the reference")
        return head + (f"; parted by: {', '.join(parted)}" if parted else "")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["distinct_outputs"], d["headline"] = self.distinct_outputs, self.headline
        return d


def check_determinism(model: Model, settings: RunSettings, *, repeats: int = 3, batches: tuple[int, ...] = (2, 8),
                      threads: bool = True, paths: bool = True, other_dtype: Model | None = None,
                      on_progress: OnProgress | None = None) -> DeterminismReport:
    """The request of `settings` on `model`: the reference alone, then (repeats - 1) more alone, one trial in a batch
    of each size in `batches` (the request and n - 1 other runs), one on one thread (threads, where the process has
    more), one on the other decode path (paths), one on other_dtype (the same weights in another dtype)."""
    if not isinstance(settings, RunSettings):
        raise InputError(f"settings must be RunSettings, got {type(settings).__name__}")
    if not 1 <= settings.max_new_tokens <= MAX_NEW_TOKENS:
        raise InputError(f"the determinism check runs at most {MAX_NEW_TOKENS} new tokens, got "
                         f"{settings.max_new_tokens}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or not 1 <= repeats <= MAX_REPEATS:
        raise InputError(f"repeats must be a whole number in 1..{MAX_REPEATS}, got {repeats!r}")
    if any(isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= MAX_BATCH for n in batches):
        raise InputError(f"batch sizes must be whole numbers in 2..{MAX_BATCH}, got {list(batches)}")
    if repeats + sum(batches) + 3 > MAX_TRIAL_RUNS:
        raise InputError(f"{repeats + sum(batches) + 3} runs asked; the check runs at most {MAX_TRIAL_RUNS}")
    if other_dtype is not None and other_dtype.config != model.config:
        raise InputError("other_dtype must be the same model in another dtype")
    plan, skipped = _plan(model, repeats, batches, threads, paths, other_dtype)
    total = len(plan) + 1
    tell_units(on_progress, 0, total, "the reference, alone")
    ref = _alone(model, settings)
    trials = []
    for k, (label, axis, why, runner) in enumerate(plan, start=1):
        tell_units(on_progress, k, total, label)
        trials.append(compare(ref, runner(settings), label, axis, why))
    tell_units(on_progress, total, total, "done")
    return DeterminismReport(prompt=settings.prompt, reference=_describe(model), token_ids=list(ref.token_ids),
                             text=ref.result().text, trials=trials, skipped=skipped)


def _plan(model: Model, repeats: int, batches, threads: bool, paths: bool, other_dtype: Model | None):
    """The trials, as (label, axis, why, runner(settings) -> finished GenerationRun), and the axes skipped."""
    plan, skipped = [], []
    for k in range(2, repeats + 1):
        plan.append((f"alone #{k}", "repeat", WHY["repeat"], lambda s: _alone(model, s)))
    for n in batches:
        plan.append((f"in a batch of {n}", "batch", WHY["batch"].format(n=n - 1),
                     lambda s, n=n: _in_batch(model, s, n)))
    count = torch.get_num_threads()
    if threads and count > 1:
        plan.append(("1 thread", "threads", WHY["threads"].format(n=count), lambda s: _alone(model, s, one=True)))
    elif threads:
        skipped.append("threads: this process computes on one thread already")
    if paths:
        native = model.accelerator.decode is not None
        other = model.with_accelerator(PLAIN) if native else None
        if other is not None:
            plan.append(("PyTorch forward", "path", WHY["path"].format(path="PyTorch forward",
                                                                      ref_path="native decode step"),
                         lambda s: _alone(other, s)))
        else:
            skipped.append(f"path: the native decode step does not run this model ({model.accelerator.why_not})")
    if other_dtype is not None:
        plan.append((_dtype(other_dtype), "dtype", WHY["dtype"].format(dtype=_dtype(other_dtype),
                                                                    ref_dtype=_dtype(model)),
                     lambda s: _alone(other_dtype, s)))
    return plan, skipped


def _dtype(model: Model) -> str:
    return str(model.dtype).removeprefix("torch.")


def _describe(model: Model) -> str:
    path = "native decode step" if model.accelerator.decode is not None else "PyTorch forward"
    return f"alone, {path}, {torch.get_num_threads()} thread(s), {_dtype(model)} on {model.device.type}"


def _run(model: Model, settings: RunSettings, prompt: str | None = None, new: int | None = None) -> GenerationRun:
    kw = settings.generation_kwargs()
    if new is not None:
        kw.update(max_new_tokens=new, ignore_eos=True)
    return GenerationRun(model, settings.prompt if prompt is None else prompt, probe=inspection_probe(timing=False),
                         **kw)


def _alone(model: Model, settings: RunSettings, one: bool = False) -> GenerationRun:
    run = _run(model, settings)
    with one_thread() if one else nullcontext():
        run.run()
    return run


def _in_batch(model: Model, settings: RunSettings, n: int) -> GenerationRun:
    """The request and n - 1 other runs (OTHERS' prompts, each its own length and number of tokens, so that they
    leave at different steps), started together and driven by one StepBarrier, one thread a run."""
    runs = [_run(model, settings)] + [_run(model, settings, OTHERS[k % len(OTHERS)],
                                           max(1, settings.max_new_tokens - 3 * k)) for k in range(n - 1)]
    barrier, gate, errors = StepBarrier(max_rows=max(2, n)), threading.Barrier(n), []

    def work(run: GenerationRun) -> None:
        gate.wait()
        try:
            barrier.drive(run)
        except Exception as e:      # noqa: BLE001  (reported below, in the caller's thread)
            errors.append(e)
    threads = [threading.Thread(target=work, args=(r,), name="llmi-determinism") for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return runs[0]


def compare(ref: GenerationRun, got: GenerationRun, label: str = "", axis: str = "", why: str = "") -> DeterminismTrial:
    """got against ref, both finished runs with the app's full-inspection probe: tokens, then each step's logits in
    step order, then every statistic record in forward order, each torch.equal or the first that is not."""
    same_tokens = got.token_ids == ref.token_ids
    trial = DeterminismTrial(label=label, axis=axis, why=why, token_ids=list(got.token_ids), text=got.result().text,
                  same_tokens=same_tokens, bit_identical=False)
    if axis == "batch":
        trial.notes.append(f"{got.batched_steps} of its decode steps shared a forward with other runs")
    a, b = ref.probe.recording.captured("logits"), got.probe.recording.captured("logits")
    for x, y in zip(a, b):
        if x.value.shape != y.value.shape or not torch.equal(x.value, y.value):
            trial.first_step = x.step
            if x.value.shape == y.value.shape:
                trial.logits_max_abs = float((x.value.float() - y.value.float()).abs().max())
            break
    ra, rb = ref.probe.recording.stat_records(), got.probe.recording.stat_records()
    for x, y in zip(ra, rb):
        if (x.step, x.name, x.pos0) != (y.step, y.name, y.pos0):
            trial.first_stage = {"step": x.step, "stage": x.name, "position": x.pos0, "by": None,
                                 "note": "the runs' records part here (another token was drawn before)"}
            break
        if not torch.equal(x.values, y.values):
            d = (x.values.float() - y.values.float()).abs().nan_to_num(0.0)
            row = int(d.max(1).values.argmax())
            scale = float(x.values[row].float().abs().nan_to_num(0.0).max())
            trial.first_stage = {"step": x.step, "stage": x.name, "position": x.pos0 + row,
                                 "by": float(d[row].max()), "relative": float(d[row].max()) / scale if scale else None}
            break
    trial.bit_identical = (same_tokens and trial.first_step is None and trial.first_stage is None
                           and len(a) == len(b) and len(ra) == len(rb))
    return trial
