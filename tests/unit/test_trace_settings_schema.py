"""A trace's run settings get the server's schema (engine.inspection.trace_check.check_settings_schema): every genuine
shape still opens, right up to each bound, and the sampler ranges are exactly SamplingParams' own (the crafted
files it refuses are in tests/unit/test_hostile_traces.py)."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from engine import EngineError, InputError, RunSettings, SamplingParams
from engine.inspection.trace import META_KEY, from_bytes, to_bytes
from engine.inspection.trace_check import MAX_STOP_CHARS, MAX_STOP_STRINGS, TraceBounds, check_settings_schema
from inspector.session.limits import Limits
from inspector.session.run import inspect_run
from tests.unit.test_hostile_traces import split, with_meta

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def run(tiny_model):
    return inspect_run(tiny_model, RunSettings(prompt="Hi there", chat=False, max_new_tokens=3, seed=1))


def reopened(run, settings: RunSettings, bounds: TraceBounds | None = None) -> RunSettings:
    return from_bytes(to_bytes(dataclasses.replace(run, settings=settings)), bounds).settings


def test_the_default_bounds_are_the_apps_default_limits():
    limits, bounds = Limits(), TraceBounds()
    assert (bounds.max_prompt_chars, bounds.max_prompt_tokens, bounds.max_new_tokens) == (
        limits.max_prompt_chars, limits.max_prompt_tokens, limits.max_new_tokens)
    assert (MAX_STOP_STRINGS, MAX_STOP_CHARS) == (16, 200)


def test_settings_at_every_bound_still_open(run):
    s = RunSettings(prompt="p" * 20_000, chat=True, system="s" * 20_000, allow_special=True, max_new_tokens=1_024,
                    params=SamplingParams(temperature=100, top_k=1 << 20, top_p=1, min_p=1, repetition_penalty=1e6,
                                          frequency_penalty=-100, presence_penalty=100, no_repeat_ngram=5_120),
                    seed=2 ** 63 - 1, stop=tuple("x" * 200 for _ in range(16)), ignore_eos=True, timing=False)
    assert reopened(run, s) == s
    plain = RunSettings(prompt="p", system=None, max_new_tokens=1, stop=())
    assert reopened(run, plain) == plain


def test_the_older_flat_layout_still_opens(run):
    good = to_bytes(run)

    def flat(meta):
        meta["settings"] = {"prompt": "hi", "chat": False, "max_new_tokens": 5, "temperature": 0.9, "top_k": 7,
                            "seed": 3, "stop": ["x"], "ignore_eos": True, "timing": True}
    back = from_bytes(with_meta(good, flat)).settings
    assert back == RunSettings(prompt="hi", chat=False, max_new_tokens=5, seed=3, stop=("x",), ignore_eos=True,
                               params=SamplingParams(temperature=0.9, top_k=7))
    assert json.loads(split(good)[0]["__metadata__"][META_KEY])["settings"] == run.settings.as_dict()


def test_the_servers_own_limits_are_applied(run):
    s = RunSettings(prompt="p" * 51, max_new_tokens=9)
    with pytest.raises(EngineError, match="the prompt must be text of at most 50 characters"):
        reopened(run, s, TraceBounds(max_prompt_chars=50))
    with pytest.raises(EngineError, match=r"max_new_tokens must be a whole number in \[1, 8\]"):
        reopened(run, s, TraceBounds(max_new_tokens=8))
    assert reopened(run, s, TraceBounds(max_prompt_chars=51, max_new_tokens=9)) == s
    # A missing max_new_tokens reads as RunSettings' default, 32: over a server limit of 16.
    dropped = with_meta(to_bytes(run), lambda m: m["settings"].pop("max_new_tokens"))
    with pytest.raises(EngineError, match=r"max_new_tokens must be a whole number in \[1, 16\]"):
        from_bytes(dropped, TraceBounds(max_new_tokens=16))
    assert from_bytes(dropped, TraceBounds(max_new_tokens=32)).settings.max_new_tokens == 32


VALUES = [-101, -100, -1, -0.5, 0, 1e-9, 0.5, 1, 1.5, 2, 40, 40.0, 99.9, 100, 100.5, 1e6, math.inf, -math.inf,
          math.nan, True, False, "1", None, [1]]


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(SamplingParams)])
def test_sampler_ranges_are_sampling_params_own(name):
    """For every field and value, the schema accepts exactly what SamplingParams accepts (the reference), except
    whole numbers past what they can mean on this server: top_k past the largest vocabulary, an n-gram longer
    than a prompt and a generation together (SamplingParams has no upper bound for either)."""
    most = {"top_k": 1 << 20, "no_repeat_ngram": 4_096 + 1_024}
    for v in VALUES:
        try:
            SamplingParams(**{name: v})
            reference = not (name in most and v > most[name])
        except InputError:
            reference = False
        try:
            check_settings_schema({"prompt": "p", "params": {name: v}}, TraceBounds())
            schema = True
        except EngineError:
            schema = False
        assert schema == reference, (name, v)
