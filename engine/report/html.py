"""A take-home report: one run (a Trace) as one self-contained HTML file that opens with no network and no
Python. Overview, token splits, each step's choice, attention maps of chosen layers, activation statistics,
sampling distributions of chosen steps, NaN/Inf and loop findings, and the CLI command that reproduces the
run. plotly.js is embedded once (the copy bundled with the plotly package); the charts are JSON specs drawn
by Plotly.newPlot. A Content-Security-Policy forbids every fetch, so nothing leaves the file.

    html = build_html(trace, tokenizer=model.tokenizer, attention=attention_maps(model, trace.ids, [0, 15]),
                      steps=[0, 5], command="python3 -m engine report ...")

Every string from the run (prompt, tokens, settings) is HTML-escaped; the embedded JSON escapes <, > and &,
so a prompt holding </script> stays text. The numbers are the trace's own (see engine.report.data); the
same data is embedded as JSON (<script id="report-data">) for anyone who wants them back.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from functools import lru_cache
from html import escape
from importlib import resources

from engine.inspection.trace import Trace
from engine.report import data as rd
from engine.report import figures as rf
from engine.report.tools import tool_sections
from engine.sampling import SamplingParams

FORMAT, VERSION = "llm-inspector-report", 1
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
       "img-src data: blob:; font-src data:; connect-src 'none'; form-action 'none'; base-uri 'none'")
CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;max-width:1180px;padding:0 20px 60px;
color:#1d2330}
h1{font-size:24px;margin:22px 0 4px}
h2{font-size:19px;margin:30px 0 8px;border-bottom:1px solid #dde2ea;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}nav a{margin-right:12px}.muted{color:#5f6b7a}
pre{background:#f4f6f9;border:1px solid #dde2ea;border-radius:4px;padding:8px 10px;white-space:pre-wrap;
word-break:break-word;margin:4px 0}
table{border-collapse:collapse;margin:6px 0;font-size:13px}td,th{border:1px solid #dde2ea;padding:3px 7px;
text-align:left;vertical-align:top}th{background:#f4f6f9}td.n{text-align:right;font-variant-numeric:tabular-nums}
tr.bad td{background:#fde2e4}.scroll{max-height:460px;overflow:auto}
.tok{display:inline-block;padding:1px 2px;margin:1px 1px;border-radius:3px;font-family:ui-monospace,monospace;
white-space:pre}.t0{background:#fde2e4}.t1{background:#e2ece9}.t2{background:#dfe7fd}.t3{background:#fff1c1}
.t4{background:#e8dff5}.t5{background:#d7f0d2}.gen{outline:1px solid #3b6fb6}.sp{background:#444;color:#fff}
.ok{color:#2d6a4f}.warn{color:#b5179e;font-weight:600}.chart{min-height:300px;margin:8px 0}
"""
RENDER = """
(function(){var figs=JSON.parse(document.getElementById('report-figures').textContent);
Object.keys(figs).forEach(function(id){var f=figs[id];
Plotly.newPlot(id,f.data,f.layout,{displaylogo:false,responsive:true});});})();
"""


@lru_cache(maxsize=1)
def plotly_js() -> str:
    """plotly.min.js as bundled with the plotly package (the same file plotly's own offline HTML embeds)."""
    return resources.files("plotly").joinpath("package_data", "plotly.min.js").read_text(encoding="utf-8")


def script_json(obj) -> str:
    """JSON safe inside a <script> element: <, > and & escaped (a '</script>' in a prompt stays text)."""
    return (json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
            .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


def _safe(x):
    """JSON-able copy: NaN / ±Inf -> None, tuples -> lists, keys -> str."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_safe(v) for v in x]
    return x if x is None or isinstance(x, (str, int, bool)) else str(x)


def report_data(trace: Trace, *, tokenizer=None, attention: dict[int, rd.AttentionMap] | None = None,
                steps: list[int] | None = None, command: str | None = None, notes=(), tools=()) -> dict:
    """Everything the report shows, as JSON-able data (embedded in the file as <script id="report-data">).
    steps: the steps whose sampling distributions are shown (default: first, middle, last). tools: the JSON of
    tools run beside it (engine.report.tools), each drawn as a section of its own."""
    r = trace.result
    chosen = rd.default_steps(len(r.steps)) if steps is None else [s for s in steps if 0 <= s < len(r.steps)]
    return _safe({
        "format": FORMAT, "version": VERSION, "model": trace.model_name, "created": trace.created,
        "seconds": trace.seconds, "settings": trace.settings.as_dict(), "extra": trace.extra,
        "interventions": trace.interventions, "notes": [*trace.notes, *notes], "command": command,
        "prompt_ids": r.prompt_ids, "token_ids": r.token_ids, "text": r.text, "stop_reason": r.stop_reason,
        "timings": r.timings, "cache": r.cache, "prompt_text": None if tokenizer is None else tokenizer.decode(
            r.prompt_ids),
        "tokens": rd.tokens(trace, tokenizer), "steps": rd.steps(trace, tokenizer),
        "findings": rd.findings(trace), "layer_stats": rd.layer_stats(trace),
        "sampling": rd.sampling(trace, chosen, tokenizer),
        "attention": [{"layer": m.layer, "block": m.block, "starts": m.starts, "positions": m.positions}
                      for m in (attention or {}).values()],
        "tools": tool_sections(tools),
    })


def build_html(trace: Trace, *, tokenizer=None, attention: dict[int, rd.AttentionMap] | None = None,
               steps: list[int] | None = None, command: str | None = None, notes=(), tools=()) -> str:
    """The report of one run as one self-contained HTML document (see the module docstring)."""
    data = report_data(trace, tokenizer=tokenizer, attention=attention, steps=steps, command=command, notes=notes,
                       tools=tools)
    labels = [f"{t['position']} {t['text'][:12]}" for t in data["tokens"]]
    figs: dict[str, dict] = {}
    if data["steps"]:
        figs["fig-steps"] = rf.steps_figure(data["steps"], data["findings"]["loops"])
    for m in (attention or {}).values():
        figs[f"fig-attention-{m.layer}"] = rf.attention_figure(m, labels, len(trace.result.prompt_ids))
    if data["layer_stats"]:
        figs["fig-stats-rms"] = rf.stats_figure(data["layer_stats"], "rms", log_y=True)
        figs["fig-stats-absmax"] = rf.stats_figure(data["layer_stats"], "absmax", log_y=True)
    for d in data["sampling"]:
        figs[f"fig-sampling-{d['step']}"] = rf.sampling_figure(d)
    title = f"LLM Inspector report: {trace.settings.prompt[:60]}"
    body = "\n".join([
        "<h1>LLM Inspector report</h1>",
        f'<p class="muted">{escape(trace.model_name)} · made {escape(_when(trace.created))} · '
        f"{len(trace.result.prompt_ids)} prompt tokens, {len(trace.result.token_ids)} generated</p>",
        '<nav><a href="#overview">Overview</a><a href="#findings">Findings</a><a href="#tokens">Tokens</a>'
        '<a href="#steps">Steps</a><a href="#attention">Attention</a><a href="#activations">Activations</a>'
        '<a href="#sampling">Sampling</a>' + ('<a href="#tools">Tools</a>' if data["tools"] else "") + '</nav>',
        _overview(data), _findings(data["findings"], data["tokens"], len(trace.result.prompt_ids)),
        _tokens(data["tokens"]), _steps(data["steps"], "fig-steps" in figs),
        _attention(attention or {}, data["attention"]), _activations(data["layer_stats"]),
        _sampling(data["sampling"], steps, len(trace.result.steps)), _tools(data["tools"]),
    ])
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)}</title><style>{CSS}</style>",
        f'<script type="text/javascript">{plotly_js()}</script></head><body>',
        body,
        f'<script type="application/json" id="report-data">{script_json(data)}</script>',
        f'<script type="application/json" id="report-figures">{script_json(figs)}</script>',
        f"<script>{RENDER}</script>", "</body></html>", ""])


# ---- sections -------------------------------------------------------------------------------------
def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _num(x, fmt: str = ".4g") -> str:
    return "–" if x is None else (f"{x:,}" if isinstance(x, int) else format(x, fmt))


def _table(header: list[str] | None, rows: list[list], bad: list[bool] | None = None, numeric=()) -> str:
    head = "<thead><tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr></thead>" if header else ""
    body = "".join(
        f'<tr{" class=bad" if bad and bad[i] else ""}>' + "".join(
            f'<td{" class=n" if j in numeric else ""}>{escape(str(c))}</td>' for j, c in enumerate(row)) + "</tr>"
        for i, row in enumerate(rows))
    return f"<table>{head}<tbody>{body}</tbody></table>"


def _tools(sections: list[dict]) -> str:
    """The tools computed beside the run (engine.report.tools), a table each."""
    if not sections:
        return ""
    parts = ['<section id="tools"><h2>Tools</h2>']
    for t in sections:
        rows = [[_num(c) if j in t["numeric"] else c for j, c in enumerate(r)] for r in t["rows"]]
        parts += [f'<h3 id="{escape(t["id"])}">{escape(t["title"])}</h3>', f'<p>{escape(t["caption"])}</p>',
                  _table(t["header"], rows, numeric=t["numeric"])]
    return "\n".join(parts + ["</section>"])


def _settings_rows(data: dict) -> list[list]:
    s, x, t = data["settings"], data["extra"], data["timings"]
    default = asdict(SamplingParams())
    changed = {k: v for k, v in s["params"].items() if v != default.get(k)}
    rows = [["model", data["model"]], ["dtype / device", f"{x.get('dtype', '?')} / {x.get('device', '?')}"],
            ["chat template", "on" if s["chat"] else "off"], ["system message", s["system"] or "–"],
            ["sampler", ", ".join(f"{k}={v}" for k, v in changed.items()) or "greedy (every filter off)"],
            ["seed", s["seed"]], ["max new tokens", s["max_new_tokens"]],
            ["stop strings", ", ".join(map(repr, s["stop"])) or "–"], ["stop reason", data["stop_reason"]],
            ["timings", f"tokenize {_num(t.get('tokenize', 0) * 1e3, '.1f')} ms · prefill "
                        f"{_num(t.get('prefill', 0) * 1e3, '.0f')} ms · decode {_num(t.get('decode', 0), '.2f')} s "
                        f"({_num(t.get('per_token_decode', 0) * 1e3, '.1f')} ms a token) · whole run "
                        f"{_num(data['seconds'], '.2f')} s"],
            ["KV cache", f"{_num(data['cache'].get('bytes_used', 0) / 2**20, '.2f')} MiB used of "
                         f"{_num(data['cache'].get('bytes_allocated', 0) / 2**20, '.2f')} MiB"]]
    if x.get("injections") or x.get("norm_eps") is not None:
        eps = "the model's" if x.get("norm_eps") is None else x["norm_eps"]
        rows.append(["faults", f"{', '.join(x.get('injections') or []) or '–'}; RMSNorm eps {eps}"])
    return rows + [["note", n] for n in data["notes"]]


def _overview(data: dict) -> str:
    prompt = data["prompt_text"] if data["prompt_text"] is not None else data["settings"]["prompt"]
    cmd = ("<h3>Reproduce this run</h3><pre id=\"command\"><code>" + escape(data["command"]) + "</code></pre>"
           if data["command"] else "")
    return "\n".join([
        '<section id="overview"><h2>Overview</h2>',
        "<h3>Prompt" + (" (as the model saw it)" if data["prompt_text"] is not None else "") + "</h3>",
        f'<pre id="prompt">{escape(prompt)}</pre>',
        f'<h3>Generated text</h3><pre id="generated">{escape(data["text"]) or "(nothing)"}</pre>',
        _table(None, _settings_rows(data)), cmd, "</section>"])


def _findings(f: dict, toks: list[dict], n_prompt: int) -> str:
    out = ['<section id="findings"><h2>Findings</h2><h3>NaN / Inf</h3>']
    nf, lg = f["first_nonfinite"], f["nonfinite_logits"]
    if nf is None and lg is None:
        out.append('<p class="ok" id="nonfinite-none">No NaN or Inf at any stage of any step: none found.</p>')
    if nf is not None:
        out.append(f'<p class="warn" id="nonfinite-first">First NaN/Inf: stage <code>{escape(nf["stage"])}</code> '
                   f"(layer {escape(str(nf['layer']))}), position {nf['position']}, step {nf['step']} "
                   f"(NaN {_num(nf['stats'].get('nan'), 'g')}, Inf {_num(nf['stats'].get('inf'), 'g')}).</p>")
    if lg is not None:
        out.append(f'<p class="warn">Step {lg["step"]} (position {lg["position"]}): the logits held NaN or Inf '
                   f"values, so no token was drawn from them and the run stopped.</p>")
    if f["nonfinite_cells"]:
        out.append(f"<p>{f['nonfinite_cells_total']:,} (step, position, stage) cells held NaN or Inf; the first "
                   f"{len(f['nonfinite_cells'])}:</p>")
        out.append('<div class="scroll">' + _table(["step", "position", "stage", "NaN", "Inf"], [
            [c["step"], c["position"], c["stage"], c["nan"], c["inf"]] for c in f["nonfinite_cells"]],
            numeric=(0, 1, 3, 4)) + "</div>")
    out.append("<h3>Repetition loops</h3>")
    if not f["loops"]:
        out.append('<p class="ok" id="loops-none">No repetition loop in the generated tokens: none found.</p>')
    else:
        rows = [[lp["start"], lp["period"], lp["count"], lp["end"],
                 "".join(t["text"] for t in toks[n_prompt + lp["start"]: n_prompt + lp["start"] + lp["period"]])]
                for lp in f["loops"]]
        out.append(f'<p class="warn" id="loops-found">{len(rows)} loop(s) in the generated tokens (indices are '
                   "generation steps):</p>" + _table(["start", "period", "count", "end", "repeated tokens"], rows,
                                                     numeric=(0, 1, 2, 3)))
    return "\n".join(out + ["</section>"])


def _tokens(toks: list[dict]) -> str:
    spans = []
    for k, t in enumerate(toks):
        cls = "tok " + ("sp" if t["special"] else f"t{k % 6}") + (" gen" if t["part"] == "generated" else "")
        spans.append(f'<span class="{cls}" title="position {t["position"]} · id {t["id"]} · {t["part"]}">'
                     f"{escape(t['text'])}</span>")
    return ('<section id="tokens"><h2>Token splits</h2><p class="muted">Each box is one token (hover: position and '
            "id); generated tokens are outlined, special tokens dark, whitespace shown as · ⏎ →.</p>"
            f'<div id="token-spans">{"".join(spans)}</div></section>')


def _steps(steps: list[dict], chart: bool) -> str:
    rows = [[s["step"], s["position"], s["id"], s["token"], _num(s["prob"]), _num(s["model_prob"]),
             _num(s["entropy"]), s["kept"], "  ".join(f"{c['text']!r} {_num(c['prob'], '.3f')}" for c in s["top"])]
            for s in steps]
    return ('<section id="steps"><h2>Steps</h2>' + ('<div class="chart" id="fig-steps"></div>' if chart else "")
            + '<p class="muted">prob: under the sampling distribution (after penalties, temperature, top-k/p, min-p); '
              "model prob and entropy (nats): the raw softmax; kept: tokens left with p &gt; 0.</p>"
            + '<div class="scroll">' + _table(["step", "position", "id", "token", "prob", "model prob", "entropy",
                                              "kept", "top 5"], rows, numeric=(0, 1, 2, 4, 5, 6, 7))
            + "</div></section>")


def _attention(maps: dict, info: list[dict]) -> str:
    if not maps:
        return ('<section id="attention"><h2>Attention</h2><p class="muted">No attention maps in this report '
                "(they need the model: choose layers with --layers).</p></section>")
    divs = "".join(f'<div class="chart" id="fig-attention-{m.layer}"></div>' for m in maps.values())
    return ('<section id="attention"><h2>Attention</h2><p class="muted">Each row is a query position\'s attention '
            "over the key positions (average of all heads; rows sum to 1). The colour scale leaves out position 0, "
            "the attention sink; the dotted lines mark where the generated tokens begin.</p>" + divs + "</section>")


def _activations(rows: list[dict]) -> str:
    if not rows:
        return '<section id="activations"><h2>Activations</h2><p>No statistics were recorded.</p></section>'
    shown = [r for r in rows if r["layer"] is None or r["stage"] in rf.PER_LAYER_SHOWN]
    cols = ["mean", "std", "rms", "absmax", "min", "max"]
    table = _table(["stage", "layer", "positions", *cols, "NaN", "Inf"],
                   [[r["stage"], "–" if r["layer"] is None else r["layer"], r["positions"],
                     *(_num(r[c]) for c in cols), r["nan"], r["inf"]] for r in shown],
                   bad=[bool(r["nan"] or r["inf"]) for r in shown], numeric=tuple(range(1, 11)))
    return ('<section id="activations"><h2>Activation statistics</h2><p class="muted">Each stage\'s statistics '
            "pooled over every position of every step (the Activations page's table). Every stage of every "
            "layer is in the embedded data; the table lists the layer-less stages and "
            f"{', '.join(rf.PER_LAYER_SHOWN)}.</p>"
            '<div class="chart" id="fig-stats-rms"></div><div class="chart" id="fig-stats-absmax"></div>'
            f'<div class="scroll">{table}</div></section>')


def _sampling(dists: list[dict], asked: list[int] | None, n_steps: int) -> str:
    out = ['<section id="sampling"><h2>Sampling distributions</h2>']
    missing = [s for s in (asked or []) if not 0 <= s < n_steps]
    if missing:
        out.append(f"<p class=\"warn\">Step(s) {', '.join(map(str, missing))} not reached: the run made "
                   f"{n_steps} step(s).</p>")
    if not dists:
        out.append("<p>No step chosen.</p>")
    for d in dists:
        kept = ", ".join(f"{k} {v:,}" for k, v in d["kept_by_stage"].items())
        out.append(f'<div class="chart" id="fig-sampling-{d["step"]}"></div><p class="muted">Step {d["step"]} '
                   f"(position {d['position']}): chosen id {d['chosen']} with sampling probability "
                   f"{_num(d['prob'])} (model {_num(d['model_prob'])}), entropy {_num(d['entropy'])} nats, "
                   f"tokens kept: {d['kept']:,}" + (f"; tokens left after each stage: {escape(kept)}" if kept else
                                                   "; no logits captured: sampling probabilities not replayed")
                   + ".</p>")
    return "\n".join(out + ["</section>"])
