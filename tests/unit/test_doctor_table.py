"""The NaN doctor's lead-up table (inspector.views.doctor.lead_up_frame), issue 33 item 9: a row of zeros with one
NaN (RMSNorm eps 0 on a zero input) read "min −0, max −0"; zero is shown as 0, whatever its sign."""
from __future__ import annotations

import pandas as pd
import pytest

from engine.inspection.stat_columns import STAT_NAMES
from inspector.views.doctor import lead_up_frame, shown_value

pytestmark = pytest.mark.unit


def test_a_signed_zero_reads_zero_and_other_values_keep_their_sign():
    assert shown_value(-0.0) == "0" and shown_value(0.0) == "0"
    assert shown_value(-1e-30) == "-1e-30" and shown_value(-2.5) == "-2.5" and shown_value(float("nan")) == "NaN"


def test_a_row_of_zeros_and_one_nan_reads_min_0_max_0():
    zeros, values = [-0.0, -0.0, 0.0, 0.0, 0.0, 1, 0], [-1.5, 2.0, 0.1, 0.4, 2.0, 0, 0]
    rows = [dict(step=0, stage="blocks.0.attn_norm", layer=0, **dict(zip(STAT_NAMES, zeros))),
            dict(step=0, stage="blocks.0.attn.q", layer=0, **dict(zip(STAT_NAMES, values)))]
    prof = pd.DataFrame(rows)
    prof["order"] = range(len(prof))
    out = lead_up_frame(prof, "blocks.0.attn_norm")
    first = out.iloc[0]
    assert (first["min"], first["max"], first["nan"]) == ("0", "0", 1)
    assert (out.iloc[1]["min"], out.iloc[1]["max"]) == ("-1.5", "2")
