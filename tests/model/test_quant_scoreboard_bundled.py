"""The quantization scoreboard on the bundled model over its built-in texts: enough scored positions for llama.cpp's
statistics, and the formats ordered as their bits say, each difference beyond the uncertainties it reports."""
from __future__ import annotations

import pytest

from engine.tools.quant_scoreboard import FEW_TOKENS, PROMPTS, scoreboard

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def board(bundled_model):
    return scoreboard(bundled_model, PROMPTS, ["Q8_0", "Q4_0"])


def test_the_built_in_texts_score_enough_positions_for_llama_cpps_statistics(board):
    assert board.texts == len(PROMPTS) and board.count == board.tokens - board.texts >= FEW_TOKENS
    assert not board.as_dict()["few"]


def test_q8_0_diverges_less_than_q4_0_beyond_the_uncertainties(board):
    q8, q4 = board.result("Q8_0"), board.result("Q4_0")
    assert q8.mean_kld.value + 3 * q8.mean_kld.unc < q4.mean_kld.value - 3 * q4.mean_kld.unc
    assert q8.same_top.value >= 0.95 and q8.same_top.value - 3 * q8.same_top.unc > q4.same_top.value
    assert abs(q8.ln_ppl_ratio.value) < 3 * q8.ln_ppl_ratio.unc          # Q8_0: no perplexity change to see
    assert q4.ln_ppl_ratio.value > 2 * q4.ln_ppl_ratio.unc > 0           # Q4_0: a higher perplexity
    assert q8.rms_p_diff.value < q4.rms_p_diff.value
