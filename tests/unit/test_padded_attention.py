"""The padded product of a batch's rows (engine.attention_math.padded_attention: the accelerator's path of
engine.batch.rows, one product over every row's keys padded to the longest) against each row's attention alone: the
same z, scores and pattern within rounding (the padded sums add the pad's zero weights and run in another order), here
on the CPU, where the batch otherwise takes each row alone; and a batched decode step forced onto the padded path
gives each run the logits and the pattern its own step gives, within the same rounding."""
from __future__ import annotations

import pytest
import torch

from engine import GenerationRun, SamplingParams
from engine.accelerator import PLAIN
from engine.attention import explicit
from engine.attention_math import padded_attention
from engine.batch import forward_together
from engine.batch import rows as batch_rows
from engine.batch.rows import Rows
from engine.inspection.probe import Probe
from engine.inspection.probe_views import NO_PROBE

pytestmark = pytest.mark.unit

# float32 sums of a few hundred terms in another order, and the pad's zero weights added: a few float32 ulps of
# values O(1); 1e-5 leaves a wide margin while a wrong key, head or scale is off by O(0.1).
TOL = dict(rtol=1e-5, atol=1e-5)


def _hand_scores(q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """q (H, hd), keys (K, S, hd) -> (H, S): each query head against its KV head's keys (head h reads KV head
    h // (H / K)), written out with the keys copied per head."""
    H, K = q.shape[0], keys.shape[0]
    per_head = keys.repeat_interleave(H // K, dim=0)                                     # (H, S, hd)
    return torch.einsum("hd,hsd->hs", q.double(), per_head.double()).float() * scale


@pytest.mark.parametrize("heads,kv_heads,softcap", [(4, 2, None), (6, 6, None), (4, 1, 30.0)])
def test_the_padded_product_gives_each_row_its_attention_alone(heads, kv_heads, softcap):
    g = torch.Generator().manual_seed(7)
    hd, lengths, scale = 16, [5, 1, 12, 12], 16 ** -0.5
    qh = torch.randn(heads, len(lengths), hd, generator=g)
    keys = [torch.randn(kv_heads, n, hd, generator=g) for n in lengths]
    values = [torch.randn(kv_heads, n, hd, generator=g) for n in lengths]
    offered: dict[str, tuple] = {}
    z = padded_attention(qh, keys, values, scale=scale, softcap=softcap,
                         offer=lambda stage, x, pad: offered.setdefault(stage, (x.clone(), pad.clone())))
    assert z.shape == qh.shape
    scores, pad = offered["attn.scores"]
    pattern, _ = offered["attn.pattern"]
    assert pad.tolist() == [[s >= n for s in range(max(lengths))] for n in lengths]
    for b, n in enumerate(lengths):
        alone = explicit(qh[:, b:b + 1], keys[b], values[b], NO_PROBE, None, scale, softcap)      # (H, 1, hd)
        torch.testing.assert_close(z[:, b], alone[:, 0], **TOL)
        want = _hand_scores(qh[:, b], keys[b], scale)
        if softcap is not None:
            want = torch.tanh(want / softcap) * softcap
        torch.testing.assert_close(scores[b, :, :n], want, **TOL)
        assert bool((scores[b, :, n:] == float("-inf")).all()) and bool((pattern[b, :, n:] == 0).all())
        torch.testing.assert_close(pattern[b, :, :n], torch.softmax(want.double(), -1).float(), **TOL)


def _runs(model) -> list[GenerationRun]:
    """Three runs prefilled to different lengths (so the padded keys differ per row), each capturing layer 1's
    pattern."""
    runs = [GenerationRun(model, p, params=SamplingParams(temperature=0), max_new_tokens=3, ignore_eos=True,
                          probe=Probe().capture(["blocks.1.attn.pattern"]))
            for p in ("hello there", "a longer prompt with more words in it", "x")]
    for r in runs:
        r.step()
    return runs


def test_a_batched_step_forced_onto_the_padded_path_gives_each_run_its_own_step(tiny_model, monkeypatch):
    model = tiny_model.with_accelerator(PLAIN)      # the PyTorch forward, whose rows reach Rows.attend
    alone, together = _runs(model), _runs(model)
    want = [r.model.forward(torch.tensor([r.decode_input()]), r.cache, r.probe)[0] for r in alone]
    calls = []

    def counted(*a, **k):
        calls.append(1)
        return padded_attention(*a, **k)
    monkeypatch.setattr(Rows, "padded", lambda self, i, device: True)       # as on an accelerator
    monkeypatch.setattr(batch_rows, "padded_attention", counted)
    rows, _ = forward_together(together)
    assert len(calls) == model.config.num_layers                        # every layer took the padded product
    for a, t, w, got in zip(alone, together, want, rows):
        torch.testing.assert_close(got, w, **TOL)
        assert t.cache.get_pos() == a.cache.get_pos()
        mine = [c.value for c in t.probe.recording.captures if c.name == "blocks.1.attn.pattern"][-1]
        ref = [c.value for c in a.probe.recording.captures if c.name == "blocks.1.attn.pattern"][-1]
        assert mine.shape == ref.shape
        torch.testing.assert_close(mine, ref, **TOL)
