"""The why-loop's verdict on one rerun (engine.tools.loop_verdict.judge), on token lists worked out by hand: a rerun
loop-free for the diagnosed run's length whose loop shows only after it, or whose continuation ends in two copies of
a repeat, is "loop delayed" (not "loop gone", issue 48: "Tomorrow will be" with a presence penalty of 0.25 ended
"... new day tomorrow.\\n\\nI'm going to have a new day tomorrow.\\n\\nI'm" at 64 tokens and was called a fix)."""
from __future__ import annotations

import pytest

from engine.inspection.loops import Loop, heading_into_loop
from engine.tools.loop_verdict import OUTCOMES, judge, rerun_horizon

pytestmark = pytest.mark.unit
RUN = 20                                    # the diagnosed run's length
FREE = list(range(100, 130))                # 30 distinct tokens: no repeat at all


def test_the_rerun_horizon_is_the_runs_length_and_twice_the_loops_span():
    assert rerun_horizon(64, Loop(start=40, period=8, count=3, end=64)) == 64 + 2 * 24


def test_a_loop_that_shows_only_after_the_runs_length_is_delayed_with_its_start():
    tokens = FREE[:16] + [1, 2, 3, 4] * 4            # 32 tokens; loop 1 2 3 4 from step 16, a loop only at 28
    v = judge(tokens, "loop", RUN)
    assert v.outcome == "loop delayed" and (v.loop.start, v.loop.period, v.loop.count) == (16, 4, 4)
    assert v.words(RUN) == "loop delayed: loop-free for the run's 20 tokens, then a loop from step 16, period 4"


def test_a_continuation_ending_in_two_copies_of_a_repeat_is_delayed():
    tokens = FREE[:24] + [7, 8, 9, 10, 11, 12] * 2 + [7]     # 37 tokens at the horizon: two copies and a start
    v = judge(tokens, "max_new_tokens", RUN)
    assert v.outcome == "loop delayed" and (v.loop.start, v.loop.period, v.loop.count) == (24, 6, 2)
    assert "a repeat heading into one (2 copies) from step 24, period 6" in v.words(RUN)
    # the same tokens to the horizon without the second copy are loop-free past the run: gone
    assert judge(FREE[:24] + [7, 8, 9, 10, 11, 12, 7], "max_new_tokens", RUN).outcome == "loop gone"


def test_a_short_repeat_at_the_horizon_is_no_repeat_heading_into_a_loop():
    # "12:12:" in a clock time: two copies of 3 tokens, under MIN_TOKENS
    assert heading_into_loop(FREE[:30] + [5, 6, 7, 5, 6, 7]) is None
    assert judge(FREE[:30] + [5, 6, 7, 5, 6, 7], "max_new_tokens", RUN).outcome == "loop gone"


def test_a_loop_within_the_runs_length_is_kept_and_an_early_end_has_stopped():
    assert judge(FREE[:4] + [1, 2, 3] * 4, "loop", RUN).outcome == "loop kept"           # 16 tokens <= 20
    assert judge(FREE[:4] + [1, 2] * 2, "loop", RUN).outcome == "loop kept"              # fell back: two copies
    assert judge(FREE[:9], "eos", RUN).outcome == "stopped"
    assert judge(FREE[:RUN], "eos", RUN).outcome == "stopped"                            # ended at the run's end


def test_a_text_that_ends_loop_free_after_the_runs_length_is_gone():
    assert judge(FREE[:25], "eos", RUN).outcome == "loop gone"
    assert judge(FREE[:25], "context", RUN).outcome == "loop gone"
    assert judge(FREE[:25], "nonfinite", RUN).outcome == "stopped"          # a NaN is no fix
    assert OUTCOMES == ("loop gone", "loop delayed", "stopped", "loop kept")
