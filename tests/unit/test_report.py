"""The take-home report (python -m engine report, engine.report.html): one self-contained HTML file whose numbers
are the trace's own, whose command line reproduces the run, and where text from the run stays text."""
from __future__ import annotations

import dataclasses
import json
import re
import shlex

import numpy as np
import pandas as pd
import pytest

from engine import RunSettings, inspection_probe, load_trace, make_trace
from engine.cli import build_parser, main
from engine.cli.args import run_settings
from engine.cli.report import reproduce_command
from engine.generate import generate
from engine.inspection.loops import Loop
from engine.report.data import attention_maps
from engine.report.html import build_html, plotly_js
from inspector.views.activations import layer_summary
from inspector.views.attention import attention_pattern

HOSTILE = "</script><img src=x onerror=alert(1)> & <b>bold</b>"
FLAGS = ["--chat", "--system", "be 'brief' & \"exact\"", "--temperature", "0.7", "--top-k", "40", "--top-p", "0.9",
         "--min-p", "0.05", "--repetition-penalty", "1.1", "--frequency-penalty", "0.2", "--presence-penalty", "0.1",
         "--no-repeat-ngram", "3", "--seed", "7", "--stop", "\n\n", "--stop", "END", "--ignore-eos",
         "--max-new-tokens", "6"]


def embedded(html: str, element_id: str):
    """The JSON of <script type="application/json" id=element_id> (JSON.parse reads the \\u003c escapes too)."""
    m = re.search(rf'<script type="application/json" id="{element_id}">(.*?)</script>', html, re.S)
    assert m, element_id
    return json.loads(m.group(1))


def report(capsys, *args: str) -> tuple[int, dict | None, str]:
    """`python -m engine report ARGS` in this process: (exit status, its JSON line or None, stderr)."""
    code = main(["report", *args])
    out, err = capsys.readouterr()
    return code, (json.loads(out.strip().splitlines()[-1]) if code == 0 else None), err


@pytest.fixture(scope="module")
def made(tiny_model_dir, tmp_path_factory):
    """One report from the CLI (tiny model, every sampler flag set) with its run saved as a trace."""
    d = tmp_path_factory.mktemp("report")
    code = main(["report", "Hello there, how are you?", *FLAGS, "--model", str(tiny_model_dir), "--steps", "0,-1",
                 "--layers", "0,-1", "--trace", str(d / "run.trace"), "--out", str(d / "run.html")])
    assert code == 0
    html = (d / "run.html").read_text(encoding="utf-8")
    return html, load_trace(d / "run.trace"), d


def test_the_numbers_in_the_report_are_the_traces(made):
    html, trace, _ = made
    data, r = embedded(html, "report-data"), trace.result
    assert data["text"] == r.text and data["prompt_ids"] == r.prompt_ids and data["token_ids"] == r.token_ids
    assert [t["id"] for t in data["tokens"]] == r.all_ids
    assert len(data["steps"]) == len(r.steps) == 6
    for row, s in zip(data["steps"], r.steps):
        assert (row["id"], row["prob"], row["model_prob"], row["entropy"], row["kept"]) == \
            (s.token_id, s.prob, s.model_prob, s.entropy, s.kept)
        assert [(c["id"], c["prob"]) for c in row["top"]] == [(c.id, c.prob) for c in s.top[:5]]
    assert [d["step"] for d in data["sampling"]] == [0, 5]
    for d in data["sampling"]:
        s = r.steps[d["step"]]
        assert [(c["id"], c["model_prob"]) for c in d["candidates"][:10]] == [(c.id, c.prob) for c in s.top]
        chosen = next(c for c in d["candidates"] if c["id"] == s.token_id)
        assert chosen["sampling_prob"] == pytest.approx(s.prob, abs=1e-6)     # replayed by the same sampler chain
        assert d["kept_by_stage"]["probs"] == s.kept
    want = layer_summary(trace.recording.stats)                                   # the Activations page's table
    got = {(row["stage"], row["layer"]): row for row in data["layer_stats"]}
    assert len(got) == len(data["layer_stats"]) == len(want)
    for _, w in want.iterrows():
        row = got[(w["stage"], None if pd.isna(w["layer"]) else int(w["layer"]))]
        for col in ("mean", "std", "rms", "absmax", "min", "max"):
            assert row[col] == pytest.approx(float(w[col]), rel=1e-9, abs=1e-12), (w["stage"], col)
        assert (row["nan"], row["inf"], row["positions"]) == (w["nan"], w["inf"], w["positions"])
    assert data["findings"] == {"first_nonfinite": None, "nonfinite_logits": None, "nonfinite_cells": [],
                                "nonfinite_cells_total": 0, "loops": [lp.as_dict() for lp in trace.loops]}
    assert 'id="nonfinite-none"' in html


def test_every_chart_has_its_figure_and_plotly_is_embedded_once(made):
    html, trace, _ = made
    figs = embedded(html, "report-figures")
    divs = re.findall(r'<div class="chart" id="([^"]+)"></div>', html)
    assert sorted(divs) == sorted(figs) and len(divs) == len(set(divs))
    assert {"fig-steps", "fig-attention-0", "fig-attention-1", "fig-sampling-0", "fig-sampling-5",
            "fig-stats-rms", "fig-stats-absmax"} == set(figs)
    assert html.count("Plotly.newPlot") == 1 and html.count("<script") == 4     # plotly.js, 2 × JSON, the loop
    assert html.count(plotly_js()) == 1
    assert not re.search(r'(src|href)\s*=\s*["\']?(https?:)?//', html.replace(plotly_js(), ""), re.I)
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    steps = figs["fig-steps"]["data"][0]
    assert steps["y"] == [float(f"{s.prob:.6g}") for s in trace.result.steps]


def test_the_reproduce_command_parses_back_to_the_same_run(made, tiny_model_dir):
    html, trace, d = made
    cmd = embedded(html, "report-data")["command"]
    assert html.count(cmd.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
                      .replace("'", "&#x27;")) == 1
    argv = shlex.split(cmd)
    assert argv[:4] == ["python3", "-m", "engine", "report"]
    a = build_parser().parse_args(argv[3:])
    assert run_settings(a, ignore_eos=a.ignore_eos) == trace.settings
    # the report was written to an absolute path: the command names the file, not the folders (issue 33, item 8)
    assert (a.model, a.dtype, a.device, a.layers, a.steps, a.out) == (str(tiny_model_dir), "float32", "cpu", "0,-1",
                                                                      "0,-1", "run.html")
    assert str(d) not in cmd
    for prompt in ("-x --chat", "--out y.html", "a\nb 'c' \"d\" $HOME `ls`", HOSTILE):
        t = dataclasses.replace(trace, settings=dataclasses.replace(trace.settings, prompt=prompt))
        a = build_parser().parse_args(shlex.split(reproduce_command(t))[3:])
        assert run_settings(a, ignore_eos=a.ignore_eos) == t.settings


@pytest.fixture(scope="module")
def hostile_run(tiny_model):
    probe = inspection_probe()
    settings = RunSettings(prompt=HOSTILE, chat=False, max_new_tokens=4)
    result = generate(tiny_model, HOSTILE, probe=probe, **settings.generation_kwargs())
    return make_trace(settings, result, probe, tiny_model.name, 0.1)


def test_text_from_the_run_stays_text(hostile_run, tiny_model):
    maps = attention_maps(tiny_model, hostile_run.ids, [0, 1])
    html = build_html(hostile_run, tokenizer=tiny_model.tokenizer, attention=maps, steps=[0],
                      command=reproduce_command(hostile_run))
    outside = html.replace(plotly_js(), "")                                  # the report's own markup
    assert "<img" not in outside.lower() and "<b>" not in outside and "onerror=alert(1)>" not in outside
    assert html.lower().count("</script") == 4                                # only the four script elements
    assert "&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt; &amp; &lt;b&gt;bold&lt;/b&gt;" in html   # <pre>
    data = embedded(html, "report-data")
    assert data["settings"]["prompt"] == HOSTILE
    assert shlex.split(data["command"])[4] == HOSTILE
    for fig in embedded(html, "report-figures").values():                     # plotly reads tags in its text
        assert "<img" not in json.dumps(fig) and "<b>bold" not in json.dumps(fig)


def test_findings_name_the_first_nan_and_the_loops(capsys, tiny_model_dir, tmp_path, made):
    out = tmp_path / "nan.html"
    code, info, err = report(capsys, "Hello there", "--model", str(tiny_model_dir), "--max-new-tokens", "3",
                             "--inject", "nan@blocks.1.mlp.act:2", "--trace", str(tmp_path / "nan.trace"),
                             "--out", str(out))
    assert code == 0, err
    html, trace = out.read_text(), load_trace(tmp_path / "nan.trace")
    f = embedded(html, "report-data")["findings"]
    assert trace.first_nonfinite is not None and f["first_nonfinite"]["stage"] == "blocks.1.mlp.act"
    assert {k: f["first_nonfinite"][k] for k in ("step", "stage", "layer", "position")} == \
        {k: trace.first_nonfinite[k] for k in ("step", "stage", "layer", "position")}
    assert f["nonfinite_cells_total"] > 0 and f["nonfinite_cells"][0]["stage"] == "blocks.1.mlp.act"
    assert 'id="nonfinite-first"' in html and "blocks.1.mlp.act" in html
    assert "--inject nan@blocks.1.mlp.act:2" in embedded(html, "report-data")["command"]
    base = made[1]
    looped = dataclasses.replace(base, loops=[Loop(0, 2, 3, 6)])
    html = build_html(looped)
    assert 'id="loops-found"' in html and embedded(html, "report-data")["findings"]["loops"] == [
        {"start": 0, "period": 2, "count": 3, "end": 6}]
    assert 'id="loops-none"' in build_html(dataclasses.replace(base, loops=[]))


def test_a_report_from_a_saved_trace_shows_the_same_run(capsys, made, tiny_model_dir):
    html, trace, d = made
    code, info, err = report(capsys, "--from-trace", str(d / "run.trace"), "--model", str(tiny_model_dir),
                             "--steps", "0,-1", "--layers", "0,-1", "--out", str(d / "again.html"))
    assert code == 0, err
    a, b = embedded(html, "report-data"), embedded((d / "again.html").read_text(), "report-data")
    for k in ("text", "token_ids", "steps", "sampling", "layer_stats", "findings", "tokens", "settings"):
        assert a[k] == b[k], k
    assert a["command"].replace("run.html", "again.html") == b["command"]     # the same run, another --out
    assert embedded(html, "report-figures") == embedded((d / "again.html").read_text(), "report-figures")


def test_attention_maps_are_the_head_average_pooled_for_long_runs(tiny_model):
    ids = tiny_model.tokenizer.encode("the cat sat on the mat and looked around. " * 60)[:600]
    assert len(ids) == 600
    maps = attention_maps(tiny_model, ids, [1, 0])
    full = attention_pattern(tiny_model, ids, 1).double().mean(0)             # (600, 600), one forward
    m = maps[1]
    assert m.block == 3 and m.z.shape == (200, 200) and m.starts[:2] == [0, 3]
    want = full.reshape(200, 3, 200, 3).sum(3).mean(1).numpy()
    assert np.allclose(m.z, want, atol=1e-6)
    assert np.allclose(m.z.sum(1), 1, atol=1e-6)
    short = attention_maps(tiny_model, ids[:40], [0])[0]
    assert short.block == 1 and np.allclose(short.z, attention_pattern(tiny_model, ids[:40], 0).double().mean(0),
                                            atol=1e-6)
    assert tiny_model.live_hooks == 0


@pytest.mark.parametrize("args, message", [
    (["hi", "--layers", "0,x"], "--layers '0,x': expected whole numbers"),
    (["hi", "--layers", "5"], "--layers: 5 is out of range; there are layers 0..1"),
    (["hi", "--steps", "first"], "--steps 'first': expected whole numbers"),
    (["hi", "--steps", "4", "--max-new-tokens", "4"], "--steps: 4 is out of range; at most 4 steps"),
    (["hi", "--out", "{tmp}/run.txt"], "a report is an HTML file"),
    (["hi", "--out", "{tmp}/missing/run.html"], "does not exist"),
    (["hi", "--out", "{tmp}"], "a report is an HTML file"),
    (["--out", "{tmp}/x.html"], "a prompt is needed"),
    (["hi", "--from-trace", "{tmp}/x.trace", "--out", "{tmp}/x.html"], "a prompt does not apply"),
    (["--from-trace", "{tmp}/x.trace", "--temperature", "0.5", "--out", "{tmp}/x.html"],
     "--temperature does not apply"),
    (["--from-trace", "{tmp}/missing.trace", "--out", "{tmp}/x.html"], "cannot read missing.trace"),
])
def test_bad_options_say_what_is_wrong_and_exit_2(capsys, tiny_model_dir, tmp_path, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "r.html")]
    code, _, err = report(capsys, *args, "--model", str(tiny_model_dir))
    last = err.strip().splitlines()[-1]                                  # after the model's loading progress
    assert code == 2 and last.startswith("error: ") and message in last, err
    assert not list(tmp_path.glob("*.html"))


def test_attention_maps_label_their_positions_at_12_px():
    """Issue 33, item 8: the report's attention maps' tick labels were 9 px."""
    import numpy as np

    from engine.report.data import AttentionMap
    from engine.report.figures import attention_figure
    n = 80
    m = AttentionMap(layer=0, z=np.full((n, n), 1 / n), starts=list(range(n)), block=1, positions=n)
    lay = attention_figure(m, [f"{p} tok" for p in range(n)], 40)["layout"]
    for axis in ("xaxis", "yaxis"):
        assert lay[axis]["tickfont"]["size"] >= 12 and len(lay[axis]["tickvals"]) <= 30
