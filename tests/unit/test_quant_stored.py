"""Issue 44 item 3: a GGUF file as stored against its dequantised self (engine.tools.quant_stored), stage by stage.
The reference is computed here on its own: the tiny GGUF (tests/unit/test_gguf_as_stored.write_gguf) loaded both ways
with two load_model calls, every stage captured on each side, max |Δ| and relative L2 taken by hand in float64, and
KL(p_deq || p_stored) from float64 softmaxes. The tool's figures must be those numbers (they come from the same two
forwards: a difference beyond float64 rounding of the same tensors is a bug); the tolerance judges them."""
from __future__ import annotations

import json

import pytest
import torch

from engine import RunSettings, SamplingParams
from engine.errors import InputError
from engine.generate import GenerationRun
from engine.inspection.probe import Probe
from engine.inspection.stages import forward_stages
from engine.report.tools import kind_of, tool_sections
from engine.tools.quant_stored import TOLERANCE, compare_stored, stored_report
from tests.unit.test_gguf_as_stored import both, cache, write_gguf  # noqa: F401 (cache: the fixture)

pytestmark = pytest.mark.unit

SETTINGS = RunSettings(prompt="hello hello", chat=False, max_new_tokens=4, params=SamplingParams(temperature=0), seed=0)


@pytest.fixture
def pair(cache):  # noqa: F811
    return both(write_gguf(cache / "tiny.gguf"))


def hand(stored, floats, ids):
    """Every stage of both sides, captured whole (positions first), and both logits."""
    names = forward_stages(floats.config, maps=False)
    ps, pf = Probe().capture(names), Probe().capture(names)
    ls, lf = stored.logits(ids, ps), floats.logits(ids, pf)
    cs = {c.name: c.value.double() for c in ps.recording.captures}
    cf = {c.name: c.value.double() for c in pf.recording.captures}
    return names, cs, cf, ls.double(), lf.double()


def test_every_stage_and_step_is_the_hand_computed_difference(pair):
    stored, floats = pair
    run = GenerationRun(floats, SETTINGS.prompt, params=SETTINGS.params, max_new_tokens=4, ignore_eos=True).run()
    ids, n = run.all_ids, len(run.prompt_ids)
    report = stored_report(stored, floats, SETTINGS)
    assert report.positions == len(ids) and report.steps == 4 and report.text == run.text
    names, cs, cf, ls, lf = hand(stored, floats, ids)
    assert [r["stage"] for r in report.per_stage] == names
    steps = range(n - 1, len(ids) - 1)
    nonzero = 0
    for r in report.per_stage:
        d = cs[r["stage"]] - cf[r["stage"]]
        assert r["max_abs"] == pytest.approx(float(d.abs().max()), rel=1e-9, abs=1e-12)
        assert r["rel_l2"] == pytest.approx(float(d.norm() / cf[r["stage"]].norm()), rel=1e-9, abs=1e-12)
        assert r["max_abs_steps"] == pytest.approx([float(d[p].abs().max()) for p in steps], rel=1e-9, abs=1e-12)
        assert r["rel_l2_steps"] == pytest.approx([float(d[p].norm() / cf[r["stage"]][p].norm()) for p in steps],
                                                  rel=1e-9, abs=1e-12)
        nonzero += r["max_abs"] > 0
    assert nonzero > len(names) // 2          # the two paths sum in other orders: real, small differences
    p, q = torch.softmax(lf[list(steps)], -1), torch.softmax(ls[list(steps)], -1)
    kl = (p * (p.log() - q.log())).sum(-1)
    assert [s["kl"] for s in report.per_step] == pytest.approx(kl.clamp(min=0).tolist(), abs=1e-12)
    assert [s["same_top"] for s in report.per_step] == (p.argmax(-1) == q.argmax(-1)).tolist()
    assert report.logits_max_abs == pytest.approx(float((ls - lf)[list(steps)].abs().max()), rel=1e-9)
    # the same file's own values both ways: rounding only, far under the stated tolerance
    assert report.first_stage_over is None and all(r["rel_l2"] <= TOLERANCE for r in report.per_stage)
    assert report.same_top == 1.0 and report.own_first_divergence is None
    assert set(report.stored_bytes) - {"float32"} and set(report.dequantized_bytes) == {"float32"}


def test_the_tolerance_judges_each_stage_in_forward_order(pair):
    stored, floats = pair
    ids = [1, 260, 72, 101, 262, 33, 0, 5]
    names, cs, cf, _, _ = hand(stored, floats, ids)
    rel = {k: float((cs[k] - cf[k]).norm() / cf[k].norm()) for k in names}
    tol = sorted(v for v in rel.values() if v > 0)[len(rel) // 2]       # a tolerance half the stages exceed
    report = compare_stored(stored, floats, ids, 4, tolerance=tol)
    assert [r["over"] for r in report.per_stage] == [v > tol for v in rel.values()]
    assert report.first_stage_over == next(k for k in names if rel[k] > tol)


def test_a_pair_that_is_not_one_file_both_ways_is_refused(pair):
    stored, floats = pair
    with pytest.raises(InputError, match="no matrix is kept quantised"):
        compare_stored(floats, floats, [1, 2, 3], 2)
    with pytest.raises(InputError, match="dequantised to float32"):
        compare_stored(stored, stored, [1, 2, 3], 2)
    with pytest.raises(InputError, match="tolerance must be a positive number"):
        compare_stored(stored, floats, [1, 2, 3], 2, tolerance=float("nan"))


def test_the_cli_twin_prints_the_tools_json_and_the_report_shows_it(pair, cache, capsys):  # noqa: F811
    from engine.cli import main

    stored, floats = pair
    path = cache / "tiny.gguf"
    assert main(["quant-stored", SETTINGS.prompt, "--model", str(path), "--max-new-tokens", "4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = stored_report(stored, floats, SETTINGS).as_dict()
    assert got["per_stage"] == want["per_stage"] and got["per_step"] == want["per_step"]
    assert got["kl_mean"] == want["kl_mean"] and got["first_stage_over"] is None
    assert kind_of(got) == "stored"
    section = tool_sections([got])[0]
    worst = sorted(want["per_stage"], key=lambda r: -r["rel_l2"])[:len(section["rows"])]
    assert section["id"] == "tool-stored" and [r[:3] for r in section["rows"]] == [
        [r["stage"], r["max_abs"], r["rel_l2"]] for r in worst]
    assert main(["quant-stored", "x", "--model", str(path), "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be at least 1" in capsys.readouterr().err
