"""python -m engine bench --app: the app's whole run of a long prompt against a plain generation of the same
prompt and length, in the same run (key app_run_ratio_2048).

The app's run (what pressing Run computes before the pages can show it; inspector.session.run.inspect_run and
the LiveRun around it): the generation with full inspection under the app's default settings (chat format on,
default sampler, seed 0, per-layer timing on: engine.inspection_probe(timing=True), i.e. statistics of every
stage at every step incl. attention maps' statistics, and each step's logits kept), then the run record every
page reads (engine.make_trace: loops and the first non-finite value located), then the heap trimmed
(engine.heap.trim, as the app does after each run).
The plain run: model.generate of the same prompt with the same settings and no probe, as `python -m engine
generate` runs it.

Both generate exactly `new_tokens` tokens (ignore_eos: the same length whatever the model writes). The prompt
is a text whose chat-formatted ids are exactly `n` tokens long. A round runs plain then app (odd rounds: app
then plain); its ratio is app seconds over plain seconds, and the reported figure is the median of the rounds'
own ratios (<= 1.5 is the issue's target).

Not included: what the inspector's pages compute from the record when they are opened (tables and figures of
the Overview, Activations and Timeline: inspector.views, which the engine does not import). Measured beside
this bench at 2,048 tokens they took 1-3 s, a few percent of the run.
"""
from __future__ import annotations

import statistics
import time

from engine.generate import generate, prompt_ids
from engine.heap import trim
from engine.inspection.probe import inspection_probe
from engine.inspection.trace import Trace, make_trace
from engine.settings import RunSettings

WORDS = ("the river carried small boats past the old mill while children counted the birds on the bridge and a "
         "baker opened his shop to sell warm bread to travellers who had walked since dawn").split()


def prompt_of_length(model, n: int, chat: bool = True) -> str:
    """A plain-English text whose ids as the model sees it (chat format as given) are exactly n long (or as
    close below as the tokenizer allows)."""
    words = [WORDS[i % len(WORDS)] + ("." if i % 17 == 16 else "") for i in range(2 * n)]
    lo, hi = 1, len(words)
    while lo < hi:                                 # the longest run of words that fits
        mid = (lo + hi + 1) // 2
        if len(prompt_ids(model, " ".join(words[:mid]), chat=chat)) <= n:
            lo = mid
        else:
            hi = mid - 1
    text = " ".join(words[:lo])
    for _ in range(n):                             # one short word (one token) at a time up to n
        if len(prompt_ids(model, text + " a", chat=chat)) > n:
            break
        text += " a"
    return text


def app_run(model, settings: RunSettings) -> tuple[float, Trace]:
    """Seconds of the app's run (see the module docstring) and its record."""
    t0 = time.perf_counter()
    probe = inspection_probe(timing=settings.timing)
    result = generate(model, settings.prompt, probe=probe, **settings.generation_kwargs())
    trace = make_trace(settings, result, probe, model.name, time.perf_counter() - t0)
    trim()
    return time.perf_counter() - t0, trace


def plain_run(model, settings: RunSettings):
    """Seconds of model.generate with the same settings and no probe, and its result."""
    t0 = time.perf_counter()
    result = generate(model, settings.prompt, **settings.generation_kwargs())
    return time.perf_counter() - t0, result


def app_run_ratio(model, n: int = 2048, new_tokens: int = 32, rounds: int = 3, say=print) -> dict:
    """{"app_run_ratio_<n>": median over rounds of app seconds / plain seconds, "app_run_<n>_app_s" and
    "..._plain_s": the best round's seconds, "app_run_<n>_prefill_ratio" / "..._decode_ratio": the same medians
    for the prefill and the decode alone, "app_run_rounds": [(app_s, plain_s), ...], "app_run_tokens": the
    prompt's length as run, "app_run_same_tokens": whether every app run wrote
    the plain run's tokens and kept one logits row per step}."""
    n = min(n, model.context_length - new_tokens - 1)
    settings = RunSettings(prompt=prompt_of_length(model, n), max_new_tokens=new_tokens, ignore_eos=True)
    plain_run(model, RunSettings(prompt=settings.prompt[:200], max_new_tokens=2))       # warm-up
    times, parts, same = [], [], True
    for r in range(rounds):
        if r % 2 == 0:
            p, plain = plain_run(model, settings)
            a, trace = app_run(model, settings)
        else:
            a, trace = app_run(model, settings)
            p, plain = plain_run(model, settings)
        times.append((a, p))
        ta, tp = trace.result.timings, plain.timings
        parts.append((ta["prefill"] / tp["prefill"], ta["decode"] / max(tp["decode"], 1e-9)))
        same = same and trace.result.token_ids == plain.token_ids \
            and len(trace.recording.captured("logits")) == new_tokens
        del trace
    out = {f"app_run_ratio_{n}": statistics.median(a / p for a, p in times),
           f"app_run_{n}_app_s": min(a for a, _ in times), f"app_run_{n}_plain_s": min(p for _, p in times),
           f"app_run_{n}_prefill_ratio": statistics.median(x for x, _ in parts),
           f"app_run_{n}_decode_ratio": statistics.median(y for _, y in parts),
           "app_run_rounds": times, "app_run_tokens": len(plain.prompt_ids), "app_run_same_tokens": same}
    say(f"\napp: the whole run of a {len(plain.prompt_ids):,}-token prompt and {new_tokens} new tokens (full "
        f"inspection, the run record, trim) vs engine generate: app {out[f'app_run_{n}_app_s']:.1f} s, plain "
        f"{out[f'app_run_{n}_plain_s']:.1f} s; ratio {out[f'app_run_ratio_{n}']:.2f} (prefill "
        f"{out[f'app_run_{n}_prefill_ratio']:.2f}, decode {out[f'app_run_{n}_decode_ratio']:.2f}; median of "
        f"{rounds} rounds' own ratios; target <= 1.5)")
    return out
