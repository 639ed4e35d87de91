"""The determinism doctor (engine.tools.determinism, `doctor --determinism`): a trial's comparison finds exactly the
step and stage where a planted difference enters (a known answer: +1e-3 on one element of blocks.1.mlp_out at step
2 of an otherwise identical run), reports identical runs as bit-identical, counts distinct outputs as a hand count
does, runs its batch trials inside forwards shared with the other runs, and refuses unbounded work by name."""
from __future__ import annotations

import json

import pytest
import torch

from engine import GenerationRun, InputError, SamplingParams
from engine.accelerator import PLAIN
from engine.inspection.probe import inspection_probe
from engine.settings import RunSettings
from engine.tools.determinism import DeterminismReport, DeterminismTrial, check_determinism, compare
from tests.helpers import engine_cli

pytestmark = pytest.mark.unit

PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0)


def _run(model, probe) -> GenerationRun:
    run = GenerationRun(model, PROMPT, params=GREEDY, max_new_tokens=6, ignore_eos=True, probe=probe)
    run.run()
    return run


def test_a_planted_difference_is_found_at_its_step_and_stage(tiny_model):
    model = tiny_model.with_accelerator(PLAIN)

    def plant(x, ctx):
        if ctx.step == 2:
            x = x.clone()
            x[-1, 3] += 1e-3
            return x
        return None
    ref = _run(model, inspection_probe(timing=False))
    got = _run(model, inspection_probe(timing=False).replace("blocks.1.mlp_out", plant))
    t = compare(ref, got)
    assert not t.bit_identical
    assert t.first_step == 2                                    # steps 0 and 1 computed the same logits
    assert t.first_stage["step"] == 2 and t.first_stage["stage"] == "blocks.1.mlp_out"
    # the planted row's statistics moved by what the plant makes of them (its max, mean, ...: at most the 1e-3)
    assert 0 < t.first_stage["by"] <= 1e-3 * (1 + 1e-6)
    ra = ref.probe.recording.captured("logits", 2)[0].value
    rb = got.probe.recording.captured("logits", 2)[0].value
    assert t.logits_max_abs == float((ra - rb).abs().max()) > 0


def test_the_same_run_again_is_bit_identical(tiny_model):
    model = tiny_model.with_accelerator(PLAIN)
    t = compare(_run(model, inspection_probe(timing=False)), _run(model, inspection_probe(timing=False)))
    assert t.bit_identical and t.same_tokens and t.first_step is None and t.first_stage is None


def test_the_report_counts_distinct_outputs_and_its_batches_share_forwards(tiny_model):
    s = RunSettings(prompt=PROMPT, chat=False, max_new_tokens=8, params=GREEDY, ignore_eos=True)
    rep = check_determinism(tiny_model, s, repeats=2, batches=(3,), other_dtype=None)
    labels = [t.label for t in rep.trials]
    assert labels[:2] == ["alone #2", "in a batch of 3"]
    assert rep.trials[0].bit_identical                          # alone twice: the same kernels, the same order
    batch = rep.trials[1]
    assert batch.axis == "batch" and batch.same_tokens
    assert batch.notes and int(batch.notes[0].split()[0]) > 0   # its decode steps shared forwards
    hand = len({tuple(rep.token_ids)} | {tuple(t.token_ids) for t in rep.trials})
    assert rep.distinct_outputs == hand
    assert rep.headline.startswith(f"{len(rep.trials) + 1} runs, {hand} distinct output(s)")


def test_distinct_outputs_leave_out_the_dtype_trial():
    t = DeterminismTrial(label="bfloat16", axis="dtype", why="", token_ids=[9], text="", same_tokens=False,
              bit_identical=False)
    same = DeterminismTrial(label="alone #2", axis="repeat", why="", token_ids=[1], text="", same_tokens=True,
                 bit_identical=True)
    rep = DeterminismReport(prompt="p", reference="r", token_ids=[1], text="", trials=[same, t], skipped=[])
    assert rep.distinct_outputs == 1


@pytest.mark.parametrize("kw, msg", [(dict(repeats=0), "repeats"), (dict(batches=(1,)), "batch sizes"),
                                     (dict(batches=(31,)), "batch sizes"),
                                     (dict(repeats=8, batches=(30, 30, 20)), "at most 80")])
def test_unbounded_work_is_refused_by_name(tiny_model, kw, msg):
    s = RunSettings(prompt=PROMPT, chat=False, max_new_tokens=4, params=GREEDY)
    with pytest.raises(InputError, match=msg):
        check_determinism(tiny_model, s, **kw)
    with pytest.raises(InputError, match="at most 64 new tokens"):
        check_determinism(tiny_model, RunSettings(prompt=PROMPT, max_new_tokens=65))


def test_the_doctor_cli_reports_each_trial(tiny_model_dir):
    r = engine_cli("doctor", PROMPT, "--model", tiny_model_dir, "--max-new-tokens", "4", "--temperature", "0",
                   "--determinism", "--determinism-repeats", "2", "--determinism-batches", "2",
                   "--determinism-dtype", "bfloat16", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)["determinism"]
    labels = [t["label"] for t in d["trials"]]
    assert labels[:2] == ["alone #2", "in a batch of 2"] and labels[-1] == "bfloat16"
    assert d["trials"][0]["bit_identical"] is True
    bf16 = d["trials"][-1]
    assert bf16["axis"] == "dtype" and not bf16["bit_identical"] and bf16["first_step"] == 0
    bad = engine_cli("doctor", PROMPT, "--model", tiny_model_dir, "--determinism", "--determinism-batches", "x")
    assert bad.returncode != 0 and "--determinism-batches" in bad.stderr


def test_one_thread_is_a_trial_only_where_there_are_more(tiny_model):
    s = RunSettings(prompt=PROMPT, chat=False, max_new_tokens=3, params=GREEDY)
    rep = check_determinism(tiny_model, s, repeats=1, batches=())
    has = any(t.axis == "threads" for t in rep.trials)
    assert has == (torch.get_num_threads() > 1)
    assert has or any(x.startswith("threads:") for x in rep.skipped)
