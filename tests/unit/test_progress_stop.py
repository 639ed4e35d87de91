"""The one progress protocol (engine.progress) on every long job: the why-loop's and the rescue's reruns, the
patching grid's and head scan's packed calls, input attribution, the quantization comparison and the precision
comparison. Each tells Progress records whose `done` climbs one unit at a time to done == total, and a STOP
answer ends it with engine.progress.Stopped before any further unit of work runs (counted here by wrapping the
function that does one unit)."""
from __future__ import annotations

import pytest

import engine.tools.attribution as attribution
import engine.tools.patching as patching
import engine.tools.quant as quant
import engine.tools.rescue as rescue
import engine.tools.why_loop as why_loop_mod
from engine import RunSettings
from engine.model import Model
from engine.progress import STOP, LayerProgress, Progress, Stopped
from engine.tools.doctor import precision_compare
from engine.variants import cast_model
from tests.unit.test_prescribe import OVERFLOW, PROMPT, looper  # noqa: F401  (looper: a fixture)

pytestmark = pytest.mark.unit


class Stopper:
    """on_progress keeping every record; answers STOP at record number `at` (from 0, None: never) and notes how
    many units had run then."""

    def __init__(self, units: list, at: int | None = None) -> None:
        self.units, self.at, self.records, self.units_at_stop = units, at, [], None

    def __call__(self, p: Progress):
        self.records.append(p)
        if len(self.records) - 1 == self.at:
            self.units_at_stop = len(self.units)
            return STOP
        return None


def counting(monkeypatch, module, name: str) -> list:
    """Wrap module.name so that each call (one unit of work) is noted; returns the list of notes."""
    calls, fn = [], getattr(module, name)

    def wrapped(*a, **kw):
        calls.append(name)
        return fn(*a, **kw)
    monkeypatch.setattr(module, name, wrapped)
    return calls


def assert_climbs_to_the_end(records: list[Progress], units: int) -> None:
    """One record before each unit (done = units finished), then the end: done == total == units."""
    assert [p.done for p in records] == list(range(units + 1))
    assert records[-1].done == records[-1].total == units and records[-1].fraction == 1.0
    assert all(p.total >= p.done for p in records) and all(p.what for p in records)


def assert_stops_there(run, stopper: Stopper) -> None:
    with pytest.raises(Stopped):
        run(stopper)
    assert stopper.units_at_stop is not None and len(stopper.records) == stopper.at + 1
    assert len(stopper.units) == stopper.units_at_stop           # not one unit of work after the STOP


# ---- the why-loop: one unit = one rerun (a generation) ------------------------------------------------------
def test_why_loop_reports_each_rerun_and_stops_before_the_next(looper, monkeypatch):  # noqa: F811
    settings = RunSettings(prompt=PROMPT, chat=False, max_new_tokens=16)  # a loop: 12+ tokens
    reruns = counting(monkeypatch, why_loop_mod, "GenerationRun")
    whole = Stopper(reruns)
    report = why_loop_mod.why_loop(looper, settings, max_reruns=6, on_progress=whole)
    assert report.status == "loop" and report.reruns == len(reruns) == 6
    assert_climbs_to_the_end(whole.records, 6)
    assert [p.what.split(":")[0] for p in whole.records[:-1]] == [f"rerun {k}" for k in range(1, 7)]
    assert [p.fraction for p in whole.records] == [k / 6 for k in range(7)]
    reruns.clear()
    assert_stops_there(lambda tell: why_loop_mod.why_loop(looper, settings, max_reruns=6, on_progress=tell),
                       Stopper(reruns, at=2))
    assert len(reruns) == 2                                         # the baseline and one cause, no third


def test_why_loop_without_a_loop_ends_at_one_of_one(tiny_model):
    told = Stopper([])
    report = why_loop_mod.why_loop(tiny_model, RunSettings(prompt=PROMPT, chat=False), on_progress=told)
    assert report.status == "no loop" and report.reruns == 1
    assert_climbs_to_the_end(told.records, 1)


# ---- the rescue search: one unit = one rerun judged against fp32 --------------------------------------------
def test_rescue_reports_each_rerun_and_stops_before_the_next(tiny_model, monkeypatch):
    low, settings = cast_model(tiny_model, "float16"), RunSettings(prompt=PROMPT, chat=False, max_new_tokens=4)
    judged = counting(monkeypatch, rescue, "judge")
    whole = Stopper(judged)
    report = rescue.find_rescue(tiny_model, low, settings, injections=[OVERFLOW], on_progress=whole)
    assert report.fp32 and report.reruns == len(judged) >= 3
    assert_climbs_to_the_end(whole.records, report.reruns)
    judged.clear()
    assert_stops_there(lambda tell: rescue.find_rescue(tiny_model, low, settings, injections=[OVERFLOW],
                                                       on_progress=tell), Stopper(judged, at=2))
    assert len(judged) == 2


# ---- patching: one unit = one packed call of the grid or the head scan --------------------------------------
@pytest.fixture(scope="module")
def pair(tiny_model):
    clean = tiny_model.tokenizer.encode("The quick brown fox jumps over the lazy dog and runs far away")
    corrupt = patching.replace_span(clean, 2, 4, tiny_model.tokenizer.encode(" red cat")[:2])
    return clean, corrupt, int(tiny_model.logits(clean)[-1].argmax())


def test_patching_reports_every_packed_call_of_grid_and_scan_and_stops_before_the_next(tiny_model, pair,
                                                                                      monkeypatch):
    packs = counting(monkeypatch, patching, "_run_pack")
    whole = Stopper(packs)
    patching.patching_grid(tiny_model, *pair, on_progress=whole)
    n = len(packs)
    heads = [p for p in whole.records if p.what.startswith("head scan: pack")]
    n_grid = n - len(heads)
    assert heads and n_grid >= 2                                    # both parts, counted as one job
    assert_climbs_to_the_end(whole.records, n)
    assert {p.total for p in whole.records} == {n}                  # known from the start: the bar only climbs
    for at in (1, n_grid):                                          # inside the grid, before the head scan
        packs.clear()
        assert_stops_there(lambda tell: patching.patching_grid(tiny_model, *pair, on_progress=tell),
                           Stopper(packs, at=at))
        assert len(packs) == at


def test_head_scan_alone_ends_at_its_total(tiny_model, pair, monkeypatch):
    packs = counting(monkeypatch, patching, "_run_pack")
    told = Stopper(packs)
    patching.head_scan(tiny_model, pair[0], pair[2], on_progress=told)
    assert_climbs_to_the_end(told.records, len(packs))


# ---- input attribution: base forward, occlusion packs, the gradient, deletion packs ------------------------
def test_attribution_reports_every_unit_and_stops_before_the_next(tiny_model, pair, monkeypatch):
    units = counting(monkeypatch, attribution, "base_run")
    packs = counting(monkeypatch, patching, "_run_pack")
    grads = counting(monkeypatch, attribution, "grad_x_input")
    done = Stopper(units)
    attribution.attribute_inputs(tiny_model, pair[0], pair[2], random_orders=2, on_progress=done)
    n = len(units) + len(packs) + len(grads)
    assert (len(units), len(grads)) == (1, 1)
    assert_climbs_to_the_end(done.records, n)
    fractions = [p.fraction for p in done.records]
    assert fractions == sorted(fractions)                           # an upper-bound total only makes it jump up
    for at in (1, 3):                                               # in the occlusion, at the gradient
        units.clear(), packs.clear(), grads.clear()
        stopper = Stopper(units, at=at)
        with pytest.raises(Stopped):
            attribution.attribute_inputs(tiny_model, pair[0], pair[2], random_orders=2, on_progress=stopper)
        assert len(stopper.records) == at + 1 and len(units) + len(packs) + len(grads) == at


# ---- quantization: the reference forward, then per format quantize and run ---------------------------------
def test_quantization_reports_each_format_and_stops_before_the_next_unit(tiny_model, monkeypatch):
    ids = tiny_model.tokenizer.encode(PROMPT)
    made = counting(monkeypatch, quant, "quantized_model")
    ran = counting(monkeypatch, quant, "_compare")
    told = Stopper(made)
    report = quant.compare_formats(tiny_model, ids, len(ids) - 3, ["Q8_0", "Q4_0"], on_progress=told)
    assert [f.format for f in report.formats] == ["Q8_0", "Q4_0"] and (len(made), len(ran)) == (2, 2)
    assert_climbs_to_the_end(told.records, 5)
    assert [p.what for p in told.records] == ["the float32 reference forward", "quantizing to Q8_0", "running Q8_0",
                                              "quantizing to Q4_0", "running Q4_0", "done"]
    made.clear(), ran.clear()
    stopper = Stopper(made, at=2)                                   # answered before "running Q8_0"
    with pytest.raises(Stopped):
        quant.compare_formats(tiny_model, ids, len(ids) - 3, ["Q8_0", "Q4_0"], on_progress=stopper)
    assert (len(made), len(ran)) == (1, 0)


# ---- the precision comparison: each block of the two forwards ----------------------------------------------
def test_precision_compare_stops_at_the_block_it_was_answered_before(tiny_model, monkeypatch):
    L, blocks = tiny_model.config.num_layers, counting(monkeypatch, Model, "_block")
    low = cast_model(tiny_model, "bfloat16")
    blocks.clear()
    told = Stopper(blocks)
    precision_compare(tiny_model, low, [1, 2, 3, 4, 5], on_progress=told)
    assert_climbs_to_the_end(told.records, 2 * L) and len(blocks) == 2 * L
    blocks.clear()
    stopper = Stopper(blocks, at=L + 1)                             # before the low forward's second block
    with pytest.raises(Stopped):
        precision_compare(tiny_model, low, [1, 2, 3, 4, 5], on_progress=stopper)
    assert len(blocks) == L + 1 == stopper.units_at_stop


# ---- one-off forwards: LayerProgress hands Model.forward its on_layer ---------------------------------------
def test_layer_progress_gives_the_forward_an_on_layer_only_with_a_callback(tiny_model):
    assert LayerProgress(None, 5, 2).on_layer(0, 5) is None          # the forward stays the plain one
    heard = []
    tell = LayerProgress(lambda p: heard.append((p.layer, p.fraction)), 5, tiny_model.config.num_layers)
    tiny_model.forward(__import__("torch").tensor([1, 2, 3, 4, 5]), tiny_model.new_cache(5),
                       on_layer=tell.on_layer(0, 5))
    tell.chunk_done(0, 5)
    L = tiny_model.config.num_layers
    assert heard == [(i, i / L) for i in range(1, L + 1)]
