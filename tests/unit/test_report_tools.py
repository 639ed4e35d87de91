"""Issue 47: the tools appear in the offline report where they apply. The QK split, a steering run, a determinism
check and a quantization scoreboard, each passed as its own JSON (the tool's as_dict, its CLI twin's --json), are
drawn in a Tools section whose numbers are the tool's own; the CLI takes them with --tool-json; a file that is not a
tool's JSON, or whose fields have the wrong types, is refused naming what is wrong, before any model work."""
from __future__ import annotations

import json
import re
from html import unescape

import pytest

from engine import RunSettings, SamplingParams, inspection_probe, make_trace
from engine.errors import InputError
from engine.generate import GenerationRun
from engine.report.html import build_html
from engine.report.tools import kind_of, tool_sections
from engine.tools.qk_attribution import qk_attribution
from engine.tools.steering import steer, steering_vector
from tests.unit.test_report import embedded, report

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def trace(tiny_model):
    settings = RunSettings(prompt="Hello there, how are you?", max_new_tokens=3, params=SamplingParams(temperature=0))
    run = GenerationRun(tiny_model, settings.prompt, probe=inspection_probe(), **settings.generation_kwargs())
    run.run()
    return make_trace(settings, run.result(), run.probe, tiny_model.name, 0.1)


@pytest.fixture(scope="module")
def tools(tiny_model):
    ids = tiny_model.tokenizer.encode("Hello there, how are you?")
    qk = qk_attribution(tiny_model, ids, 1, 0, len(ids) - 1, 0).as_dict(10)
    vec = steering_vector(tiny_model, ["I love it"], ["I hate it"], 1)
    settings = RunSettings(prompt="Tell me <b>a story</b>", max_new_tokens=3, params=SamplingParams(temperature=0))
    st = {**steer(tiny_model, settings, vec, 40.0).as_dict(), "vector": {"stage": vec.stage}}
    return qk, st


def test_the_tools_section_shows_each_tools_own_numbers(trace, tools, tiny_model):
    qk, st = tools
    board = {"reference": "tiny (float32)", "texts": 2, "count": 30, "formats": {
        "Q8_0": {"mean_kld": {"value": 0.0015, "unc": 1e-4}, "same_top": {"value": 0.98, "unc": 0.007},
                 "rms_p_diff": {"value": 0.01, "unc": None}, "ppl_ratio": {"value": 1.001, "unc": 0.0005}}}}
    html = build_html(trace, tokenizer=tiny_model.tokenizer, tools=[qk, st, board])
    data = embedded(html, "report-data")["tools"]
    assert [t["id"] for t in data] == ["tool-qk", "tool-steering", "tool-scoreboard"]
    q = data[0]
    assert [r[2] for r in q["rows"]] == [p["term"] for p in qk["top_pairs"]]
    assert [r[:2] for r in q["rows"]] == [[p["query side"], p["key side"]] for p in qk["top_pairs"]]
    assert str(qk["score"]) in q["caption"]
    s = data[1]
    assert [r[2] for r in s["rows"]] == [x["kl_steered_plain"] for x in st["steps"]]
    assert len(s["rows"]) == len(st["steps"]) == 3
    assert data[2]["rows"] == [["Q8_0", 0.0015, 0.98, 0.01, 1.001]]
    section = html[html.index('<section id="tools">'):]
    assert "<b>a story</b>" not in section                     # the prompt's text stays text
    assert '<a href="#tools">Tools</a>' in html
    cells = [unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", section[:section.index("tool-steering")])]
    assert cells[:2] == [qk["top_pairs"][0]["query side"], qk["top_pairs"][0]["key side"]]


def test_no_tool_no_section(trace):
    html = build_html(trace)
    assert '<section id="tools">' not in html and embedded(html, "report-data")["tools"] == []


@pytest.mark.parametrize("doc, said", [
    ({"hello": 1}, "not the JSON of a tool"),
    ([1, 2], "must be an object"),
    ({"top_pairs": "x", "score": 1, "remainder": 0}, "pairs must be a list"),
    ({"top_pairs": [{"query side": ["x"], "key side": "k", "term": 1}], "score": 1, "remainder": 0},
     "query side must be text"),
    ({"plain_text": "a", "steered_text": "b", "coefficient": "big"}, "coefficient must be a number"),
    ({"formats": [], "reference": "r"}, "formats must be an object"),
    ({"heads_scored": "x", "top": {}, "scores": []}, "heads_scored must be a list"),
    ({"heads_scored": [], "top": {"self": [[0]]}, "scores": ["self"]}, "top heads by self must be"),
    ({"heads_scored": [{"layer": "0", "head": 0}], "top": {}, "scores": ["self"]}, "layer must be a number"),
])
def test_a_bad_tool_json_is_refused_naming_the_field(doc, said):
    with pytest.raises(InputError, match=said):
        tool_sections([doc])


def test_the_doctors_report_with_its_determinism_section_is_recognised():
    assert kind_of({"determinism": {"trials": [], "headline": "1 runs"}, "findings": []}) == "determinism"
    (sec,) = tool_sections([{"determinism": {"headline": "3 runs, 1 distinct output(s)", "reference": "native",
                                             "trials": [{"label": "alone #2", "why": "again", "same_tokens": True,
                                                         "bit_identical": True, "first_step": None,
                                                         "logits_max_abs": 0.0, "first_stage": None}]}}])
    assert sec["rows"] == [["alone #2", "again", "yes", "yes", "", "", 0.0]]
    assert sec["caption"].startswith("3 runs, 1 distinct output(s)")


def test_the_cli_takes_tool_json_files_and_refuses_a_bad_one_before_running(capsys, tiny_model_dir, tmp_path, tools):
    qk, _ = tools
    good, bad = tmp_path / "qk.json", tmp_path / "bad.json"
    good.write_text(json.dumps(qk))
    bad.write_text("{not json")
    code, out, err = report(capsys, "Hello", "--model", str(tiny_model_dir), "--max-new-tokens", "2",
                            "--tool-json", str(good), "--out", str(tmp_path / "r.html"))
    assert code == 0, err
    html = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert [r[2] for r in embedded(html, "report-data")["tools"][0]["rows"]] == [p["term"] for p in qk["top_pairs"]]
    code, _, err = report(capsys, "Hello", "--model", str(tiny_model_dir), "--tool-json", str(bad),
                          "--out", str(tmp_path / "x.html"))
    assert code == 2 and "not valid JSON" in err.strip().splitlines()[-1] and not (tmp_path / "x.html").exists()


def test_the_atlas_section_is_the_atlas_own_ranking_from_its_json_or_its_dict(tiny_model):
    """The CLI's --json (lists, NaN as null) and the page's as_dict (tuples) give one section: the five top heads
    by each score at the atlas's numbers."""
    import math

    from engine.tools.head_atlas import SCORE_NAMES, head_atlas
    atlas = head_atlas(tiny_model, ["The cat sat on the mat. The cat sat on the mat."], repeats=1, length=16)
    d = atlas.as_dict()
    as_json = json.loads(json.dumps(d, default=list).replace("NaN", "null"))
    (a,), (b,) = tool_sections([d]), tool_sections([as_json])
    want = [[n, k + 1, r["layer"], r["head"], r[n]] for n in SCORE_NAMES for k, r in enumerate(atlas.ranked(n, 5))]
    assert [r[:4] for r in a["rows"]] == [r[:4] for r in b["rows"]] == [r[:4] for r in want]
    assert all(x[4] == w[4] or (x[4] is None and math.isnan(w[4])) for x, w in zip(a["rows"], want))
    assert a["id"] == "tool-atlas" and f"{atlas.layers} layers x {atlas.heads} heads" in a["caption"]
