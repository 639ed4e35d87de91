"""Tables of the quantization scoreboard (engine.tools.quant_scoreboard): one row per format, and one table per
format in llama.cpp's names and order (FormatScore.llama_rows: the CLI prints the same rows)."""
from __future__ import annotations

import pandas as pd

from engine.tools.quant_scoreboard import Scoreboard

SUMMARY_COLUMNS = ["format", "Mean KLD", "± KLD", "Same top p (%)", "± same top (%)", "Mean Δp (%)",
                   "RMS Δp (%)", "PPL(Q)/PPL(base)", "± ratio"]
FORMAT_COLUMNS = ["statistic", "value", "±", "unit"]


def _pct(x: float | None) -> float | None:
    return None if x is None else 100 * x


def summary_frame(board: Scoreboard) -> pd.DataFrame:
    rows = [{"format": r.format, "Mean KLD": r.mean_kld.value, "± KLD": r.mean_kld.unc,
             "Same top p (%)": _pct(r.same_top.value), "± same top (%)": _pct(r.same_top.unc),
             "Mean Δp (%)": _pct(r.mean_p_diff.value), "RMS Δp (%)": _pct(r.rms_p_diff.value),
             "PPL(Q)/PPL(base)": r.ppl_ratio.value, "± ratio": r.ppl_ratio.unc} for r in board.formats]
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def format_frame(board: Scoreboard, fmt: str) -> pd.DataFrame:
    """One format's figures as llama-perplexity --kl-divergence prints them (Δp and Same top p in %)."""
    return pd.DataFrame([{"statistic": n, "value": v, "±": u, "unit": unit}
                         for n, v, u, unit in board.result(fmt).llama_rows()], columns=FORMAT_COLUMNS)
