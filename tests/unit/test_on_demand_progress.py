"""Progress by layer for the on-demand computations (attention map, entropy overview, logit lens, copy
attention, the report's maps): one record per block as it finishes, in order, with the right totals; the
same result with a callback as without; a STOP ends the computation and nothing is memoised."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import load_model
from engine.inspection.loops import Loop
from engine.progress import STOP, Progress, Stopped
from inspector.session.memo import memo
from inspector.session.on_demand import about, estimate, progress_text, record_rate
from inspector.views.activations import logit_lens
from inspector.views.attention import attention_pattern, entropy_overview
from inspector.views.repetition import copy_attention
from tests.helpers import tiny_config, write_model_dir

pytestmark = pytest.mark.unit
LAYERS = 4


@pytest.fixture(scope="module")
def model4(tmp_path_factory, tokenizer_files):
    """The tiny random model with four layers (enough to see an order, and a stop in the middle)."""
    path = write_model_dir(tmp_path_factory.mktemp("tiny4") / "tiny-llama-4", tokenizer_files,
                           tiny_config(num_hidden_layers=LAYERS))
    return load_model(path, device="cpu", dtype="float32")


IDS = [(7 * i + 3) % 500 + 10 for i in range(40)]


def records(fn):
    """fn(on_progress) with a callback that keeps every record: (result, records)."""
    seen: list[Progress] = []
    return fn(lambda p: seen.append(p)), seen


def layer_records(total: int, layers: int, chunks=None) -> list[tuple]:
    chunks = chunks or [(0, total)]
    return [(a, b, total, i, layers) for a, b in chunks for i in range(1, layers + 1)]


def as_tuples(seen: list[Progress]) -> list[tuple]:
    return [(p.done, p.chunk_end, p.total, p.layer, p.layers) for p in seen]


@pytest.mark.parametrize("layer", [0, 2, LAYERS - 1])
def test_attention_pattern_reports_each_block_it_runs_and_equals_the_plain_map(model4, layer):
    plain = attention_pattern(model4, IDS, layer)
    told, seen = records(lambda tell: attention_pattern(model4, IDS, layer, on_progress=tell))
    assert as_tuples(seen) == layer_records(len(IDS), layer + 1)       # stops after its layer: layer + 1 blocks
    assert seen[-1].fraction == 1.0
    assert torch.equal(told, plain)


def test_entropy_overview_reports_every_layer_and_equals_the_plain_overview(model4):
    plain = entropy_overview(model4, IDS, max_queries=16)
    told, seen = records(lambda tell: entropy_overview(model4, IDS, max_queries=16, on_progress=tell))
    assert as_tuples(seen) == layer_records(len(IDS), LAYERS)
    assert np.array_equal(told, plain)


def test_logit_lens_reports_every_layer_over_its_positions_and_equals_the_plain_lens(model4):
    plain = logit_lens(model4, IDS, 25, k=5)
    told, seen = records(lambda tell: logit_lens(model4, IDS, 25, k=5, on_progress=tell))
    assert as_tuples(seen) == layer_records(26, LAYERS)                  # the forward covers positions 0..25
    assert told.equals(plain)


def test_copy_attention_reports_every_layer_and_equals_the_plain_result(model4):
    loop = Loop(start=4, period=3, count=5, end=20)
    plain = copy_attention(model4, IDS, 10, loop)
    told, seen = records(lambda tell: copy_attention(model4, IDS, 10, loop, on_progress=tell))
    assert plain.queries and as_tuples(seen) == layer_records(len(IDS), LAYERS)
    assert torch.equal(told.to_copy, plain.to_copy) and torch.equal(told.to_next, plain.to_next)


def test_report_maps_report_each_chunk_and_layer_and_equal_the_plain_maps(model4, monkeypatch):
    import engine.report.data as rd
    monkeypatch.setattr(rd, "ATTENTION_CHUNK", 16)                        # 40 positions: chunks of 16, 16, 8
    plain = rd.attention_maps(model4, IDS, [0, 2])
    told, seen = records(lambda tell: rd.attention_maps(model4, IDS, [0, 2], on_progress=tell))
    assert as_tuples(seen) == layer_records(40, 3, [(0, 16), (16, 32), (32, 40)])   # up to layer 2: 3 blocks
    assert [round(p.fraction, 6) for p in seen] == sorted(round(p.fraction, 6) for p in seen)
    assert seen[-1].fraction == 1.0
    assert told.keys() == plain.keys() and all(np.array_equal(told[k].z, plain[k].z) for k in plain)


@pytest.mark.parametrize("compute", ["pattern", "overview", "lens", "copy", "report"])
def test_a_stop_ends_the_computation_at_that_layer_and_nothing_is_memoised(model4, compute):
    import engine.report.data as rd
    fns = {"pattern": lambda tell: attention_pattern(model4, IDS, LAYERS - 1, on_progress=tell),
           "overview": lambda tell: entropy_overview(model4, IDS, on_progress=tell),
           "lens": lambda tell: logit_lens(model4, IDS, 30, on_progress=tell),
           "copy": lambda tell: copy_attention(model4, IDS, 10, Loop(4, 3, 5, 20), on_progress=tell),
           "report": lambda tell: rd.attention_maps(model4, IDS, [0, LAYERS - 1], on_progress=tell)}
    seen: list[Progress] = []

    def stop_at_2(p: Progress):
        seen.append(p)
        return STOP if p.layer == 2 else None
    store: dict = {}
    with pytest.raises(Stopped):
        memo(store, "k", lambda: fns[compute](stop_at_2))
    assert [p.layer for p in seen] == [1, 2]                             # nothing ran past the stop
    assert store == {}
    assert model4.live_hooks == 0                                        # the probe left with the forward


def test_progress_text_and_the_estimate_from_the_measured_rate(model4):
    assert progress_text(Progress(0, 1024, 1024, 12, 30)) == "layer 12 of 30 · 1,024 positions"
    assert progress_text(Progress(512, 1024, 2000, 3, 30)) == "layer 3 of 30 · positions 512–1,023 of 2,000"
    record_rate(model4, "the lens over 100 positions", 1.0, None)       # no progress told: nothing learnt
    assert estimate(model4, "the lens over 1,000 positions", 1000, 4) is None
    record_rate(model4, "the lens over 100 positions", 2.0, Progress(0, 100, 100, 4, 4))   # 100 positions × 4 layers
    assert estimate(model4, "the lens over 1,000 positions", 1000, 4) == pytest.approx(20.0)
    assert estimate(model4, "layer 3's attention over 1,000 positions", 1000, 4) is None   # another kind
    assert about(20.0) == "about 20 s" and about(0.2) == "under a second" and about(None) == ""
