"""python -m engine explain | patch: why a token and not another (logit attribution, sampler stages), and
activation patching between a clean and a corrupted prompt.

Registered by the CLI package with add_commands(sub, common), `common` being the shared argument builders
(model_args, prompt_args, sampling_args, sampling_params, load). Imports are absolute so the module also
loads on its own (its tests load it by path)."""
from __future__ import annotations

import argparse
import json

from engine.cli.progress_line import progress_printer
from engine.errors import InputError
from engine.generate import GenerationRun, prompt_ids
from engine.progress import Progress
from engine.tools.explain import Explanation, explain_step, single_token
from engine.tools.patching import SITES, PatchingResult, patching_grid


def add_commands(sub, common) -> None:
    e = sub.add_parser("explain", help="why the model chose a token over another at one step: direct logit "
                                       "attribution (embedding, heads, MLPs) and the sampler stages' effects")
    common.prompt_args(e)
    common.sampling_args(e)
    common.model_args(e)
    e.add_argument("--step", type=int, default=0, help="generated step to explain (0 = the first new token)")
    e.add_argument("--target", default=None, help="token text A (default: the token chosen at that step)")
    e.add_argument("--versus", default=None, help="token text B (default: the runner-up by logit)")
    e.add_argument("--top", type=int, default=15, help="components listed in the text output")
    e.add_argument("--json", action="store_true", help="print everything as one JSON object")
    e.set_defaults(fn=lambda a: cmd_explain(a, common))

    p = sub.add_parser("patch", help="activation patching: every layer x position x site restored from a "
                                     "clean prompt into a corrupted one, and every head zeroed")
    p.add_argument("--clean", required=True, help="the clean prompt")
    p.add_argument("--corrupt", required=True, help="the corrupted prompt (the same number of tokens)")
    p.add_argument("--target", default=None, help="token text whose probability is traced "
                                                  "(default: the clean prompt's top token)")
    p.add_argument("--chat", action="store_true", help="wrap both prompts in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--allow-special", action="store_true",
                   help="let special-token text in the prompts act as control tokens")
    p.add_argument("--sites", default=",".join(SITES), help=f"comma-separated sites (default: {','.join(SITES)})")
    p.add_argument("--no-heads", action="store_true", help="skip the per-head scan")
    p.add_argument("--json", action="store_true", help="print everything as one JSON object")
    common.model_args(p)
    p.set_defaults(fn=lambda a: cmd_patch(a, common))


def _progress(p: Progress) -> None:
    """on_progress (engine.progress) printing its progress (engine.cli.progress_line); never answers STOP."""
    _LINE(p.fraction, p.what)


_LINE = progress_printer()


# ---- explain -------------------------------------------------------------------------------------------
def cmd_explain(a: argparse.Namespace, common) -> int:
    if a.step < 0:
        raise InputError(f"--step must be >= 0, got {a.step}")
    model = common.load(a)
    params = common.sampling_params(a)
    target = None if a.target is None else single_token(model, a.target, "target")
    versus = None if a.versus is None else single_token(model, a.versus, "versus")
    run = GenerationRun(model, a.prompt, params=params, max_new_tokens=a.step + 1, seed=a.seed, chat=a.chat,
                        system=a.system, allow_special=a.allow_special).run()
    if len(run.token_ids) <= a.step:
        raise InputError(f"the run stopped ({run.stop_reason}) after {len(run.token_ids)} tokens; "
                         f"step {a.step} was never reached")
    e = explain_step(model, run.prompt_ids, run.token_ids, a.step, target=target, versus=versus, params=params)
    if a.json:
        out = e.as_dict()
        out["chosen"] = {"id": run.token_ids[a.step], "text": model.tokenizer.decode([run.token_ids[a.step]])}
        out["generated_text"] = model.tokenizer.decode(run.token_ids[:a.step + 1])
        print(json.dumps(out))
    else:
        print_explanation(e, a.top)
    return 0


def print_explanation(e: Explanation, top: int) -> None:
    print(f"step {e.step} (position {len(e.ids) - 1}): A = {e.target_text!r} ({e.target}), "
          f"B = {e.versus_text!r} ({e.versus})")
    print(f"logit(A) - logit(B) = {e.logit_a:.4f} - {e.logit_b:.4f} = {e.logit_diff:.6f}")
    print(f"sum of contributions = {e.total:.6f} (residual error {e.residual_error:.2e}; "
          f"final norm scale frozen at {e.norm_scale:.4g})")
    print(f"decomposition {e.exactness}")
    print(f"\ntop {top} components (positive = favours A):")
    for name, v in sorted(e.contributions.items(), key=lambda kv: -abs(kv[1]))[:top]:
        print(f"  {name:28s} {v:+10.4f}")
    print("\nper layer:   attention       MLP")
    for i in range(e.num_layers):
        print(f"  {i:3d}      {e.attn(i):+10.4f} {e.mlp(i):+10.4f}")
    print("\nsampler stage   value A     value B     p(A)      p(B)   rank A rank B  changed")
    for s in e.sampler:
        print(f"  {s.stage:12s} {s.value_a:10.4g} {s.value_b:10.4g} {s.prob_a:9.4g} {s.prob_b:9.4g} "
              f"{s.rank_a:6d} {s.rank_b:6d}  {_what(s)}")


def _what(s) -> str:
    if s.order_changed:
        return "swapped A and B"
    return f"removed {s.removed}" if s.removed else ("yes" if s.changed else "")


# ---- patch ---------------------------------------------------------------------------------------------
def cmd_patch(a: argparse.Namespace, common) -> int:
    sites = tuple(s.strip() for s in a.sites.split(",") if s.strip())
    if not sites or any(s not in SITES for s in sites):
        raise InputError(f"--sites must name some of {', '.join(SITES)}; got {a.sites!r}")
    model = common.load(a)
    kw = dict(chat=a.chat, system=a.system, allow_special=a.allow_special)
    clean, corrupt = prompt_ids(model, a.clean, **kw), prompt_ids(model, a.corrupt, **kw)
    if a.target is None:
        target = int(model.logits(clean)[-1].argmax())
    else:
        target = single_token(model, a.target, "target")
    r = patching_grid(model, clean, corrupt, target, sites=sites, heads=not a.no_heads,
                      on_progress=None if a.json else _progress)
    if a.json:
        print(json.dumps(r.as_dict()))
    else:
        print_patching(r, model)
    return 0


def print_patching(r: PatchingResult, model) -> None:
    tok = model.tokenizer
    print(f"target {r.target_text!r} ({r.target}): p_clean = {r.p_clean:.4g}, p_corrupt = {r.p_corrupt:.4g} "
          f"({len(r.clean_ids)} tokens, {r.runs} partial runs, {r.seconds['total']:.1f} s)")
    for site, grid in r.grid.items():
        best = sorted(((p, i, t) for i, row in enumerate(grid) for t, p in enumerate(row)), reverse=True)[:5]
        cells = ", ".join(f"layer {i} pos {t} {tok.decode([r.clean_ids[t]])!r}: {p:.3g}" for p, i, t in best)
        print(f"  {site:10s} best restores: {cells}")
    if r.head_scan is not None:
        heads = sorted(((v, i, h) for i, row in enumerate(r.head_scan) for h, v in enumerate(row)),
                       key=lambda x: -abs(x[0]))[:8]
        print("  heads whose zeroing moves logit(target) most: "
              + ", ".join(f"L{i}H{h} {v:+.3f}" for v, i, h in heads))
