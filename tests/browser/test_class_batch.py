"""Eight students (each a Playwright context of its own: its own cookies, its own browser) press Run within a second on
one server (started as scripts/serve.sh starts it for a class) whose decode steps batch across runs (engine.batch,
the default MAX_CONCURRENT_RUNS and MAX_BATCH_ROWS): nobody waits in the queue, each tab shows its own text, equal
to its single-user run with the batch off (MAX_BATCH_ROWS=1: each run alone), and nobody else's; and each tab's run
record, downloaded from its Trace files page, holds every probe statistic of its single-user run, stage by stage and
step by step, within engine.batch's stated rounding (tests/model/test_batch_bundled.py: rtol 1e-4, atol 2e-3)."""
from __future__ import annotations

import os

import pytest
import torch

from engine import RunSettings
from engine.inspection.trace import from_bytes
from inspector.session.limits import Limits
from inspector.session.run import inspect_run
from tests.alone import done_alone
from tests.browser.test_classroom_load import arrivals, press_run_in, run_in, shown_texts, visit
from tests.browser.test_load_server import _open, _ready
from tests.helpers import streamlit_server, tiny_config, write_model_dir

pytestmark = [pytest.mark.browser, pytest.mark.alone]      # its delays, schedule or memory: by itself (tests/alone.py)
STUDENTS, NEW = 8, 4
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "Name three sea animals.",
             "What is 12 times 7?", "Write a poem about autumn leaves.",
             "Explain photosynthesis briefly.", "Who wrote Hamlet?", "Count to five."]


@pytest.fixture(scope="module")
def klass(tmp_path_factory, tokenizer_files):
    d = write_model_dir(tmp_path_factory.mktemp("klass") / "klass-llama", tokenizer_files,
                        tiny_config(num_hidden_layers=4))
    log = tmp_path_factory.mktemp("klass-log") / "streamlit.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_INSPECTOR_MAX_")}
    env.update(LLM_INSPECTOR_MODEL=str(d), LLM_INSPECTOR_MODEL_ROOTS="", LLM_INSPECTOR_HUB_CACHE="off")
    with streamlit_server(env, log, "--server.fileWatcherType", "none", classroom=True) as (url, proc):
        yield url, proc, log, d


@pytest.fixture
def typed(klass, browser):
    """What the test does not measure, done in its setup (beside the other workers' tests): each question's run
    alone with the batch off (the references), and the eight tabs opened with their questions typed."""
    url, proc, log, model_dir = klass
    from engine import load_model
    model = load_model(model_dir, device="cpu", dtype="float32")
    alone = Limits(max_batch_rows=1)
    refs = [inspect_run(model, RunSettings(prompt=q, max_new_tokens=NEW), limits=alone) for q in QUESTIONS]
    tabs = [_open(browser, url, wait=False) for _ in range(STUDENTS)]
    for _, page in tabs:
        _ready(page)
    for (_, page), q in zip(tabs, QUESTIONS):
        run_in(page, q)
    yield refs, tabs
    for ctx, _ in tabs:
        ctx.close()


def test_eight_students_press_run_at_once(klass, typed):
    url, proc, log, model_dir = klass
    refs, tabs = typed
    want = [r.result.text.strip("\n") for r in refs]
    press_run_together(tabs)
    press_run_in(tabs, pressed=True)
    assert arrivals(tabs) == [0] * STUDENTS           # nobody queued: all eight generated at once
    for k, (_, page) in enumerate(tabs):
        shown = shown_texts(page)
        assert want[k] in shown, (k, want[k], shown)                                   # its own single-user text
        assert not any(w in shown for j, w in enumerate(want) if j != k and w != want[k]), k   # nobody else's
    done_alone()                    # the class has run; what follows checks its records (tests/alone.py)
    records = [_record_of(page) for _, page in tabs]
    assert any("shared one forward" in note for t in records for note in t.notes)     # the batch did step them
    for k, trace in enumerate(records):
        _same_statistics(trace, refs[k], k)
    assert proc.poll() is None and "Traceback" not in log.read_text()


CLICK_AT = """at => {
  const run = () => [...document.querySelectorAll('button')].find(b => b.innerText.trim() === 'Run');
  const now = run();
  if (now && !now.disabled) setTimeout(() => run().click(), at - Date.now());
  return {found: !!now, disabled: !!(now && now.disabled), lead: at - Date.now()};
}"""


def press_run_together(tabs, ahead_s: float = 0.5) -> None:
    """Every tab presses Run at the same moment, ahead_s from now (each tab's own timer): as eight students pressing
    at once. Pressed one tab after another (each click awaited), a four-token run could end before the next one
    began, and the batch then had nothing to step together: 2 failures in 7 runs on 2026-12-05, none in 5 since.
    Each tab's Run button must be there and enabled, and its timer still ahead when set."""
    at = tabs[0][1].evaluate("() => Date.now()") + ahead_s * 1000
    for k, (_, page) in enumerate(tabs):
        got = page.evaluate(CLICK_AT, at)
        assert got["found"] and not got["disabled"] and got["lead"] > 0, (k, got)


def _record_of(page):
    """The run record the tab's session keeps, as its Trace files page downloads it."""
    visit(page, "Trace files")
    with page.expect_download(timeout=60_000) as got:
        page.get_by_role("button", name="Download trace").click()
    with open(got.value.path(), "rb") as f:
        return from_bytes(f.read())


def _same_statistics(trace, ref, k: int) -> None:
    """Every statistic of the reference run alone, in the same records (step, stage, position) and within the
    batch's rounding."""
    got, want = trace.recording.stat_records(), ref.recording.stat_records()
    assert trace.result.token_ids == ref.result.token_ids, k
    assert [(r.step, r.name, r.pos0) for r in got] == [(r.step, r.name, r.pos0) for r in want], k
    for x, y in zip(got, want):
        assert torch.allclose(x.values, y.values, rtol=1e-4, atol=2e-3, equal_nan=True), (k, x.name, x.step)
