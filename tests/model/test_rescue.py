"""fp32 rescue on the bundled model in float16: for the fp16-overflow preset and two planted scale faults, the
rescue set holds the planted layer's unit, was found within the rerun bound, and the doctor run with
`--fp32 <set>` is finite while the run with its complement is not."""
from __future__ import annotations

import argparse
import time

import pytest

from engine import RunSettings
from engine.cli.prescribe import add_doctor_flags, doctor_model
from engine.tools.doctor import PRESETS, run_doctor
from engine.tools.rescue import complement, find_rescue, precision_units, unit_layer
from engine.variants import cast_model

pytestmark = pytest.mark.model
PROMPT = "The capital of France is"
CASES = {   # name: (injections, planted layer)
    "fp16-overflow": (PRESETS["fp16-overflow"].injections, 11),
    "mlp_out x1e6, layer 5": (("scale=1e6@blocks.5.mlp_out",), 5),
    "q_rot x1e4, layer 20": (("scale=1e4@blocks.20.attn.q_rot",), 20),
}


@pytest.fixture(scope="module")
def fp16(bundled_model):
    return cast_model(bundled_model, "float16")


@pytest.fixture(scope="module", params=list(CASES))
def rescued(request, bundled_model, fp16):
    injections, layer = CASES[request.param]
    t0 = time.perf_counter()
    report = find_rescue(bundled_model, fp16, RunSettings(prompt=PROMPT, chat=False), injections=injections)
    print(f"\nrescue {request.param}: {time.perf_counter() - t0:.1f} s, {report.reruns} reruns -> {report.fp32}")
    return injections, layer, report


def doctor_args(units: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model"), p.add_argument("--device"), p.add_argument("--dtype")
    add_doctor_flags(p)
    return p.parse_args(["--device", "cpu", "--fp32", ",".join(units)])


def test_the_set_holds_the_planted_layers_unit_and_was_found_within_the_bound(rescued):
    _, layer, report = rescued
    assert report.trigger[0] == "nonfinite" and report.trials[0].first_nonfinite.startswith(f"blocks.{layer}.")
    assert report.fp32 and any(unit_layer(u) == layer for u in report.fp32)
    assert report.verified and report.finite and report.top1_agreement >= 0.99
    assert report.bound == 7 + 6 and report.reruns <= report.bound              # ceil(log2 92) + 6
    assert report.complement and not report.complement["fixes"] and not report.complement["finite"]


def test_the_doctor_with_the_set_is_finite_and_with_its_complement_is_not(rescued, fp16):
    injections, _, report = rescued
    with_set = run_doctor(doctor_model(fp16, doctor_args(report.fp32)), PROMPT, injections=injections,
                          max_new_tokens=report.tokens)
    assert with_set.first_nonfinite is None and with_set.dtype == "float16"
    rest = complement(precision_units(30), report.fp32)
    without = run_doctor(doctor_model(fp16, doctor_args(rest)), PROMPT, injections=injections,
                         max_new_tokens=report.tokens)
    assert without.first_nonfinite is not None
