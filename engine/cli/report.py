"""python -m engine report: one run as a self-contained HTML report (engine.report.html), made from the same flags as
`python -m engine trace` (or from a saved trace), with the command that reproduces it inside.

    python -m engine report "PROMPT" [generation flags] [--inject KIND@STAGE[:N]]... [--layers 0,15,-1]
                            [--steps 0,5,-1] [--trace run.trace] --out run.html
    python -m engine report --from-trace run.trace [--layers ...] [--steps ...] --out run.html
                            [--tool-json qk.json]...

--tool-json: a tool's own --json output (qk, steer, quant-scoreboard, doctor --determinism), shown in a Tools
section (engine.report.tools checks it as input).

--layers / --steps: whole numbers separated by commas (negative counts from the end), 'all' or 'none';
default first, middle and last. Prints one JSON line: out, bytes, seconds (run), build_seconds (report).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from engine.cli.args import SAMPLER_FLAGS, load, model_args, prompt_args, run_settings, sampling_args
from engine.cli.debug import debug_args, faults_of, generation_kwargs
from engine.errors import InputError
from engine.inspection.trace import Trace, load_trace, make_trace, save_trace
from engine.inspection.trace_check import TraceBounds
from engine.report.data import attention_maps, default_layers, parse_indices, resolve_indices
from engine.report.html import build_html
from engine.report.tools import read_tool_json
from engine.sampling import SamplingParams
from engine.sources import BUNDLED_NAME
from engine.tools.doctor import fault_probe, run_doctor

REPORT_ONLY = ("out", "layers", "steps", "from_trace", "trace", "model", "device", "dtype", "prompt", "fn")


def add_commands(sub) -> None:
    r = sub.add_parser("report", help="one run as a self-contained HTML report (opens with no network)")
    prompt_args(r, optional=True), sampling_args(r), model_args(r), debug_args(r)   # --from-trace: no prompt
    r.add_argument("--layers", default=None, help="attention maps of these layers, e.g. 0,15,-1, 'all' or "
                                                  "'none' (default: first, middle, last)")
    r.add_argument("--steps", default=None, help="sampling distributions of these steps, e.g. 0,5,-1, 'all' or "
                                                 "'none' (default: first, middle, last)")
    r.add_argument("--from-trace", default=None, metavar="FILE", help="report a saved trace instead of running")
    r.add_argument("--trace", default=None, metavar="FILE", help="also save the run as a trace file")
    r.add_argument("--out", required=True, help="the HTML file to write")
    r.add_argument("--tool-json", action="append", default=[], metavar="FILE",
                   help="a tool's --json output to show in the report's Tools section (qk, steer, quant-scoreboard, "
                        "doctor --determinism); may be given several times")
    r.set_defaults(fn=cmd_report)
    r.set_defaults(run_defaults={k: v for k, v in vars(r.parse_args(["--out", "run.html"])).items()
                                 if k not in REPORT_ONLY and k != "run_defaults"})


def reproduce_command(trace: Trace, *, out: str = "run.html", layers: str | None = None, steps: str | None = None,
                      model: str | None = None, dtype: str | None = None, device: str | None = None,
                      model_from_extra: bool = True) -> str:
    """The `python3 -m engine report ...` command line that runs this trace's run again (same settings, faults,
    model, dtype and device) and writes the same report. Re-parsed by this CLI, it gives trace.settings.
    model_from_extra=False: --model only as given (a trace read from a file does not name the model to load)."""
    s, x, defaults = trace.settings, trace.extra, SamplingParams()
    flags = (["--chat"] if s.chat else []) + (["--system", s.system] if s.system is not None else [])
    flags += (["--allow-special"] if s.allow_special else []) + ["--max-new-tokens", str(s.max_new_tokens)]
    for flag, (name, kind, _) in SAMPLER_FLAGS.items():
        v = getattr(s.params, name)
        if v != getattr(defaults, name):
            flags += [flag, repr(float(v)) if kind is float else str(kind(v))]
    flags += ["--seed", str(s.seed)] + [f for stop in s.stop for f in ("--stop", stop)]
    flags += ["--ignore-eos"] if s.ignore_eos else []
    if model_from_extra:
        model = model or x.get("model_source") or (None if trace.model_name == BUNDLED_NAME else trace.model_name)
    for flag, v in (("--model", model), ("--dtype", dtype or x.get("dtype")), ("--device", device or x.get("device"))):
        flags += [flag, str(v)] if v else []
    flags += [f for spec in (x.get("injections") or []) for f in ("--inject", spec)]
    flags += ["--norm-eps", repr(float(x["norm_eps"]))] if x.get("norm_eps") is not None else []
    flags += (["--layers", layers] if layers is not None else []) + (["--steps", steps] if steps is not None else [])
    # the file's name only when it was given as an absolute path: the server's (or this machine's) folders do not
    # belong in a report that is handed out
    flags += ["--out", Path(out).name if Path(out).is_absolute() else out]
    head = ["python3", "-m", "engine", "report"]
    if s.prompt.startswith("-"):                      # would read as a flag: after "--" it is the prompt
        return shlex.join(head + flags + ["--", s.prompt])
    return shlex.join(head + [s.prompt] + flags)


def _check_out(out: str) -> Path:
    path = Path(out)
    if path.suffix.lower() not in (".html", ".htm"):
        raise InputError(f"--out {out}: a report is an HTML file; give a name ending in .html")
    if path.is_dir():
        raise InputError(f"--out {out}: that is a folder; give a file name ending in .html")
    if not path.parent.is_dir():
        raise InputError(f"--out {out}: the folder {path.parent} does not exist")
    return path


def _run(a: argparse.Namespace, model, faults: tuple[list[str], float | None]) -> Trace:
    """The same run `python -m engine trace` makes with these flags (statistics of every stage, logits)."""
    injections, eps = faults
    probe = fault_probe(model, injections, eps, timing=True).capture("logits")
    t0 = time.perf_counter()
    rep = run_doctor(model, a.prompt, probe=probe, injections=injections, norm_eps=eps, stop_at_nonfinite=False,
                     **generation_kwargs(a))
    return make_trace(run_settings(a, ignore_eos=a.ignore_eos), rep.result, probe, model.name,
                      time.perf_counter() - t0,
                      extra={"injections": rep.injections, "norm_eps": eps, "error": rep.error,
                             "dtype": str(model.dtype).removeprefix("torch."), "device": model.device.type,
                             "model_source": a.model})


def _saved(a: argparse.Namespace):
    """(trace, model) for --from-trace. The model, dtype and device are the command line's (--model, --dtype,
    --device, or their defaults), never the file's: a trace from anywhere must not choose which folder or hub
    repository this machine loads. A trace of another model is refused, naming the model it was made with."""
    changed = [k for k, v in a.run_defaults.items() if getattr(a, k) != v]
    if a.prompt is not None or changed:
        given = "a prompt" if a.prompt is not None else "--" + changed[0].replace("_", "-")
        raise InputError(f"--from-trace reports the saved run as it was: {given} does not apply (drop it, or "
                         "drop --from-trace to run again)")
    trace = load_trace(a.from_trace, TraceBounds())
    model = load(a)
    if model.name != trace.model_name:
        raise InputError(f"{a.from_trace} was made with {trace.model_name!r}; pass --model for that model "
                         f"(loaded: {model.name})")
    return trace, model


def _steps(a: argparse.Namespace, trace: Trace, asked: list[int] | None) -> list[int] | None:
    """--steps resolved against the steps the run made; those it did not reach are kept (the report says so)."""
    n = len(trace.result.steps)
    if a.steps is None:
        return None
    chosen = list(range(n)) if asked is None else sorted({s % n if -n <= s < 0 else s for s in asked})
    missing = [s for s in chosen if not 0 <= s < n]
    if missing:
        print(f"note: --steps {', '.join(map(str, missing))}: the run stopped after {n} step(s) "
              f"({trace.result.stop_reason})", file=sys.stderr)
    return chosen


def cmd_report(a: argparse.Namespace) -> int:
    out = _check_out(a.out)
    layers_asked, steps_asked = parse_indices(a.layers, "--layers"), parse_indices(a.steps, "--steps")
    if a.from_trace is None and a.prompt is None:
        raise InputError("a prompt is needed (or --from-trace FILE to report a saved run)")
    if a.from_trace is None:
        too_far = [s for s in steps_asked or [] if not -a.max_new_tokens <= s < a.max_new_tokens]
        if too_far:
            raise InputError(f"--steps: {too_far[0]} is out of range; at most {a.max_new_tokens} steps are made "
                             f"(--max-new-tokens), 0..{a.max_new_tokens - 1}")
    tools = [read_tool_json(f) for f in a.tool_json]           # before the run: a bad file costs nothing
    faults = faults_of(a) if a.from_trace is None else None      # before loading: a --preset may bring a dtype
    trace, model = _saved(a) if a.from_trace is not None else (None, load(a))
    n_layers = model.config.num_layers
    layers = (default_layers(n_layers) if a.layers is None
              else resolve_indices(layers_asked, n_layers, "--layers", "layers"))
    trace = trace or _run(a, model, faults)
    if a.trace:
        save_trace(trace, a.trace)
    t0 = time.perf_counter()
    maps = attention_maps(model, trace.ids, layers, injections=trace.extra.get("injections") or (),
                          norm_eps=trace.extra.get("norm_eps"))
    command = reproduce_command(trace, out=a.out, layers=a.layers, steps=a.steps, model=a.model,
                                dtype=str(model.dtype).removeprefix("torch."), device=model.device.type,
                                model_from_extra=a.from_trace is None)
    html = build_html(trace, tokenizer=model.tokenizer, attention=maps, steps=_steps(a, trace, steps_asked),
                      command=command, tools=tools)
    out.write_text(html, encoding="utf-8")
    print(json.dumps({"out": str(out), "bytes": out.stat().st_size, "seconds": round(trace.seconds, 3),
                      "build_seconds": round(time.perf_counter() - t0, 3), "layers": layers,
                      "stop_reason": trace.result.stop_reason, "generated_tokens": len(trace.result.token_ids)}))
    return 0
