"""The tuned lens' CLI twin (python -m engine lens) and its place in the offline report: on a model with no lens it
says "not fitted yet" and fits nothing; --fit fits, keeps and compares (the JSON's KL per layer is the engine's,
recomputed here from the kept lens); a second call finds the kept lens; the report's Tools section draws that JSON's
numbers, and a tuned-lens JSON with a wrong type is refused naming the field."""
from __future__ import annotations

import json

import pytest

from engine.errors import InputError
from engine.report.html import build_html
from engine.report.tools import kind_of, tool_sections
from engine.tools.lens_file import find_lens
from engine.tools.tuned_lens import compare_lenses
from tests.helpers import engine_cli
from tests.unit.test_report import embedded
from tests.unit.test_report_tools import trace  # noqa: F401 (the report's run, a fixture)

pytestmark = pytest.mark.unit
HELD = "The lens reads each layer's stream, and the numbers go one, two, three, four, five."


@pytest.fixture(scope="module")
def lens_json(tiny_model_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("lens-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("LLM_INSPECTOR_CACHE", str(cache))
    base = ("lens", "--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32", "--text", HELD)
    try:
        refused = engine_cli(*base)
        fitted = engine_cli(*base, "--fit", "--fit-tokens", "600", "--rank", "8", "--json")
        again = engine_cli(*base, "--json")
    finally:
        mp.undo()
    return refused, fitted, again, cache


def test_the_cli_fits_on_asking_and_prints_the_engines_kl(lens_json, tiny_model, monkeypatch):
    refused, fitted, again, cache = lens_json
    assert refused.returncode == 2 and "not fitted yet" in refused.stderr and "--fit" in refused.stderr
    assert fitted.returncode == 0, fitted.stderr
    d = json.loads(fitted.stdout)
    assert d["kind"] == "tuned-lens" and d["fitted_now"] is True and d["rank"] == 8 and d["layers"] == 2
    assert d["recipe"]["script"] == "python -m engine lens --fit" and 500 <= d["recipe"]["tokens"] <= 600
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(cache))
    kept = find_lens(tiny_model)
    want = compare_lenses(tiny_model, kept, [HELD])
    assert [k["logit_lens"] for k in d["kl"]] == pytest.approx(want.logit_kl, rel=1e-6)
    assert [k["tuned_lens"] for k in d["kl"]] == pytest.approx(want.tuned_kl, rel=1e-6)
    assert d["tokens"] == want.tokens
    e = json.loads(again.stdout)
    assert again.returncode == 0 and e["fitted_now"] is False and e["kl"] == d["kl"]


def test_the_report_draws_the_lens_json(lens_json, trace, tiny_model):  # noqa: F811
    d = json.loads(lens_json[1].stdout)
    assert kind_of(d) == "tuned-lens"
    html = build_html(trace, tokenizer=tiny_model.tokenizer, tools=[d])
    (section,) = embedded(html, "report-data")["tools"]
    assert section["id"] == "tool-tuned-lens" and section["header"] == ["layer", "KL logit lens", "KL tuned lens"]
    assert section["rows"] == [[k["layer"], k["logit_lens"], k["tuned_lens"]] for k in d["kl"]]
    assert "python -m engine lens --fit" in section["caption"]
    with pytest.raises(InputError, match="the tool's KL must be a number"):
        tool_sections([{**d, "kl": [{"layer": 0, "logit_lens": "high", "tuned_lens": 1.0}]}])
