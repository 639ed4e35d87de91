"""python -m engine bench --tools: each doctor's and explainer's time as a multiple of one plain generation of the
same prompt and length, in the same run.

The plain generation is the one a user waits for before asking the tool: GenerationRun of the prompt, greedy,
EOS ignored, on the fp32 model (its fastest path), for the tool's own length: the why-loop's run (64 tokens, as
before issue 33: the why-loop now diagnoses the user's run at its own length, and this is the run it is given), the
rescue's replayed tokens (8; float16 with an overflow
planted at the middle layer's mlp_out), and settings.max_new_tokens (32, the app's default run) for the tools
that read one prompt or one run (patching grid, head scan, input attribution, quantization). The quantization
scoreboard reads its own texts (engine.tools.quant_scoreboard.PROMPTS, the default a user scores, in its default
formats): its plain is the formats' plain runs, one plain generation of settings.max_new_tokens per format (each
format's copy holds float32 matrices of the model's shapes, so its plain run takes the model's time: measured once,
counted PLAIN_RUNS times).

This machine's memory speed moves minute to minute, so measurements are interleaved: plain, tool, plain, tool,
..., plain over every tool, `rounds` times; a tool's ratio in a round is its time over the mean of the plain
generations just before and just after it, and the ratio reported is the median over the rounds.

Targets (issue 21, item 11): why-loop and rescue <= 10x, every other tool <= 5x (the scoreboard: issue 47); the QK
attribution (the last layer's head 0, the prompt's last position to its first) <= 2x and steering (its vector from
one pair of prompts at the middle layer, then engine.tools.steering.steer: the plain and the steered continuation
and the per-step shift) <= 1.5x (issue 47): its two prefills on the PyTorch forward, then both runs' decode steps
in lockstep, one call of the native batched step a step (the steered row adding its vector: Probe.add), and one
forward for the plain distribution on the steered prefix after the runs part. The tuned lens (both lenses read at the prompt's last position,
engine.tools.tuned_lens.lenses_at: one forward over the prompt, like the QK split) <= 2x; its lens is the one shipped
or kept for the model's weights, else one fitted before the timing on LENS_FIT_TOKENS tokens and not kept.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

from engine.generate import GenerationRun, prompt_ids
from engine.model import Model
from engine.settings import RunSettings
from engine.tools.attribution import attribute_inputs, neutral_token
from engine.tools.patching import base_run, head_scan, patching_grid, replace_span
from engine.tools.quant import quant_report
from engine.tools.qk_attribution import qk_attribution
from engine.tools.quant_scoreboard import DEFAULT_FORMATS, PROMPTS, scoreboard
from engine.tools.rescue import MAX_NEW_TOKENS, find_rescue
from engine.tools.steering import steer, steering_vector
from engine.tools.lens_file import find_lens
from engine.tools.tuned_lens import fit_tuned_lens, lenses_at
from engine.tools.why_loop import why_loop
from engine.variants import cast_model

PROMPT = "I like apples. I like apples. I like"       # loops greedily on the bundled model (the why-loop's case)
RUN_TOKENS = 32                                       # RunSettings' default max_new_tokens
WHY_LOOP_TOKENS = 64                                  # the looping run the why-loop diagnoses
TARGETS = {"why_loop": 10.0, "rescue": 10.0, "patch_grid": 5.0, "head_scan": 5.0, "attribution": 5.0, "quant": 5.0,
           "scoreboard": 5.0, "qk": 2.0, "steering": 1.5, "tuned_lens": 2.0}
STEER = (("I love this. It is wonderful and happy.",), ("I hate this. It is awful and sad.",))   # the vector's sets
PLAIN_RUNS = {"scoreboard": len(DEFAULT_FORMATS)}     # plain generations a tool is held against (default: one)
LENS_FIT_TOKENS = 512                                 # a model without a lens: the bench's own, small, fit


def plain_seconds(model: Model, prompt: str, new_tokens: int) -> float:
    t0 = time.perf_counter()
    GenerationRun(model, prompt, max_new_tokens=new_tokens, ignore_eos=True).run()
    return time.perf_counter() - t0


def tool_jobs(model: Model, prompt: str = PROMPT, tools=tuple(TARGETS)) -> dict[str, tuple[int, Callable[[], object]]]:
    """name -> (new tokens of its plain generation, the tool's call on the prompt)."""
    settings = RunSettings(prompt=prompt, chat=False, max_new_tokens=RUN_TOKENS)
    ids = prompt_ids(model, prompt)
    target = int(model.logits(ids)[-1].argmax())
    mid = len(ids) // 2
    corrupt = replace_span(ids, mid, mid + 1, [neutral_token(model)])
    # the rescue's case: float16 with an overflow planted mid-model (as tests/model/test_rescue.py plants them); the
    # float16 copy is the user's --dtype (made once, outside the timing), not the search's work
    faults = (f"scale=1e6@blocks.{model.config.num_layers // 2}.mlp_out",)
    fp16 = cast_model(model, "float16") if "rescue" in tools else None
    loop_run = dataclasses.replace(settings, max_new_tokens=WHY_LOOP_TOKENS)
    lens = (find_lens(model) or fit_tuned_lens(model, max_tokens=LENS_FIT_TOKENS)) if "tuned_lens" in tools else None
    jobs = {"why_loop": (WHY_LOOP_TOKENS, lambda: why_loop(model, loop_run)),
            "rescue": (min(RUN_TOKENS, MAX_NEW_TOKENS),
                       lambda: find_rescue(model, fp16, settings, injections=faults)),
            "patch_grid": (RUN_TOKENS, lambda: patching_grid(model, ids, corrupt, target, heads=False)),
            "head_scan": (RUN_TOKENS, lambda: head_scan(model, ids, target, base=base_run(model, ids))),
            "attribution": (RUN_TOKENS, lambda: attribute_inputs(model, ids, target)),
            "quant": (RUN_TOKENS, lambda: quant_report(model, settings)),
            "scoreboard": (RUN_TOKENS, lambda: scoreboard(model, PROMPTS, DEFAULT_FORMATS)),
            "qk": (RUN_TOKENS, lambda: qk_attribution(model, ids, model.config.num_layers - 1, 0, len(ids) - 1, 0)),
            "steering": (RUN_TOKENS, lambda: steer(model, settings, steering_vector(
                model, *STEER, model.config.num_layers // 2), 4.0)),
            "tuned_lens": (RUN_TOKENS, lambda: lenses_at(model, ids, len(ids) - 1, lens))}
    return {k: v for k, v in jobs.items() if k in tools}


def run_tools_bench(model: Model, *, prompt: str = PROMPT, rounds: int = 3, tools=tuple(TARGETS),
                    quiet: bool = False) -> dict:
    """{<tool>_over_plain: median ratio, <tool>_seconds: median time, <tool>_target, <tool>_meets, ...}."""
    jobs = tool_jobs(model, prompt, tools)
    ratios: dict[str, list[float]] = {k: [] for k in jobs}
    seconds: dict[str, list[float]] = {k: [] for k in jobs}
    plains: dict[str, list[float]] = {k: [] for k in jobs}
    plain_seconds(model, prompt, 2)                                    # warm-up (the native copy, allocations)
    for r in range(rounds):
        for name, (n, fn) in jobs.items():
            before = plain_seconds(model, prompt, n)
            t0 = time.perf_counter()
            fn()
            took = time.perf_counter() - t0
            after = plain_seconds(model, prompt, n)
            plain = PLAIN_RUNS.get(name, 1) * (before + after) / 2
            ratios[name].append(took / plain)
            seconds[name].append(took)
            plains[name].append(plain)
            if not quiet:
                print(f"round {r + 1}/{rounds} {name:12s} {took:8.2f} s, plain {PLAIN_RUNS.get(name, 1)} x {n} "
                      f"tokens {plain:6.2f} s: "
                      f"{took / plain:6.2f}x (target {TARGETS[name]:g}x)", flush=True)
    out: dict = {"tools_prompt": prompt, "tools_rounds": rounds}
    for name in jobs:
        ratio = statistics.median(ratios[name])
        out[f"{name}_over_plain"] = ratio
        out[f"{name}_seconds"] = statistics.median(seconds[name])
        out[f"{name}_plain_seconds"] = statistics.median(plains[name])
        out[f"{name}_plain_tokens"] = jobs[name][0]
        out[f"{name}_plain_runs"] = PLAIN_RUNS.get(name, 1)
        out[f"{name}_target"] = TARGETS[name]
        out[f"{name}_meets"] = ratio <= TARGETS[name]
    return out
