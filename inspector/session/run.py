"""One inspected run for the app: the user's RunSettings checked against the server's limits, a device
slot, then the engine's generation with full inspection, kept as the one run record (engine.Trace).

This is the code path every page (and the concurrency tests) use: the model is shared, the probe, cache,
RNG and result belong to this run alone. Before the engine sees a request it is checked against the
server's limits (session.limits) and then waits for a device slot (session.admission).

Nothing at module level holds a run: a record lives exactly as long as the session (or caller) that
keeps it. `live_runs()` counts the records still alive through weak references, which never keep one.
"""
from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from typing import Callable

from engine import Model, RunSettings, Step, Trace, inspection_probe, make_trace
from engine.batch import shared_barrier
from engine.generate import GenerationRun, prompt_ids
from engine.progress import OnProgress

from .admission import Admission, shared_admission
from .limits import LimitError, Limits, check_text, env_name
from .run_memory import run_bytes, runs_budget

_live: "weakref.WeakSet[Trace]" = weakref.WeakSet()
_generated = 0                         # generations started in this process (generations())
_generated_lock = threading.Lock()


def track(trace: Trace) -> Trace:
    """Count a run record as alive (weakly: counting never keeps one) and return it."""
    _live.add(trace)
    return trace


def live_runs() -> int:
    """Run records alive in this process (all sessions), counted without keeping any alive."""
    return len(_live)


def records() -> list[Trace]:
    """The run records alive in this process now (all sessions): a list the caller holds only while it looks."""
    return list(_live)


def generations() -> int:
    """Generations this process has started on a model (every session together): what a room's students
    should never add to while they follow the teacher."""
    return _generated


@dataclasses.dataclass(frozen=True)
class Checked:
    """A request checked against the server's limits (check_settings makes it, once per Run): the settings safe to
    hand to the engine, notes for the user, and the prompt's token ids as the model sees them (tokenised once:
    the estimate counts them and the generation starts from them)."""
    settings: RunSettings
    notes: tuple[str, ...]
    prompt_ids: tuple[int, ...]
    tokenize_s: float                  # what tokenising took (the run's timings report it as its tokenize time)


def check_settings(model: Model, settings: RunSettings, limits: Limits) -> Checked:
    """The request checked once, before any device work or queueing; PromptError / LimitError / InputError (each an
    engine InputError naming what is wrong)."""
    prompt, notes = check_text(settings.prompt, limits, "prompt")
    system = settings.system
    if system is not None:
        system, more = check_text(system, limits, "system message", allow_empty=True)
        notes += more
    n_new = settings.max_new_tokens
    if isinstance(n_new, int) and not isinstance(n_new, bool) and n_new > limits.max_new_tokens:
        raise LimitError(f"{n_new:,} new tokens asked for; this server generates at most {limits.max_new_tokens:,} "
                         f"per run ({env_name('max_new_tokens')})")
    settings = dataclasses.replace(settings, prompt=prompt, system=system)
    t0 = time.perf_counter()
    ids = prompt_ids(model, prompt, chat=settings.chat, system=system, allow_special=settings.allow_special)
    tokenize_s = time.perf_counter() - t0
    if len(ids) > limits.max_prompt_tokens:
        raise LimitError(f"the prompt is {len(ids):,} tokens long (as the model sees it); this server accepts at "
                         f"most {limits.max_prompt_tokens:,} ({env_name('max_prompt_tokens')})")
    if not settings.allow_special:
        special = sorted(set(model.tokenizer.special_texts(prompt)))
        if special:
            notes.append(f"The prompt contains special-token text ({', '.join(special[:5])}); it was read as plain "
                         "text. Turn on 'Special-token text in the prompt acts as control tokens' to use it as "
                         "control tokens.")
    return Checked(settings, tuple(notes), tuple(ids), tokenize_s)


def _count_generation() -> None:
    global _generated
    with _generated_lock:
        _generated += 1


def inspect_run(model: Model, request: RunSettings | Checked, on_token: Callable[[Step], object] | None = None, *,
                on_progress: OnProgress | None = None, limits: Limits | None = None,
                on_queue: Callable[[int], None] | None = None, admission: Admission | None = None,
                client: str | None = None) -> Trace:
    """Check the request (unless check_settings already did: a Checked), wait for a device slot and room for what the
    run will hold (session.run_memory; on_queue(position) while waiting), generate with full inspection from the
    checked prompt ids (on_token(step) after each token,
    on_progress(Progress) during the prefill; either may answer STOP). Limits default to the environment's,
    admission to the process-wide queue; client (who asks, for the queue's per-browser turns) to what the app's
    resolver says in this thread."""
    limits = limits or Limits.from_env()
    checked = request if isinstance(request, Checked) else check_settings(model, request, limits)
    settings = checked.settings
    admission = admission or shared_admission(limits, runs_budget(limits, model.device))
    n_new = settings.max_new_tokens if isinstance(settings.max_new_tokens, int) else limits.max_new_tokens
    need = run_bytes(model, len(checked.prompt_ids), n_new)
    with admission.slot(on_wait=on_queue, timeout=limits.queue_timeout_s, client=client, need=need):
        probe = inspection_probe(timing=settings.timing)
        _count_generation()
        t0 = time.perf_counter()
        run = GenerationRun(model, list(checked.prompt_ids), probe=probe, on_token=on_token, on_progress=on_progress,
                            **settings.generation_kwargs())
        result = shared_barrier(limits.max_batch_rows).drive(run)     # decode steps batched with other runs
        seconds = time.perf_counter() - t0
    result.timings["tokenize"] = checked.tokenize_s          # tokenised once, by the check, not by the engine again
    shared = run.batched_steps or run.packed_prefill
    notes = list(checked.notes) + ([batched_note(run.batched_steps, run.packed_prefill, model.device.type)]
                                   if shared else [])
    return track(make_trace(settings, result, probe, model.name, seconds, notes=notes))


def batched_note(steps: int, packed_prefill: bool = False, device: str = "cpu") -> str:
    """What a run whose decode steps were batched with other runs', or whose prompt was prefilled with theirs, says
    about its arithmetic (engine.batch): on the CPU, that of the run alone, bit for bit (batch invariance:
    tests/unit/test_batch_invariance.py); on an accelerator, within float rounding of it."""
    said = ([f"{steps} of this run's decode steps shared one forward with other runs'"] if steps else []) + \
        (["its prompt was prefilled in one forward with other runs' prompts"] if packed_prefill else [])
    what = " and ".join(said)
    head = f"{what[0].upper()}{what[1:]} (this server batches the runs in flight)."
    if device == "cpu":
        return (f"{head} Its tokens, logits and statistics are those of the run alone, bit for bit: every row is "
                "computed by the same kernels in the same order whatever runs share its forward (at this server's "
                "thread count; the exception: a batched native step in which some row meets a NaN or Inf is redone "
                "on the PyTorch forward for every row).")
    return (f"{head} On {device} its logits and statistics may differ from the run alone by float rounding (measured "
            "on the CPU before batch invariance: up to about 1e-4 in logits, 1e-3 in a stage's statistics), so a "
            f"near tie could draw another token. A server started with {env_name('max_batch_rows')}=1 gives every "
            "run its own arithmetic, bit for bit.")
