"""The why-loop's report is a function of the model and the settings: the same report twice is identical, field
for field (every cause's change, rerun tokens, text and outcome, and the copy heads' scores). On the tiny looping
model, whose report holds a rerun of every kind of cause (zeroed heads, the sampler's rungs, one of them sampling
at temperature 1 with the run's seed, another dtype, the prompt's spans left out), for a 2-layer model's cost."""
from __future__ import annotations

from collections import Counter

import pytest

from engine import RunSettings
from engine.tools.why_loop import why_loop

pytestmark = pytest.mark.unit
LOOPING = RunSettings(prompt="I like apples. I like apples. I like", chat=False)


def test_the_same_report_twice_is_identical(tiny_looping_model):
    report = why_loop(tiny_looping_model, LOOPING)
    assert report.status == "loop" and report.reruns > 1
    assert set(Counter(c.kind for c in report.causes)) == {"heads", "sampler", "numerics", "prompt"}
    assert any("temperature" in c.change for c in report.causes)           # a sampled rerun: the seed matters
    assert why_loop(tiny_looping_model, LOOPING).as_dict() == report.as_dict()
