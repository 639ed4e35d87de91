"""inspector.views.sampling against hand-computed distributions, and replayed against what a run actually did."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from engine import RunSettings, SamplingParams
from engine.sampling import entropy
from inspector.session.run import inspect_run
from inspector.views import sampling as smp

P5 = [0.5, 0.2, 0.15, 0.1, 0.05]
LOGITS5 = torch.tensor(P5).log()           # softmax(LOGITS5) == P5


def text(i: int) -> str:
    return f"t{i}"


def kept(params: SamplingParams, logits=LOGITS5, context=(), generated=()) -> int:
    _, summary = smp.compare(logits, {"x": params}, list(context), list(generated), text)
    return int(summary["kept"].iloc[0])


@pytest.mark.parametrize("top_p, expected", [
    (0.3, 1),     # 0.5 alone reaches 0.3
    (0.65, 2),    # 0.5 < 0.65 <= 0.5 + 0.2
    (0.8, 3),     # 0.7 < 0.8 <= 0.85
    (0.9, 4),     # 0.85 < 0.9 <= 0.95
    (0.97, 5),
])
def test_top_p_kept_count_hand(top_p, expected):
    assert kept(SamplingParams(temperature=1.0, top_p=top_p)) == expected


def test_top_p_after_temperature_hand():
    # T = 2: p ∝ sqrt(P5) = .7071 .4472 .3873 .3162 .2236 (sum 2.0815) -> .3397 .2149 .1861 .1519 .1074;
    # cumulative .3397 .5546 .7407: top-p 0.6 needs three tokens (at T = 1 it needs two)
    assert kept(SamplingParams(temperature=2.0, top_p=0.6)) == 3
    assert kept(SamplingParams(temperature=1.0, top_p=0.6)) == 2


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(temperature=1.0, top_k=3), 3),
    (SamplingParams(temperature=1.0, top_k=1), 1),
    (SamplingParams(temperature=1.0, min_p=0.35), 2),    # threshold 0.175: 0.5, 0.2
    (SamplingParams(temperature=1.0, min_p=0.25), 3),    # threshold 0.125: 0.5, 0.2, 0.15
    (SamplingParams(temperature=1.0, min_p=0.05), 5),    # threshold 0.025
    # top-k 4 renormalises to .526 .211 .158 .105: cumulative .526 .737 .895 -> top-p 0.8 keeps 3
    (SamplingParams(temperature=1.0, top_k=4, top_p=0.8), 3),
    (SamplingParams(temperature=0.0, top_p=0.9), 1),     # greedy: one-hot
])
def test_top_k_min_p_kept_counts_hand(params, expected):
    assert kept(params) == expected


def test_entropy_of_known_distributions():
    probs = torch.softmax(torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3, -1)
    assert smp.entropy_nats(probs) == pytest.approx(entropy(probs), rel=1e-5)   # the engine's definition
    _, s = smp.compare(LOGITS5, {"T1": SamplingParams(temperature=1.0)}, [], [], text)
    hand = 0.5 * math.log(2) + 0.2 * math.log(5) + 0.15 * math.log(1 / 0.15) + 0.1 * math.log(10) + 0.05 * math.log(20)
    assert s["entropy"].iloc[0] == pytest.approx(hand, abs=1e-5)            # 1.33307 nats
    logits = torch.tensor([0.0] * 4 + [-1.0] * 4)
    _, s = smp.compare(logits, {"u": SamplingParams(temperature=1.0, top_k=4)}, [], [], text)
    assert s["entropy"].iloc[0] == pytest.approx(math.log(4), abs=1e-6)      # uniform over the 4 kept
    assert s["mass_kept"].iloc[0] == pytest.approx(1 / (1 + math.exp(-1)), abs=1e-6)
    _, s = smp.compare(torch.zeros(8), {"u": SamplingParams(temperature=1.0, top_k=4)}, [], [], text)
    assert s["kept"].iloc[0] == 8                                            # top-k keeps every tie at the k-th
    assert s["entropy"].iloc[0] == pytest.approx(math.log(8), abs=1e-6)


def test_compare_side_by_side_ranks_cut_and_chosen():
    settings = {"A": SamplingParams(temperature=1.0), "B": SamplingParams(temperature=1.0, top_p=0.65),
                "C": SamplingParams(temperature=1.0, min_p=0.25)}
    tokens, summary = smp.compare(LOGITS5, settings, [], [], text, top_n=5, chosen=2)
    assert list(summary["kept"]) == [5, 2, 3]
    for label, n in zip("ABC", [5, 2, 3]):
        d = tokens[tokens["setting"] == label]
        assert list(d["token_id"]) == [0, 1, 2, 3, 4] and list(d["rank"]) == [1, 2, 3, 4, 5]
        assert list(d["kept"]) == [True] * n + [False] * (5 - n)          # what is kept is a prefix
        assert d["before"].tolist() == pytest.approx(P5, abs=1e-6)
        assert list(d["chosen"]) == [False, False, True, False, False]
    b = tokens[tokens["setting"] == "B"]
    assert b["prob"].tolist() == pytest.approx([0.5 / 0.7, 0.2 / 0.7, 0, 0, 0], abs=1e-6)
    assert summary.set_index("setting").loc["B", "chosen_prob"] == 0.0       # the run's token is cut under B
    assert summary.set_index("setting").loc["C", "chosen_prob"] == pytest.approx(0.15 / 0.85, abs=1e-6)
    fig = smp.compare_figure(tokens, summary)
    bars = [t for t in fig.data if t.type == "bar"]
    assert len(bars) == 9                                                    # kept, cut, chosen per panel
    panel_b = {t.name: (t.marker.color, [x.split(".")[0] for x in t.x]) for t in bars if t.xaxis == "x2"}
    assert panel_b == {"kept (probability before the cut)": (smp.KEPT, ["1", "2"]),
                       "cut by top-k / top-p / min-p": (smp.CUT, ["4", "5"]),
                       "the run's token": (smp.CHOSEN, ["3"])}
    # the legend names each colour once, with the colour it shows (one trace per colour, never mixed), taken
    # from a panel that has such bars (A cuts nothing: "cut" comes from B, whose tokens 4 and 5 are cut)
    legend = [(t.name, t.marker.color, len(t.x)) for t in fig.data if t.showlegend is not False]
    assert sorted(legend) == sorted([("kept (probability before the cut)", smp.KEPT, 4),
                                     ("cut by top-k / top-p / min-p", smp.CUT, 2), ("the run's token", smp.CHOSEN, 1),
                                     ("final sampling probability", "black", 5)])
    cut_lines = [s for s in fig.layout.shapes if s.type == "line"]
    assert sorted(s.x0 for s in cut_lines) == [1.5, 2.5]                    # B after 2 tokens, C after 3; none for A


def test_penalties_use_context_and_generated():
    # presence 5 on token 0 (generated): its logit falls from ln .5 to ln .5 - 5, so token 1 leads
    p = SamplingParams(temperature=1.0, top_k=1, presence_penalty=5.0)
    tokens, _ = smp.compare(LOGITS5, {"x": p}, [0], [0], text, top_n=5)
    assert tokens["token_id"].iloc[0] == 1 and tokens["token_id"].iloc[-1] == 0
    assert tokens.loc[tokens["kept"], "token_id"].tolist() == [1]
    # repetition penalty 2 on the context [1, 2]: negative logits are multiplied (more negative)
    chain = smp.chain_table(smp.sampler_chain(LOGITS5, SamplingParams(temperature=1.0, repetition_penalty=2.0),
                                              [1, 2], []), text)
    assert "'t3'" in chain.loc[0, "top tokens (prob at this stage)"].split(",")[1]  # 0.1 now beats 0.2² and 0.15²


def test_chain_table_stage_by_stage():
    p = SamplingParams(temperature=1.0, top_k=4, top_p=0.8, min_p=0.35)
    chain = smp.chain_table(smp.sampler_chain(LOGITS5, p, [], []), text, top_n=3)
    assert list(chain["stage"]) == ["penalties", "temperature", "top_k", "top_p", "min_p", "probs"]
    # top-k 4 -> 4; top-p 0.8 -> 3 (see above); min-p 0.35 of .588 = .206 keeps .588, .235 -> 2
    assert list(chain["kept"]) == [5, 5, 4, 3, 2, 2]
    assert chain["entropy"].iloc[-1] == pytest.approx(-(5 / 7 * math.log(5 / 7) + 2 / 7 * math.log(2 / 7)), abs=1e-5)
    assert chain["top tokens (prob at this stage)"].iloc[-1] == "'t0' 0.714, 't1' 0.286"
    fig = smp.chain_figure(chain)
    assert list(fig.data[0].y) == [5, 5, 4, 3, 2, 2]


def test_empirical_draws_follow_the_probabilities():
    probs = torch.tensor(P5)
    df, stats = smp.empirical(probs, n=20_000, seed=0, token_text=text)
    assert list(df["token_id"]) == [0, 1, 2, 3, 4]
    assert df["count"].sum() == 20_000
    for obs, p in zip(df["observed"], P5):
        assert abs(obs - p) < 0.015                       # ~4 standard errors at n = 20,000
    assert stats["tv_distance"] < 0.02 and stats["dof"] == 4 and stats["p_value"] > 1e-3
    again, _ = smp.empirical(probs, n=20_000, seed=0, token_text=text)
    other, _ = smp.empirical(probs, n=20_000, seed=1, token_text=text)
    assert again["count"].tolist() == df["count"].tolist()          # seeded: reproducible
    assert other["count"].tolist() != df["count"].tolist()


def test_empirical_detects_a_wrong_distribution():
    # draws from P5 judged against the uniform distribution: the chi-square must reject
    probs = torch.tensor(P5)
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.multinomial(probs, 5000, True, generator=g), minlength=5).double()
    res = smp.chi_square(counts, torch.full((5,), 1000.0, dtype=torch.float64))
    assert res["p_value"] < 1e-6


def test_chi_square_hand():
    # (10-20)²/20 + 0 + (30-20)²/20 = 10 with 2 dof; for 2 dof the p-value is exp(-x/2)
    res = smp.chi_square(torch.tensor([10.0, 20.0, 30.0]), torch.tensor([20.0, 20.0, 20.0]))
    assert res["chi_square"] == pytest.approx(10.0) and res["dof"] == 2
    assert res["p_value"] == pytest.approx(math.exp(-5), rel=1e-6)


def test_step_context():
    result = SimpleNamespace(prompt_ids=[1, 2, 3], token_ids=[7, 8, 9])
    assert smp.step_context(result, 0) == ([1, 2, 3], [])
    assert smp.step_context(result, 2) == ([1, 2, 3, 7, 8], [7, 8])


def test_replay_matches_the_run(tiny_model):
    """Replaying the captured logits with the run's own settings reproduces what each step reported."""
    run = inspect_run(tiny_model, RunSettings(prompt="Once upon a time", chat=False, max_new_tokens=6, seed=3,
                                              params=SamplingParams(temperature=0.9, top_p=0.8,
                                                                    repetition_penalty=1.3)))
    result = run.result
    assert len(run.recording.captured("logits")) == len(result.steps)
    for step in result.steps:
        logits = smp.step_logits(run.recording, step.index)
        assert logits.shape == (tiny_model.config.vocab_size,)
        context, generated = smp.step_context(result, step.index)
        _, summary = smp.compare(logits, {"run": result.params}, context, generated, str, chosen=step.token_id)
        assert int(summary["kept"].iloc[0]) == step.kept
        assert summary["chosen_prob"].iloc[0] == pytest.approx(step.prob, rel=1e-5)
    with pytest.raises(KeyError):
        smp.step_logits(run.recording, len(result.steps))


def test_describe():
    assert smp.describe(SamplingParams()) == "greedy"
    assert smp.describe(SamplingParams(temperature=0.7, top_p=0.9, presence_penalty=0.5)) == "T=0.7 top-p=0.9 pres=0.5"


@pytest.mark.model
def test_redraw_is_fast_on_the_bundled_vocab(bundled_model):
    """Three settings + the chain + 1,000 draws over 49,152 logits, figures included, well under 0.3 s."""
    run = inspect_run(bundled_model, RunSettings(prompt="The capital of France is", chat=False, max_new_tokens=2))
    logits = smp.step_logits(run.recording, 1)
    assert logits.shape == (49152,)
    context, generated = smp.step_context(run.result, 1)
    settings = {"A": SamplingParams(temperature=0.7, top_p=0.9), "B": SamplingParams(temperature=1.0, top_k=40),
                "C": SamplingParams(temperature=1.2, min_p=0.05, repetition_penalty=1.2)}
    tok = bundled_model.tokenizer
    view = smp.redraw(logits, settings, "A", context, generated, lambda i: tok.decode([i]), n_draws=1000)
    assert view["empirical"]["count"].sum() == 1000 and len(view["summary"]) == 3
    # one intra-op thread: same work, immune to other processes on a shared test machine (where a 2-thread
    # pool waiting for a descheduled worker can turn each 49k-element op into milliseconds)
    seconds = smp.redraw_seconds(logits, settings, context, generated, lambda i: tok.decode([i]), threads=1)
    default = smp.redraw_seconds(logits, settings, context, generated, lambda i: tok.decode([i]))
    page = smp.redraw_seconds_for_run(bundled_model, run, threads=1)     # the benchmark's entry point
    print(f"sampling page redraw: {1e3 * seconds:.1f} ms on 1 thread, {1e3 * default:.1f} ms on "
          f"{torch.get_num_threads()} threads; page defaults at the last step {1e3 * page:.1f} ms")
    bare = smp.redraw_seconds(logits, threads=1)                          # as inspector/bench_app.py calls it
    assert seconds < 0.3 and page < 0.3 and bare < 0.3
    assert list(smp.default_settings(run.result.params)) == ["A", "B", "C"]
    assert smp.default_settings(run.result.params)["A"] == run.result.params


def test_chain_notes_say_why_a_hotter_setting_keeps_more_under_a_smaller_top_p():
    """P5 = (.5, .2, .15, .1, .05). A: T=1, top-p .65 keeps 2 (.5 + .2 >= .65). B: T=5 flattens it to
    p ∝ P5^(1/5) = (.2516, .2095, .1978, .1824, .1588) (by hand), and top-p .55 needs 3 (.2516 + .2095 = .4611
    < .55 <= .6589): B keeps more with the smaller top-p, and the note says why."""
    settings = {"A": SamplingParams(temperature=1.0, top_p=0.65), "B": SamplingParams(temperature=5.0, top_p=0.55)}
    notes = smp.chain_notes(settings, smp.chains(LOGITS5, settings, [], []))
    assert notes[0] == ("**A**: T=1 leaves the top token at p=0.500; top-p 0.65 then needs 2 tokens to reach its mass; "
                        "**2 tokens** kept in the end.")
    assert notes[1].startswith("**B**: T=5 leaves the top token at p=0.252; top-p 0.55 then needs 3 tokens")
    assert notes[2].startswith("**B** keeps more tokens (3) than **A** (2) although its top-p is smaller (0.55 < 0.65)")
    assert len(smp.chain_notes({"A": settings["A"]}, smp.chains(LOGITS5, {"A": settings["A"]}, [], []))) == 1


def test_p_values_of_a_correct_sampler_fall_below_005_at_about_one_seed_in_twenty():
    """p-values are uniform under the null: over 200 seeds the share below 0.05 is 5 % give or take
    2 standard deviations of a binomial(200, 0.05) count (10 ± 6.2)."""
    probs = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(1)), -1)
    r = smp.pass_rate(probs, n=1000, seeds=200)
    assert r["seeds"] == 200 and 3 <= r["below"] <= 17 and r["share_below"] == r["below"] / 200
