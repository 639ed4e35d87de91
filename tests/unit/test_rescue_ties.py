"""The fp32 rescue's ties, progress and printed check on tiny models (engine.tools.rescue, engine.cli.prescribe):
a different top-1 within the tie margin is a tie and never buys a unit; progress counts every rerun and ends
at its total; the printed check command, run as printed, gives the search's verdict."""
from __future__ import annotations

import math
import re
import shlex

import pytest
import torch

from engine import RunSettings, SamplingParams, load_model
from engine.cli import main as cli_main
from engine.cli.prescribe import check_command
from engine.tools.rescue import RescueReport, find_rescue
from engine.tools.rescue_runs import Reference, judge, replay, tie_margin
from engine.variants import cast_model
from tests.helpers import tiny_config, tiny_tensors, write_model_dir

pytestmark = pytest.mark.unit
PROMPT = "I like apples. I like apples. I like"
A, B = 1000, 500                     # fp32 prefers A by ~0.001 logits; float16 cannot tell them apart
HEAD_A, HEAD_B = 10.0, 10.0 - 1e-3   # float16 spacing at 10 is 2^-7: both round to 10.0, and argmax takes B


@pytest.fixture(scope="module")
def tie_dir(tmp_path_factory, tokenizer_files):
    """A tiny model whose every step is a float-noise near tie: attention and MLP outputs are zero, so the
    stream is the token's embedding; the final norm keeps only feature 0 (positive for every token), and
    the unembedding maps it to A (10) and B (10 - 1e-3) alone."""
    cfg = tiny_config()
    t = tiny_tensors(cfg)
    for i in range(cfg["num_hidden_layers"]):
        t[f"model.layers.{i}.self_attn.o_proj.weight"].zero_()
        t[f"model.layers.{i}.mlp.down_proj.weight"].zero_()
    t["model.embed_tokens.weight"][:, 0] = t["model.embed_tokens.weight"][:, 0].abs() + 1
    t["model.norm.weight"] = torch.zeros(cfg["hidden_size"])
    t["model.norm.weight"][0] = 1.0
    head = torch.zeros_like(t["lm_head.weight"])
    head[A, 0], head[B, 0] = HEAD_A, HEAD_B
    t["lm_head.weight"] = head
    return write_model_dir(tmp_path_factory.mktemp("tie") / "tie-llama", tokenizer_files, cfg, t)


@pytest.fixture(scope="module")
def tie_model(tie_dir):
    return load_model(tie_dir, device="cpu", dtype="float32")


def run_as_printed(cmd: str, capsys) -> dict:
    """Run a printed `python -m engine ...` command in this process; the verdict of its fp32 check line."""
    argv = shlex.split(cmd)
    assert argv[:3] == ["python", "-m", "engine"]
    assert cli_main(argv[3:]) == 0
    out = capsys.readouterr().out
    listed = r"(none|\[[\d, ]*\])"
    m = re.search(r"^fp32 check \((.*?) in fp32;.*\): (passes|fails); finite (True|False).*top-1 agreement ([\d.]+) "
                  rf"outside ties; ties at steps {listed}; disagreements at steps {listed}$", out, re.M)
    assert m, out
    steps = (lambda s: [] if s == "none" else [int(x) for x in s.strip("[]").split(",")])
    near = re.search(r"^  (?:no )?near ties.*$", out, re.M).group(0)
    return {"units": m.group(1), "passes": m.group(2) == "passes", "finite": m.group(3) == "True",
            "top1_agreement": float(m.group(4)), "ties": steps(m.group(5)), "disagreements": steps(m.group(6)),
            "near_tie_steps": [int(x) for x in re.findall(r"step (\d+) \(", near)]}


def test_the_tie_margin_is_four_spacings_of_the_low_dtype_at_the_top_logits_size():
    assert tie_margin(20.0, torch.float16) == 4 * 2.0 ** -10 * 16 == 0.0625      # float16 numbers in [16, 32)
    assert tie_margin(-9.5, torch.float16) == 4 * 2.0 ** -10 * 8
    assert tie_margin(20.0, torch.bfloat16) == 4 * 2.0 ** -7 * 16 == 0.5
    assert tie_margin(1.0, torch.float16) == 4 * 2.0 ** -10
    assert 0 < tie_margin(0.0, torch.float16) < 1e-6


def test_a_different_top1_within_the_margin_is_a_tie_and_beyond_it_a_disagreement(tiny_model):
    """Reference logits written by hand around the plan's own top-1 at each step: the same token (agrees),
    fp32's best 0.05 ahead of it with a margin of 0.1 (a tie), and 0.2 ahead (a disagreement)."""
    low = cast_model(tiny_model, "float16")
    ids = tiny_model.tokenizer.encode(PROMPT)
    tokens = [11, 22, 33]
    mine = replay(low, ids, tokens[:-1]).argmax(-1).tolist()
    other = [next(t for t in range(7, 100) if t != p) for p in mine]
    logits = torch.zeros(3, tiny_model.config.vocab_size)
    logits[0, mine[0]] = 5.0
    logits[1, other[1]], logits[1, mine[1]] = 5.0, 5.0 - 0.05
    logits[2, other[2]], logits[2, mine[2]] = 5.0, 5.0 - 0.2
    reference = Reference(ids, tokens, [], None, logits, [0.1, 0.1, 0.1])
    trial = judge(reference, low, "by hand")
    assert trial.finite and trial.ties == [1] and trial.disagreements == [2]
    assert trial.top1_agreement == 0.5 and not trial.passes()           # 1 of the 2 steps that are not ties
    assert [t["step"] for t in reference.near_ties] == [1]
    assert reference.near_ties[0]["gap"] == pytest.approx(0.05, abs=1e-6)


def test_a_float_noise_tie_needs_no_unit_and_every_step_is_reported_as_one(tie_model):
    low = cast_model(tie_model, "float16")
    assert float(low.weights.lm_head[0, A]) == float(low.weights.lm_head[0, B]) == 10.0
    report = find_rescue(tie_model, low, RunSettings(prompt=PROMPT, chat=False))
    assert report.fp32 == [] and report.trigger == [] and report.reruns == 1 and report.verified
    assert report.ties == list(range(8)) and report.trials[0].disagreements == []  # float16 takes B, fp32 A
    # fp32's gap, by hand: the stream is the embedding of the token read, normed; only feature 0 reaches A, B
    ids = tie_model.tokenizer.encode(PROMPT)
    read = [ids[-1]] + [A] * 7                                           # greedy fp32 chose A at every step
    eps = tie_model.config.rms_norm_eps
    for step, near in zip(range(8), report.near_ties):
        x = tie_model.weights.embed[read[step]]
        h0 = float(x[0] / torch.sqrt((x * x).mean() + eps))
        gap = h0 * (HEAD_A - float(torch.tensor(HEAD_B)))
        assert near["step"] == step and near["gap"] == pytest.approx(gap, abs=1e-5)
        assert near["margin"] == 4 * 2.0 ** -10 * 2.0 ** math.floor(math.log2(h0 * HEAD_A))


def test_progress_counts_every_rerun_and_ends_at_its_total(tiny_model):
    """Two overflows: the search needs a second round, 13 reruns against a one-culprit bound of 9."""
    seen = []
    report = find_rescue(tiny_model, cast_model(tiny_model, "float16"), RunSettings(prompt=PROMPT, chat=False),
                         injections=["scale=1e6@blocks.0.mlp.up", "scale=1e6@blocks.1.mlp.up"],
                         on_progress=lambda p: seen.append((p.fraction, p.what)))
    assert report.fp32 == ["blocks.0.mlp", "blocks.0.resid", "blocks.1.mlp"] and report.reruns > report.bound
    reruns = [(f, *map(int, re.match(r"rerun (\d+) of (\d+): ", msg).groups())) for f, msg in seen[:-1]]
    assert [k for _, k, _ in reruns] == list(range(1, report.reruns + 1))
    for f, k, total in reruns:
        assert total >= k and f == (k - 1) / total < 1
    assert reruns[-1][1] == reruns[-1][2] == report.reruns                # the last rerun is the total's last
    assert seen[-1] == (1.0, f"done: {report.reruns} of {report.reruns} reruns")


def test_the_check_command_carries_the_runs_settings():
    report = RescueReport("float16", ["scale=4@blocks.1.mlp.act"], 10, 6, ["nonfinite"],
                          ["blocks.1.mlp", "blocks.1.resid"], True, True, 1.0, None, 9, 8, norm_eps=0.0)
    settings = RunSettings(prompt="it's", chat=True, system="be brief", max_new_tokens=40, seed=3,
                           params=SamplingParams(temperature=0.7, top_k=40))
    assert check_command(settings, report, device="cpu", model="/m dir") == (
        "python -m engine doctor 'it'\"'\"'s' --chat --system 'be brief' --model '/m dir' --device cpu --dtype float16 "
        "--inject scale=4@blocks.1.mlp.act --norm-eps 0.0 --temperature 0.7 --top-k 40 --seed 3 --max-new-tokens 6 "
        "--fp32 blocks.1.mlp,blocks.1.resid --verify")
    dash = check_command(RunSettings(prompt="-x", chat=False), report)
    assert dash.endswith("--verify -- -x") and " -x " not in dash.removesuffix("-- -x")
    report.fp32 = None
    assert check_command(settings, report) is None


def test_the_printed_check_gives_the_searchs_verdict_on_a_tie_and_on_an_overflow(tie_model, tie_dir, tiny_model,
                                                                                 tiny_model_dir, capsys):
    settings = RunSettings(prompt=PROMPT, chat=False)
    tie = find_rescue(tie_model, cast_model(tie_model, "float16"), settings)
    cmd = check_command(settings, tie, device="cpu", model=str(tie_dir))
    assert "--fp32" not in cmd and cmd.endswith("--max-new-tokens 8 --verify")
    got = run_as_printed(cmd, capsys)
    assert got == {"units": "no unit", "passes": True, "finite": True, "top1_agreement": 1.0, "ties": tie.ties,
                   "disagreements": [], "near_tie_steps": [t["step"] for t in tie.near_ties]}
    over = find_rescue(tiny_model, cast_model(tiny_model, "float16"), settings,
                       injections=["scale=1e6@blocks.1.mlp_out"], max_new_tokens=6)
    assert over.fp32 == ["blocks.1.resid"]
    got = run_as_printed(check_command(settings, over, device="cpu", model=str(tiny_model_dir)), capsys)
    verified = over.trials[-2]                                           # the set's rerun, before the complement
    assert got == {"units": "blocks.1.resid", "passes": True, "finite": True,
                   "top1_agreement": round(verified.top1_agreement, 3), "ties": verified.ties,
                   "disagreements": verified.disagreements, "near_tie_steps": [t["step"] for t in over.near_ties]}
