"""Issue 23, item 4, on the bundled model in float16: the fp16-overflow preset on "The quick brown fox", 8
tokens. fp32's top two at step 4 are 0.0031 logits apart; the rescue set must hold only what the overflow
needs (blocks.11.mlp, blocks.11.resid: without either the logits are not finite), call step 4 a near tie,
and the check command it prints, run as printed, must give the search's verdict."""
from __future__ import annotations

import math
import re

import pytest
import torch

from engine import RunSettings
from engine.cli.prescribe import check_command
from engine.generate import GenerationRun
from engine.tools.doctor import PRESETS
from engine.tools.rescue import find_rescue
from engine.tools.rescue_runs import fault_only_probe, fp32_reference, judge
from engine.variants import cast_model, precision_plan
from tests.unit.test_rescue_ties import run_as_printed

pytestmark = pytest.mark.model
PROMPT = "The quick brown fox"
SETTINGS = RunSettings(prompt=PROMPT, chat=False, max_new_tokens=8)
FAULT = PRESETS["fp16-overflow"].injections                    # scale=4@blocks.11.mlp.act


@pytest.fixture(scope="module")
def fp16(bundled_model):
    return cast_model(bundled_model, "float16")


@pytest.fixture(scope="module")
def searched(bundled_model, fp16):
    seen = []
    report = find_rescue(bundled_model, fp16, SETTINGS, injections=FAULT,
                         on_progress=lambda p: seen.append((p.fraction, p.what)))
    print(f"\nrescue: {report.reruns} reruns -> {report.fp32}; near ties {report.near_ties}; ties {report.ties}")
    return report, seen


def test_the_set_is_the_two_units_the_overflow_needs_and_either_alone_is_not_finite(bundled_model, fp16, searched):
    report, _ = searched
    assert report.fp32 == ["blocks.11.mlp", "blocks.11.resid"] and report.verified and report.finite
    assert report.trigger[0] == "nonfinite" and report.top1_agreement == 1.0
    reference = fp32_reference(bundled_model, torch.float16, SETTINGS, 8, injections=FAULT)
    for unit in report.fp32:
        alone = judge(reference, precision_plan(fp16, [u for u in report.fp32 if u != unit], source=bundled_model))
        assert not alone.finite and alone.first_nonfinite == "blocks.11.mlp_out"


def test_step_4_is_reported_as_a_near_tie_with_fp32s_own_gap(bundled_model, searched):
    """The gap from fp32's own generation (the softmax of its logits: log p1 / p2), not from the replay."""
    report, _ = searched
    run = GenerationRun(bundled_model, PROMPT, max_new_tokens=8, ignore_eos=True,
                        probe=fault_only_probe(bundled_model, FAULT, None)).run()
    gaps = [math.log(s.top[0].prob / s.top[1].prob) for s in run.steps]
    assert gaps[4] == pytest.approx(0.0031, abs=1e-4)
    near = {t["step"]: t for t in report.near_ties}
    assert sorted(near) == [1, 4]                                  # 0.0337 and 0.0031; step 3's 0.081 is not
    for step, t in near.items():
        assert t["gap"] == pytest.approx(gaps[step], abs=1e-4) and t["margin"] == 4 * 2.0 ** -10 * 16
    assert min(g for i, g in enumerate(gaps) if i not in near) > 0.0625


def test_the_printed_check_run_as_printed_gives_the_searchs_verdict(searched, capsys):
    report, _ = searched
    cmd = check_command(SETTINGS, report, device="cpu")
    assert cmd == ("python -m engine doctor 'The quick brown fox' --device cpu --dtype float16 --inject "
                   "scale=4@blocks.11.mlp.act --max-new-tokens 8 --fp32 blocks.11.mlp,blocks.11.resid --verify")
    verified = report.trials[-2]                                   # the set's own rerun, before the complement
    assert verified.units == ["blocks.11.mlp", "blocks.11.resid"] and verified.passes()
    assert run_as_printed(cmd, capsys) == {
        "units": "blocks.11.mlp, blocks.11.resid", "passes": True, "finite": True,
        "top1_agreement": round(verified.top1_agreement, 3), "ties": verified.ties,
        "disagreements": verified.disagreements, "near_tie_steps": [1, 4]}


def test_progress_counts_the_reruns_done_and_ends_at_its_total(searched):
    report, seen = searched
    reruns = [(f, *map(int, re.match(r"rerun (\d+) of (\d+): ", m).groups())) for f, m in seen[:-1]]
    assert [k for _, k, _ in reruns] == list(range(1, report.reruns + 1))
    assert all(total >= k and f == (k - 1) / total < 1 for f, k, total in reruns)
    assert reruns[-1][1] == reruns[-1][2] == report.reruns and seen[-1][0] == 1.0
