"""inspector.views.timeline against hand-built marks and step timings, and on a real timed run."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine import RunSettings
from inspector.session.run import inspect_run
from inspector.views import timeline as tl

# Two steps of a 2-layer model, shaped as the engine records them: step 0 opens with the tokenizer's call,
# every step ends with the sampler's and the detokenizer's calls (a 'start' mark each, nothing else).
MARKS = [(0, "start", 0.0),
         (0, "start", 0.0), (0, "embed", 0.001), (0, "blocks.0", 0.004), (0, "blocks.1", 0.009), (0, "logits", 0.010),
         (0, "start", 0.0), (0, "start", 0.0),
         (1, "start", 0.0), (1, "embed", 0.0005), (1, "blocks.0", 0.0015), (1, "blocks.1", 0.0035),
         (1, "logits", 0.004), (1, "start", 0.0), (1, "start", 0.0),
         (2, "start", 0.0), (2, "embed", 0.0005), (2, "blocks.0", 0.0025), (2, "blocks.1", 0.0045),
         (2, "logits", 0.006), (2, "start", 0.0), (2, "start", 0.0)]


def test_layer_durations_hand():
    d = tl.layer_durations(MARKS)
    assert list(d["step"]) == [0] * 4 + [1] * 4 + [2] * 4
    assert list(d["stage"]) == ["embed", "blocks.0", "blocks.1", "logits"] * 3
    assert list(d["ms"]) == pytest.approx([1, 3, 5, 1, 0.5, 1, 2, 0.5, 0.5, 2, 2, 1.5])
    assert d["layer"].tolist()[:4] == [None, 0, 1, None] or d["layer"].isna().tolist()[:4] == [True, False, False, True]
    assert d.loc[1, "layer"] == 0 and d.loc[2, "layer"] == 1


def test_layer_matrix_and_means_hand():
    d = tl.layer_durations(MARKS)
    m = tl.layer_matrix(d)
    assert m.shape == (3, 2) and list(m.index) == [0, 1, 2]
    assert m.to_numpy().ravel().tolist() == pytest.approx([3, 5, 1, 2, 2, 2])
    means = tl.stage_means(d).set_index("stage")
    assert list(means.index) == ["embed", "blocks.0", "blocks.1", "logits"]
    assert means["prefill_ms"].tolist() == pytest.approx([1, 3, 5, 1])
    assert means["decode_mean_ms"].tolist() == pytest.approx([0.5, 1.5, 2.0, 1.0])
    fig = tl.layer_heatmap(d)
    assert list(fig.data[0].x) == [0, 1] and list(fig.data[0].y) == [0, 1, 2]
    z = tl.layer_heatmap(d, include_prefill=False).data[0].z
    assert [v for row in z for v in row] == pytest.approx([1, 2, 2, 2])
    bars = tl.stage_means_figure(tl.stage_means(d)).data
    assert list(bars[0].y) == pytest.approx([0.5, 1.5, 2.0, 1.0])


def test_layer_durations_sums_repeated_calls_and_rejects_orphans():
    twice = [(0, "start", 0.0), (0, "embed", 0.001), (0, "start", 0.0), (0, "embed", 0.002)]
    assert tl.layer_durations(twice)["ms"].tolist() == pytest.approx([3.0])
    with pytest.raises(ValueError):
        tl.layer_durations([(0, "embed", 0.001)])


def fake_result():
    steps = [SimpleNamespace(index=i, position=10 + i, token_id=100 + i, text=f"w{i}",
                             seconds={"forward": f, "sample": 0.002, "detokenize": 0.0005})
             for i, f in enumerate([0.050, 0.010, 0.012])]
    return SimpleNamespace(steps=steps, timings={"tokenize": 0.001, "prefill": 0.05, "decode": 0.022,
                                                 "per_token_decode": 0.011})


def test_step_table_one_row_per_step():
    df = tl.step_table(fake_result())
    assert list(df["step"]) == [0, 1, 2] and list(df["kind"]) == ["prefill", "decode", "decode"]
    assert df["forward_ms"].tolist() == pytest.approx([50, 10, 12])
    assert df["total_ms"].tolist() == pytest.approx([52.5, 12.5, 14.5])
    assert list(df["positions_after"]) == [10, 11, 12]


def test_phase_table_lays_phases_end_to_end():
    p = tl.phase_table(fake_result())
    assert len(p) == 1 + 3 * 3
    assert list(p["phase"][:4]) == ["tokenize", "forward", "sample", "detokenize"]
    assert p["label"].iloc[1] == "step 0 prefill" and p["label"].iloc[4] == "step 1 forward"
    assert p["start_ms"].tolist()[:5] == pytest.approx([0, 1, 51, 53, 53.5])
    assert (p["start_ms"] + p["ms"]).iloc[-1] == pytest.approx(1 + 52.5 + 12.5 + 14.5)
    fig = tl.gantt_figure(p)
    assert [t.name for t in fig.data] == list(tl.PHASES)
    fwd = fig.data[1]
    assert list(fwd.base) == pytest.approx([1, 53.5, 66]) and list(fwd.y) == ["step 0", "step 1", "step 2"]


def test_totals_and_stacked():
    t = tl.totals_table(fake_result()).set_index("phase")["ms"]
    assert t.tolist() == pytest.approx([1, 50, 22, 6, 1.5])
    fig = tl.stacked_figure(tl.step_table(fake_result()), log_y=True)
    assert fig.layout.barmode == "stack" and fig.layout.yaxis.type == "log"
    assert [t.name for t in fig.data] == ["forward", "sample", "detokenize"]


def test_timing_note_names_the_clock():
    assert "CUDA events" in tl.timing_note("cuda")
    assert "perf_counter" in tl.timing_note("cpu") and "synchronous" in tl.timing_note("cpu")


def test_real_run_per_layer(tiny_model):
    run = inspect_run(tiny_model, RunSettings(prompt="Timing the layers", chat=False, max_new_tokens=4, timing=True))
    result = run.result
    d = tl.layer_durations(run.recording.marks)
    n_layers = tiny_model.config.num_layers
    assert len(d) == len(result.steps) * (n_layers + 2)
    assert (d["seconds"] >= 0).all()
    for step in result.steps:
        mine = d[d["step"] == step.index]
        assert list(mine["stage"]) == ["embed", *(f"blocks.{i}" for i in range(n_layers)), "logits"]
        # the stages of one forward add up to its last mark, which fits inside the step's forward time
        marks = [(lbl, t) for s, lbl, t in run.recording.marks if s == step.index]
        i = [lbl for lbl, _ in marks].index("embed")
        start, last = marks[i - 1][1], marks[i + n_layers + 1][1]
        assert marks[i - 1][0] == "start" and marks[i + n_layers + 1][0] == "logits"
        assert mine["seconds"].sum() == pytest.approx(last - start, rel=1e-6, abs=1e-9)
        assert last <= step.seconds["forward"]
    assert tl.layer_matrix(d).shape == (len(result.steps), n_layers)
    assert len(tl.step_table(result)) == len(result.steps)
    untimed = inspect_run(tiny_model, RunSettings(prompt="No timing", chat=False, max_new_tokens=2, timing=False))
    assert tl.layer_durations(untimed.recording.marks).empty
