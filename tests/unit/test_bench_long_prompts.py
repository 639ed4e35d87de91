"""python -m engine bench's long-prompt keys (issue 21 item 12): a_over_c_prefill_512 / _2048 (this engine's plain
prefill against transformers') and app_run_ratio_2048 (the app's whole run against engine generate). No timed
assertion: each key must be the median of the ratios of the times the bench measured, and what was timed must
be the same work on both sides (the same next-token distribution as transformers; the same tokens as the
plain run, with the app's record complete)."""
from __future__ import annotations

import argparse
import json
import statistics

import pytest
import torch

from engine.bench.app_run import app_run_ratio, prompt_of_length
from engine.bench.prefill import engine_prefill, hf_prefill, prefill_vs_transformers
from engine.bench.speed import hf_load, run_bench
from engine.generate import prompt_ids


@pytest.fixture(scope="module")
def hf(tiny_model):
    pytest.importorskip("transformers")
    return hf_load(tiny_model)


@pytest.mark.reference             # against transformers' prefill: the reference tier
def test_prefill_keys_are_medians_of_the_rounds_ratios(tiny_model, hf):
    out = prefill_vs_transformers(tiny_model, hf, (512, 2048), rounds=3)
    for n in (512, 2048):
        times = out["prefill_rounds"][n]
        assert len(times) == 3 and all(a > 0 and c > 0 for a, c in times)
        assert out[f"a_over_c_prefill_{n}"] == pytest.approx(statistics.median(c / a for a, c in times))


@pytest.mark.reference             # against transformers' prefill: the reference tier
def test_both_prefills_compute_the_same_next_token_distribution(tiny_model, hf):
    ids = torch.randint(100, 40000, (600,), generator=torch.Generator().manual_seed(5)).tolist()  # two chunks
    _, step = engine_prefill(tiny_model, ids)
    _, logits = hf_prefill(hf, ids, tiny_model.device)
    probs = torch.softmax(logits, -1)
    top = torch.topk(probs, len(step.top))
    assert [c.id for c in step.top] == top.indices.tolist()
    assert [c.prob for c in step.top] == pytest.approx(top.values.tolist(), rel=1e-4, abs=1e-7)


def test_prompt_of_length_is_that_long_as_the_app_sees_it(tiny_model):
    for n in (37, 512):
        assert len(prompt_ids(tiny_model, prompt_of_length(tiny_model, n), chat=True)) == n


def test_app_run_ratio_is_the_median_of_app_over_plain(tiny_model):
    said = []
    out = app_run_ratio(tiny_model, 2048, new_tokens=3, rounds=2, say=said.append)
    times = out["app_run_rounds"]
    assert len(times) == 2 and all(a > 0 and p > 0 for a, p in times)
    assert out["app_run_ratio_2048"] == pytest.approx(statistics.median(a / p for a, p in times))
    assert out["app_run_2048_app_s"] == min(a for a, _ in times)
    assert out["app_run_tokens"] == 2048 and out["app_run_same_tokens"] is True
    assert "app_run_ratio" not in said[0] and "2,048-token prompt" in said[0]


@pytest.mark.reference             # against transformers' prefill: the reference tier
def test_bench_json_prints_the_keys(tiny_model, capsys):
    a = argparse.Namespace(prompt_tokens=16, new_tokens=4, repeats=1, json=True, app=True, app_lengths=(32,),
                           prefill_lengths=(512, 2048), app_run_tokens=256)
    assert run_bench(tiny_model, a) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("a_over_c_prefill_512", "a_over_c_prefill_2048", "app_run_ratio_256"):
        assert isinstance(out[key], float) and out[key] > 0, key
    assert not [k for k in out if k.endswith("_rounds")]
