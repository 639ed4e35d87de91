"""The quantization scoreboard (engine.tools.quant_scoreboard) in llama.cpp's --kl-divergence terms, on the tiny
model: its KL and same-top equal the Quantization page's per-step figures (engine.tools.quant.compare_formats)
averaged over the same positions, and every figure equals a hand computation from the two models' logits (torch's
own KL, softmax and cross entropy; numpy's percentiles and standard deviation; llama.cpp's sums for the
uncertainties); the uncertainty shrinks as texts are added; bad input is refused before any model work."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import engine.tools.quant_scoreboard as qs
from engine.cli import main
from engine.errors import InputError
from engine.generate import prompt_ids
from engine.model import Model
from engine.progress import STOP, Stopped
from engine.tools.quant import compare_formats, quantized_model

pytestmark = pytest.mark.unit
TEXTS = ["The river rose slowly through the night and the fields went under water.",
         "To make bread, mix flour, water, salt and yeast, then knead it for ten minutes.",
         "def mean(values):\n    return sum(values) / len(values)"]
FORMATS = ("Q8_0", "Q4_0")


@pytest.fixture(scope="module")
def board(tiny_model):
    return qs.scoreboard(tiny_model, TEXTS, FORMATS)


@pytest.fixture(scope="module")
def by_hand(tiny_model):
    """Per format, over the texts one after another: the base's and the copy's logits at every scored position
    (all but each text's last) and the text's next tokens."""
    ids = [prompt_ids(tiny_model, t) for t in TEXTS]
    base = torch.cat([tiny_model.logits(x)[:-1] for x in ids]).double()
    nxt = torch.cat([torch.tensor(x[1:]) for x in ids])
    out = {}
    for fmt in FORMATS:
        q = quantized_model(tiny_model, fmt)
        out[fmt] = torch.cat([q.logits(x)[:-1] for x in ids]).double()
    return {"ids": ids, "base": base, "next": nxt, "quant": out}


def test_kl_and_same_top_are_the_quantization_pages_per_step_figures_averaged(tiny_model, board, by_hand):
    for fmt in FORMATS:
        kld, top = [], []
        for ids in by_hand["ids"]:      # the page's figures over each text read as a run with a 1-token prompt
            r = compare_formats(tiny_model, ids, 1, [fmt]).result(fmt)
            kld += r.kld
            top += r.top_match
        s = board.result(fmt)
        assert s.count == len(kld) == sum(len(x) - 1 for x in by_hand["ids"]) == board.count
        assert s.mean_kld.value == pytest.approx(float(np.mean(kld)), rel=1e-12, abs=1e-15)
        assert s.same_top.value == pytest.approx(float(np.mean(top)), rel=1e-12)
        # and from the logits with torch's own KL: KL(p_base || p_q), base first
        base_lp, q_lp = F.log_softmax(by_hand["base"], -1), F.log_softmax(by_hand["quant"][fmt], -1)
        torch_kl = F.kl_div(q_lp, base_lp, log_target=True, reduction="none").sum(-1)
        assert s.mean_kld.value == pytest.approx(float(torch_kl.mean()), rel=1e-9, abs=1e-15)
        assert s.same_top.value == float((base_lp.argmax(-1) == q_lp.argmax(-1)).double().mean())
    assert board.result("Q8_0").mean_kld.value < board.result("Q4_0").mean_kld.value


def test_uncertainties_are_llama_cpps_and_the_standard_error(board, by_hand):
    for fmt in FORMATS:
        s = board.result(fmt)
        kld, n = np.asarray(s.kld), s.count
        assert s.mean_kld.unc == pytest.approx(float(np.std(kld, ddof=1) / math.sqrt(n)), rel=1e-9)
        f = kld.sum() / n                                  # perplexity.cpp's mean_and_uncertainty, from its sums
        assert s.mean_kld.unc == pytest.approx(math.sqrt(((kld ** 2).sum() / n - f * f) / (n - 1)), rel=1e-6)
        p = s.same_top.value
        assert s.same_top.unc == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)), rel=1e-12, abs=1e-15)
        # ln(PPL(Q)/PPL(base)) ± sqrt(u_q² + u_base² - 2 cov), each from llama.cpp's sums
        a = F.cross_entropy(by_hand["quant"][fmt], by_hand["next"], reduction="none").numpy()
        b = F.cross_entropy(by_hand["base"], by_hand["next"], reduction="none").numpy()
        ua = math.sqrt(((a ** 2).sum() / n - (a.sum() / n) ** 2) / (n - 1))
        ub = math.sqrt(((b ** 2).sum() / n - (b.sum() / n) ** 2) / (n - 1))
        cov = ((a * b).sum() / n - (a.sum() / n) * (b.sum() / n)) / (n - 1)
        assert s.ln_ppl_ratio.unc == pytest.approx(math.sqrt(ua * ua + ub * ub - 2 * cov), rel=1e-5)
        assert s.cor_ln_ppl == pytest.approx(float(np.corrcoef(a, b)[0, 1]), rel=1e-6)


def test_the_uncertainty_shrinks_as_texts_are_added(tiny_model, board):
    one = qs.scoreboard(tiny_model, TEXTS[:1], ["Q4_0"])
    more = qs.scoreboard(tiny_model, list(qs.PROMPTS), ["Q4_0"])
    assert one.count < board.count < more.count
    u = [b.result("Q4_0").mean_kld.unc for b in (one, board, more)]
    r = [b.result("Q4_0").ln_ppl_ratio.unc for b in (one, board, more)]
    assert u[0] > u[1] > u[2] > 0 and r[0] > r[1] > r[2] > 0


def test_delta_p_is_the_change_in_the_next_tokens_probability(board, by_hand):
    rows = torch.arange(by_hand["next"].numel())
    p_base = F.softmax(by_hand["base"], -1)[rows, by_hand["next"]].numpy()
    for fmt in FORMATS:
        s = board.result(fmt)
        dp = F.softmax(by_hand["quant"][fmt], -1)[rows, by_hand["next"]].numpy() - p_base    # quantized minus base
        np.testing.assert_allclose(s.p_diff, dp, rtol=1e-9, atol=1e-12)
        want = np.percentile(dp, qs.PERCENTILES)
        got = [s.p_diff_percentiles[f"p{p:g}"] for p in qs.PERCENTILES]
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
        assert s.p_diff_percentiles["min"] == pytest.approx(dp.min(), abs=1e-12)
        assert s.p_diff_percentiles["max"] == pytest.approx(dp.max(), abs=1e-12)
        assert s.mean_p_diff.value == pytest.approx(dp.mean(), rel=1e-9, abs=1e-15)
        assert s.rms_p_diff.value == pytest.approx(math.sqrt((dp ** 2).mean()), rel=1e-9)
        np.testing.assert_allclose([s.kld_percentiles[f"p{p:g}"] for p in qs.PERCENTILES],
                                   np.percentile(s.kld, qs.PERCENTILES), rtol=1e-12)


def test_perplexity_ratio_is_exp_of_the_mean_nll_difference(board, by_hand):
    nll_base = F.cross_entropy(by_hand["base"], by_hand["next"], reduction="none")
    np.testing.assert_allclose(board.nll_base, nll_base.numpy(), rtol=1e-9)
    for fmt in FORMATS:
        s = board.result(fmt)
        nll_q = F.cross_entropy(by_hand["quant"][fmt], by_hand["next"], reduction="none")
        assert s.ppl_ratio.value == pytest.approx(math.exp(float(nll_q.mean() - nll_base.mean())), rel=1e-9)
        assert s.ln_ppl_ratio.value == pytest.approx(float(nll_q.mean() - nll_base.mean()), rel=1e-9, abs=1e-15)
        assert s.ppl.value == pytest.approx(math.exp(float(nll_q.mean())), rel=1e-9)
        assert s.ppl_base.value == pytest.approx(math.exp(float(nll_base.mean())), rel=1e-9)


def test_float32_against_itself_scores_zero():
    s = qs.summarize("F32", [0.0] * 20, [True] * 20, [1.5] * 10 + [2.5] * 10, [1.5] * 10 + [2.5] * 10)
    assert s.mean_kld.value == 0 and s.same_top.value == 1 and s.same_top.unc == 0
    assert s.ppl_ratio.value == 1 and s.ln_ppl_ratio.unc == 0 and s.rms_p_diff.value == 0
    one = qs.summarize("Q8_0", [0.25], [False], [1.0], [2.0])       # one position: no uncertainty to give
    assert one.mean_kld == qs.Stat(0.25, None) and one.same_top == qs.Stat(0.0, None)


def test_rows_carry_llama_cpps_names_in_its_order(board):
    names = [name for name, *_ in board.result("Q4_0").llama_rows()]
    for name in ("Mean PPL(Q)", "Mean PPL(base)", "Cor(ln(PPL(Q)), ln(PPL(base)))", "Mean ln(PPL(Q)/PPL(base))",
                 "Mean PPL(Q)/PPL(base)", "Mean PPL(Q)-PPL(base)", "Mean    KLD", "Maximum KLD", "99.9%   KLD",
                 "Median  KLD", " 0.1%   KLD", "Minimum KLD", "Mean    Δp", "Maximum Δp", "75.0%   Δp",
                 "Median  Δp", " 5.0%   Δp", "RMS Δp", "Same top p"):
        assert name in names, name
    assert names.index("Maximum KLD") < names.index("Median  KLD") < names.index("Minimum KLD") \
        < names.index("Mean    Δp") < names.index("RMS Δp") < names.index("Same top p")
    row = dict((n, (v, u)) for n, v, u, _ in board.result("Q4_0").llama_rows())
    assert row["Same top p"][0] == pytest.approx(100 * board.result("Q4_0").same_top.value)


@pytest.fixture
def model_work(monkeypatch):
    calls = []
    real_logits, real_quantized = Model.logits, qs.quantized_model
    monkeypatch.setattr(Model, "logits", lambda self, *a, **k: calls.append("logits") or real_logits(self, *a, **k))
    monkeypatch.setattr(qs, "quantized_model", lambda *a, **k: calls.append("quantize") or real_quantized(*a, **k))
    return calls


@pytest.mark.parametrize("texts, formats, kw, message", [
    ([], FORMATS, {}, "no texts to score"),
    (TEXTS, ["Q8_0", "Q3_Z"], {}, "unknown GGUF format 'Q3_Z'"),
    (TEXTS, [" "], {}, "no format given"),
    (TEXTS, FORMATS, {"max_tokens": 20}, r"the texts hold \d+ tokens \(3 texts\); at most 20 are scored here"),
    (["fine text here", "a"], FORMATS, {}, "text 2 is 1 token long"),
    (["fine text here", "   "], FORMATS, {}, "text 2: the prompt is empty"),
])
def test_bad_input_is_refused_before_any_model_work(tiny_model, model_work, texts, formats, kw, message):
    with pytest.raises(InputError, match=message):
        qs.scoreboard(tiny_model, texts, formats, **kw)
    assert model_work == []


def test_a_float16_model_is_refused(tiny_model):
    from engine.variants import cast_model
    with pytest.raises(InputError, match="compared against float32 weights"):
        qs.scoreboard(cast_model(tiny_model, "float16"), TEXTS, FORMATS)


def test_progress_names_each_unit_and_a_stop_ends_before_the_next(tiny_model, model_work):
    heard = []
    qs.scoreboard(tiny_model, TEXTS[:2], FORMATS, on_progress=lambda p: heard.append((p.done, p.total, p.what)))
    assert [w for *_, w in heard] == ["the float32 base over text 1 of 2", "the float32 base over text 2 of 2",
                                      "quantizing to Q8_0", "Q8_0 over text 1 of 2", "Q8_0 over text 2 of 2",
                                      "quantizing to Q4_0", "Q4_0 over text 1 of 2", "Q4_0 over text 2 of 2", "done"]
    assert [d for d, *_ in heard] == list(range(9)) and all(t == 8 for _, t, _ in heard)
    model_work.clear()
    with pytest.raises(Stopped):
        qs.scoreboard(tiny_model, TEXTS[:2], FORMATS, on_progress=lambda p: STOP if p.done == 3 else None)
    assert model_work == ["logits", "logits", "quantize"]             # Q8_0 quantized, never run


def test_split_texts_keeps_each_paragraphs_lines():
    assert qs.split_texts("\n\n".join(qs.PROMPTS)) == list(qs.PROMPTS)
    assert qs.split_texts("one\ntwo\n\n\n  \nthree\n") == ["one\ntwo", "three"]


def test_cli_prints_the_scoreboard_as_json(tiny_model_dir, tiny_model, capsys, tmp_path):
    f = tmp_path / "texts.txt"
    f.write_text(TEXTS[1] + "\n\n" + TEXTS[2] + "\n")
    assert main(["quant-scoreboard", TEXTS[0], "--texts-file", str(f), "--formats", "q8_0,Q4_0", "--model",
                 str(tiny_model_dir), "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = qs.scoreboard(tiny_model, TEXTS, FORMATS)
    assert list(out["formats"]) == ["Q8_0", "Q4_0"] and out["texts"] == 3 and out["few"] == (want.count < 100)
    for fmt in FORMATS:
        got = out["formats"][fmt]
        assert got["mean_kld"]["value"] == pytest.approx(want.result(fmt).mean_kld.value, rel=1e-12)
        assert got["same_top"] == pytest.approx(qs.dataclasses.asdict(want.result(fmt).same_top))
    assert main(["quant-scoreboard", "--formats", "Q9_9", "--model", str(tiny_model_dir)]) == 2
    assert "unknown GGUF format 'Q9_9'" in capsys.readouterr().err
    assert main(["quant-scoreboard", "x y", "--max-tokens", "1", "--model", str(tiny_model_dir), "--device",
                 "cpu"]) == 2
    assert "at most 1 are scored here" in capsys.readouterr().err


def test_cli_prints_llama_cpps_block_per_format(tiny_model_dir, capsys):
    assert main(["quant-scoreboard", TEXTS[0], "--formats", "Q4_0", "--model", str(tiny_model_dir), "--device",
                 "cpu"]) == 0
    out = capsys.readouterr().out
    assert "====== Q4_0 ======" in out and "Mean    KLD" in out and "Same top p" in out
    assert "llama.cpp prints its statistics only from 100" in out
