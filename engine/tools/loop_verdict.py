"""Whether a why-loop rerun fixed the loop: the one verdict the why-loop's report, the doctor's JSON and text, and
the Repetition page all read (engine.tools.why_loop calls `judge` once per rerun and stores what it says).

A rerun that is loop-free for exactly the diagnosed run's length proves little: "Tomorrow will be" on the bundled
model with a presence penalty of 0.25 holds no loop in its 64 tokens, yet ends "I'm going to have a new day
tomorrow.\\n\\nI'm going to have a new day tomorrow.\\n\\nI'm": two copies and the start of a third, a loop on its
way. So every rerun is continued past the diagnosed run's length, by CONTINUE_SPANS times the diagnosed loop's span
(`rerun_horizon`; the model's context stops it sooner), and judged over the whole of it:

    loop kept     its tokens end in a loop (engine.inspection.loops) within the diagnosed run's length, or it fell
                  back into the diagnosed loop there (engine.tools.why_loop.fell_back)
    loop delayed  loop-free for the run's length, but a loop shows in the continuation, or the continuation ends
                  in a repeat heading into one (engine.inspection.loops.heading_into_loop: a periodic tail of two
                  copies or more): the change postponed the loop, it did not remove it
    stopped       the text ended (end-of-text, or anything but reaching its horizon) within the run's length, with
                  no loop before it: no fix
    loop gone     the rerun ran past the run's length and holds no loop and no repeat heading into one: it reached
                  its horizon, or ended its text (end-of-text, the context) after the run's length

The continuation costs only the reruns that stay loop-free (a rerun that loops stops as soon as it does): on the
bench's case (engine.bench.tools: "I like apples. ..." for 64 tokens, a loop from step 1, so reruns may run to 190
tokens) the why-loop draws 717 tokens instead of 519, its five fixes now ending at end-of-text or the horizon.

OUTCOMES lists them best first (the why-loop ranks causes by it): a delayed loop is closer to a fix than a text that
ended early (for the user's own length the loop is away), and further than a loop gone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine.inspection.loops import Loop, heading_into_loop, tail_loop

CONTINUE_SPANS = 2           # a rerun runs on this many times the diagnosed loop's span past the run's length
OUTCOMES = ("loop gone", "loop delayed", "stopped", "loop kept")     # best first
ENDED_PAST_RUN = ("eos", "context")      # a text that ends so after the run's length ended loop-free


def rerun_horizon(run_len: int, loop: Loop) -> int:
    """How many tokens each rerun may generate: the diagnosed run's length plus CONTINUE_SPANS loop spans."""
    return run_len + CONTINUE_SPANS * loop.length


@dataclass(frozen=True)
class Verdict:
    outcome: str              # one of OUTCOMES
    loop: Loop | None         # kept / delayed: the rerun's loop, or the periodic tail heading into one

    def words(self, run_len: int) -> str:
        """The verdict in a sentence (the page's table and the doctor's text print this)."""
        lp = self.loop
        at = "" if lp is None else f"from step {lp.start}, period {lp.period}"
        if self.outcome == "loop delayed":
            made = "a loop" if lp.count >= 3 else f"a repeat heading into one ({lp.count} copies)"
            return f"loop delayed: loop-free for the run's {run_len} tokens, then {made} {at}"
        if self.outcome == "loop kept":
            made = "a loop" if lp.count >= 3 else "the diagnosed loop's piece twice over"
            return f"loop kept: {made} {at}, within the run's {run_len} tokens"
        if self.outcome == "stopped":
            return f"stopped: the text ended within the run's {run_len} tokens, no loop before it (no fix)"
        return f"loop gone: no loop and no repeat heading into one, past the run's {run_len} tokens"


def judge(tokens: Sequence[int], stopped: str, run_len: int) -> Verdict:
    """The verdict on one rerun: its generated tokens, why it stopped ("loop": the why-loop stopped it early in a
    loop or in the diagnosed loop's piece twice over; "max_new_tokens": it reached its horizon; "eos", "context",
    ...: its text ended), and the diagnosed run's length."""
    n, lp = len(tokens), tail_loop(tokens)
    if stopped == "loop" or lp is not None:
        # a fall-back into the diagnosed piece may be shorter than a loop: its periodic tail of two copies
        lp = lp or tail_loop(tokens, min_count=2, min_tokens=1)
        return Verdict("loop kept" if n <= run_len else "loop delayed", lp)
    if stopped != "max_new_tokens" and (n <= run_len or stopped not in ENDED_PAST_RUN):
        return Verdict("stopped", None)
    if stopped == "max_new_tokens" and (tail := heading_into_loop(tokens)) is not None:
        return Verdict("loop delayed", tail)
    return Verdict("loop gone", None)
