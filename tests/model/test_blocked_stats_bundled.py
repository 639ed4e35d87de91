"""On the bundled model at 300 tokens: the attention statistics a statistics-only probe gets (fused attention,
statistics in query blocks) equal those of the materialised scores and pattern to 1e-5 of each row's
magnitude, in every layer, for a prefill and a chunk after it; logits and greedy tokens do not change."""
from __future__ import annotations

import pytest
import torch

from engine import Probe, inspection_probe
from engine.generate import generate
from engine.inspection.reference_stats import dense_stats

pytestmark = pytest.mark.model
ATTN = ["blocks.*.attn.scores", "blocks.*.attn.pattern"]
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden screw press. ") * 10


def materialised_stats(x: torch.Tensor, masked: bool) -> torch.Tensor:
    """Statistics of a captured (heads, T, S) stage, per query position, in float64 (the two-pass oracle)."""
    return dense_stats(x.transpose(0, 1).reshape(x.shape[1], -1).double(), masked).float()


def assert_close_rows(got: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    assert torch.equal(got[:, 5:], ref[:, 5:]), name
    err = ((got[:, :5] - ref[:, :5]).abs() / ref[:, 4:5].clamp(min=1e-30)).max()
    assert float(err) <= 1e-5, f"{name}: {float(err):.2e}"


@pytest.fixture(scope="module")
def ids(bundled_model):
    ids = bundled_model.tokenizer.encode(TEXT)[:300]
    assert len(ids) == 300
    return ids


def test_blocked_attention_statistics_equal_the_materialised_ones(bundled_model, ids):
    stats, full = Probe().record_stats(ATTN), Probe().capture(ATTN)
    caches = [bundled_model.new_cache(len(ids)) for _ in range(2)]
    for chunk in (ids[:260], ids[260:]):                 # a prefill, then a chunk over the cache before it
        for probe, cache in zip((stats, full), caches):
            bundled_model.forward(torch.tensor(chunk), cache, probe, last_only=True)
    records = stats.recording.stat_records()
    assert len(records) == len(full.recording.captures) == 2 * 2 * bundled_model.config.num_layers
    for rec, cap in zip(records, full.recording.captures):
        assert (rec.name, rec.pos0) == (cap.name, cap.positions[0])
        assert_close_rows(rec.values, materialised_stats(cap.value, cap.name.endswith("scores")), rec.name)


def test_full_inspection_changes_neither_logits_nor_greedy_tokens(bundled_model, ids):
    plain = bundled_model.logits(ids)
    assert torch.equal(bundled_model.logits(ids, Probe().record_stats("*")), plain)
    a = generate(bundled_model, ids[:40], max_new_tokens=24, ignore_eos=True)
    probe = inspection_probe()
    b = generate(bundled_model, ids[:40], max_new_tokens=24, ignore_eos=True, probe=probe)
    assert a.token_ids == b.token_ids
    names = {r.name for r in probe.recording.stat_records()}
    assert set(bundled_model.hook_names()) - {"tokenizer", "detokenizer"} <= names
    assert probe.recording.first_nonfinite() is None
