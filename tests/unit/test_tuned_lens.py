"""The tuned lens (engine.tools.tuned_lens, engine.tools.lens_file): stage 1 recovers a known affine map of low
rank exactly, whatever the metric; on the tiny model the fit beats the logit lens on held-out text and leaves the
last layer's map the identity; the default fit takes KL steps and keeps them per layer only where they lowered
the validation KL; on a hand-built read where least squares is not the KL's minimum the KL training lowers the
held-out KL well below its least-squares start, the same under the same seed, with the exact gradient; both lenses
read at one position agree with the logit lens the Activations page draws; a saved lens round-trips and a file that was altered, lacks its recipe or
was fitted for other weights is refused with a message naming what; an absent lens is None until one is kept."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine import Probe
from engine.progress import STOP, Stopped
from engine.tools import lens_file
from engine.tools.lens_file import LensFileError, find_lens, keep_lens, read_lens, save_lens, weights_checksum
from engine.tools.lens_kl import LensHead, add_kl_grad, kl_train, mean_kl, translate
from engine.tools.tuned_lens import (
    BATCH,
    TunedLens,
    add_sums,
    compare_lenses,
    default_steps,
    fit_stages,
    fit_tuned_lens,
    lenses_at,
    new_sums,
    solve_translator,
)
from inspector.views.activations import logit_lens

pytestmark = pytest.mark.unit
TRAIN = ["The cat sat on the mat, and then the dog sat on the cat, which did not please the cat at all.",
         "Numbers go up: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve.",
         "A lens reads what a layer would predict if the model stopped there; a tuned lens first translates it.",
         "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # five, as any reader of the code expects"]
HELD_OUT = ["The dog sat on the mat after the cat had left it, and the numbers went one, two, three, four.",
            "A translator is an affine map per layer, fitted so that the lens agrees with the final layer."]


def test_stage_one_recovers_a_known_low_rank_affine_map_whatever_the_metric():
    g = torch.Generator().manual_seed(0)
    d, n = 16, 4000
    a0 = torch.randn(d, 2, generator=g, dtype=torch.float64) @ torch.randn(2, d, generator=g, dtype=torch.float64)
    b0 = torch.randn(d, generator=g, dtype=torch.float64)
    h = torch.randn(n, d, generator=g, dtype=torch.float64) * 3 + 1
    sums = new_sums(d)
    add_sums(sums, h[:1500], h[:1500] + h[:1500] @ a0.T + b0)       # two batches: the sums pool them
    add_sums(sums, h[1500:], h[1500:] + h[1500:] @ a0.T + b0)
    m = torch.randn(d, d, generator=g, dtype=torch.float64)
    for metric in (torch.eye(d, dtype=torch.float64), m @ m.T + 0.1 * torch.eye(d, dtype=torch.float64)):
        u, v, b = solve_translator(sums, metric, rank=2, ridge=0.0)
        assert u.shape == v.shape == (d, 2)
        torch.testing.assert_close((u @ v.T).double(), a0, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b.double(), b0, atol=1e-4, rtol=1e-4)


def test_rank_one_keeps_the_direction_that_matters_in_the_metric():
    """y - h = 5 x e0-part + 1 x e1-part: at rank 1 the plain metric keeps the larger (e0); a metric that weighs
    e1 400 times as much keeps e1."""
    g = torch.Generator().manual_seed(1)
    d = 4
    h = torch.randn(3000, d, generator=g, dtype=torch.float64)
    a0 = torch.zeros(d, d, dtype=torch.float64)
    a0[0, 0], a0[1, 1] = 5.0, 1.0
    sums = new_sums(d)
    add_sums(sums, h, h + h @ a0.T)
    u, v, _ = solve_translator(sums, torch.eye(d, dtype=torch.float64), rank=1, ridge=0.0)
    torch.testing.assert_close((u @ v.T).double()[0, 0], torch.tensor(5.0, dtype=torch.float64), atol=1e-5, rtol=0)
    w = torch.diag(torch.tensor([1.0, 400.0, 1.0, 1.0], dtype=torch.float64))
    u, v, _ = solve_translator(sums, w, rank=1, ridge=0.0)
    kept = (u @ v.T).double()
    torch.testing.assert_close(kept[1, 1], torch.tensor(1.0, dtype=torch.float64), atol=1e-5, rtol=0)
    assert abs(kept[0, 0]) < 1e-5


@pytest.fixture(scope="module")
def lens(tiny_model):
    return fit_tuned_lens(tiny_model, TRAIN, rank=8)


def test_the_fit_beats_the_logit_lens_on_held_out_text_and_leaves_the_last_layer_alone(tiny_model, lens):
    cmp = compare_lenses(tiny_model, lens, HELD_OUT)
    assert cmp.tokens == sum(len(tiny_model.tokenizer.encode(t)) - 1 for t in HELD_OUT)
    assert cmp.tuned_kl[0] < cmp.logit_kl[0]
    assert cmp.logit_kl[-1] == pytest.approx(0.0, abs=1e-5) and cmp.tuned_kl[-1] == pytest.approx(0.0, abs=1e-5)
    assert lens.identity_distance(lens.layers - 1) == 0.0 and lens.identity_distance(0) > 0
    assert lens.recipe["tokens"] == sum(len(tiny_model.tokenizer.encode(t)) - 1 for t in TRAIN)
    assert lens.recipe["rank"] == 8 and lens.recipe["corpus"] == "caller-supplied texts"


def test_the_default_fit_takes_kl_steps_and_its_recipe_says_so(tiny_model, lens):
    """The on-demand fit (no steps given) is least squares and then default_steps Adam steps on the KL; the recipe
    names them, and each layer keeps the trained maps only where they lowered the validation KL."""
    fit = fit_stages(tiny_model, TRAIN, rank=8)
    r = fit.lens.recipe
    assert r["steps"] == default_steps(tiny_model) > 0 and r["batch"] == BATCH and r["seed"] == 0
    assert f"then {r['steps']} Adam steps on the mean KL" in r["method"] and r["validation_every"] == 8
    assert r["kl_layers"] == [i for i, k in enumerate(fit.kl.kept) if k] and fit.kl.kept[-1] is False
    for layer, kept in enumerate(fit.kl.kept[:-1]):
        assert kept == (fit.kl.after[layer] < fit.kl.before[layer])
        src = fit.lens if kept else fit.least_squares
        assert torch.equal(fit.lens.b[layer], src.b[layer])
    assert fit.least_squares.recipe["steps"] == 0 and "no KL steps" in fit.least_squares.recipe["method"]
    assert torch.equal(lens.U, fit.lens.U)                              # fit_tuned_lens is the same fit's lens


def _hand_built(seed: int, n: int):
    """A hand-built read where least squares is not the KL's minimum: the final stream is h plus an MLP of h plus,
    in a direction the final norm weighs 0.05, 10 |h_1|, which sets the RMS the norm divides by (how sharp the final
    distribution is) through a function no affine map of h follows; width 8, a 32-token vocabulary."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, 8, generator=g)
    mlp = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    y = h + torch.relu(h) @ mlp
    y[:, 0] += 10 * h[:, 1].abs()
    return h, y


def test_kl_training_lowers_held_out_kl_below_its_least_squares_start_on_a_hand_built_read(tiny_model):
    norm_w = torch.ones(8)
    norm_w[0] = 0.05
    head = LensHead(tiny_model.config, norm_w, None, 1e-6, torch.randn(8, 32, generator=torch.Generator()
                                                                        .manual_seed(2)) * 2, None, 1.0, None)
    h, y = _hand_built(0, 3000)
    sums = new_sums(8)
    rms = lambda x: x.pow(2).mean(-1, keepdim=True).sqrt()                 # noqa: E731: the fit's own rescale
    add_sums(sums, h, y * rms(h) / rms(y))
    u, v, b = solve_translator(sums, torch.eye(8, dtype=torch.float64), rank=4, ridge=1e-3)
    maps = tuple(torch.stack([t, torch.zeros_like(t)]) for t in (u, v, b))   # layer 1 (the last): the identity
    validation = torch.arange(3000) % 8 == 7
    runs = [kl_train(head, torch.stack([h, y]), maps, steps=60, lr=1e-2, batch=256, seed=0, validation=validation)
            for _ in range(2)]
    (tu, tv, tb), report = runs[0]
    for mine, again in zip(runs[0][0], runs[1][0]):
        assert torch.equal(mine, again)                                     # the same seed, the same lens
    hh, yh = _hand_built(5, 1000)                                           # text the fit never saw
    logit = mean_kl(head, torch.zeros_like(u), v, torch.zeros_like(b), hh, yh)
    least_squares = mean_kl(head, u, v, b, hh, yh)
    trained = mean_kl(head, tu[0], tv[0], tb[0], hh, yh)
    assert least_squares < logit and trained < 0.7 * least_squares, (logit, least_squares, trained)
    assert report.kept == [True, False] and report.after[0] < report.before[0]
    assert torch.equal(tu[1], maps[0][1]) and torch.equal(tb[1], maps[2][1])


def test_a_kl_step_gradient_is_the_exact_gradient_of_the_mean_kl_through_divisor_and_soft_cap(tiny_model):
    """add_kl_grad writes d KL / d logits = softmax - p by hand; autograd through the whole (B, V) read, in float64,
    is the reference, for the plain head and for one with Granite's divisor and Gemma 2's soft cap."""
    g = torch.Generator().manual_seed(3)
    plain = LensHead.of(tiny_model)
    d = plain.W.shape[0]
    h, final = torch.randn(6, d, generator=g), torch.randn(6, d, generator=g)
    for head in (plain, dataclasses.replace(plain, divisor=2.0, softcap=3.0)):
        u, v, b = (torch.randn(*s, generator=g) * 0.3 for s in ((d, 4), (d, 4), (d,)))
        ours = [t.clone().requires_grad_() for t in (u, v, b)]
        for t in ours:
            t.grad = torch.zeros_like(t)
        p = head.log_probs(final).exp()
        add_kl_grad(head, *ours, h, p)
        ref = [t.double().requires_grad_() for t in (u, v, b)]
        d64 = dataclasses.replace(head, norm_w=head.norm_w.double(), W=head.W.double())
        z = d64.normed(translate(*ref, h.double())) @ d64.W / d64.divisor
        z = torch.tanh(z / d64.softcap) * d64.softcap if d64.softcap else z
        q_log, p64 = torch.log_softmax(z, -1), p.double()
        (p64 * (p64.clamp_min(1e-300).log() - q_log)).sum(-1).mean().backward()
        for mine, want in zip(ours, ref):
            torch.testing.assert_close(mine.grad.double(), want.grad, rtol=2e-4, atol=1e-6)


def test_both_lenses_at_a_position_match_the_pages_logit_lens(tiny_model, lens):
    ids = tiny_model.tokenizer.encode(HELD_OUT[0])
    pos = 9
    top, kl = lenses_at(tiny_model, ids, pos, lens, k=5)
    page = logit_lens(tiny_model, ids, pos, 5)
    ours = [r for r in top if r["lens"] == "logit lens"]
    assert [r["id"] for r in ours] == list(page["id"])
    assert [r["prob"] for r in ours] == pytest.approx(list(page["prob"]), rel=1e-5)
    assert {r["lens"] for r in top} == {"logit lens", "tuned lens"} and len(top) == 2 * 2 * 5
    assert kl[-1]["logit_lens"] == pytest.approx(0.0, abs=1e-5) and kl[-1]["tuned_lens"] == pytest.approx(0, abs=1e-5)
    # layer 0's KL at this position, by hand from the captured stream and the model's own final distribution
    probe = Probe().capture("blocks.0.resid_post", positions=[pos])
    final = torch.log_softmax(tiny_model.logits(ids[:pos + 1], probe)[-1], -1)
    h = probe.recording.captures[0].value.float()
    for name, read in (("logit_lens", h), ("tuned_lens", lens.translate(0, h))):
        q = torch.log_softmax(tiny_model.unembed(read)[0], -1)
        assert kl[0][name] == pytest.approx(float((final.exp() * (final - q)).sum()), rel=1e-4, abs=1e-6)
    assert kl[0]["tuned_lens"] != kl[0]["logit_lens"]


def test_a_saved_lens_round_trips(tiny_model, lens, tmp_path):
    lens.recipe["script"] = "tests/unit/test_tuned_lens.py"
    lens.weights_checksum = weights_checksum(tiny_model)
    path = save_lens(lens, tmp_path / "tiny.safetensors")
    back = read_lens(path, tiny_model)
    h = torch.randn(3, tiny_model.config.hidden_size)
    for layer in range(lens.layers):      # U, V are stored in float16: the translation to fp16's precision
        torch.testing.assert_close(back.translate(layer, h), lens.translate(layer, h), atol=2e-2, rtol=2e-3)
    assert back.recipe == lens.recipe and back.weights_checksum == lens.weights_checksum


def _rewrite(src, dst, *, meta=None, drop_recipe_field=None, scale_b=1.0):
    with safe_open(str(src), framework="pt") as f:
        m = dict(f.metadata())
        t = {k: f.get_tensor(k) for k in f.keys()}
    if drop_recipe_field:
        r = json.loads(m["recipe"])
        del r[drop_recipe_field]
        m["recipe"] = json.dumps(r)
    m.update(meta or {})
    t["b"] = t["b"] * scale_b
    save_file(t, str(dst), metadata=m)
    return dst


def test_altered_incomplete_or_foreign_files_are_refused_naming_what(tiny_model, tiny_looping_model, lens, tmp_path):
    lens.recipe["script"] = "tests/unit/test_tuned_lens.py"
    lens.weights_checksum = weights_checksum(tiny_model)
    good = save_lens(lens, tmp_path / "good.safetensors")
    with pytest.raises(LensFileError, match="fitted for weights .*not this model's"):
        read_lens(good, tiny_looping_model)
    with pytest.raises(LensFileError, match="altered"):
        read_lens(_rewrite(good, tmp_path / "b.safetensors", scale_b=1.5), tiny_model)
    with pytest.raises(LensFileError, match="altered"):
        read_lens(_rewrite(good, tmp_path / "c.safetensors", meta={"weights_checksum": "gguf-sha256:" + "0" * 64}),
                  tiny_model)
    with pytest.raises(LensFileError, match="recipe lacks seed"):
        read_lens(_rewrite(good, tmp_path / "d.safetensors", drop_recipe_field="seed"), tiny_model)
    with pytest.raises(LensFileError, match="no recipe recorded"):
        read_lens(_rewrite(good, tmp_path / "e.safetensors", meta={"recipe": "not json"}), tiny_model)
    with pytest.raises(LensFileError, match="not the one shipped"):
        read_lens(good, tiny_model, expect_recipe_sha="0" * 64)
    with pytest.raises(LensFileError, match="recipe and weights checksum; missing: weights_checksum"):
        save_lens(TunedLens(lens.U, lens.V, lens.b, dict(lens.recipe)), tmp_path / "f.safetensors")


def test_an_absent_lens_is_none_until_one_is_kept(tiny_model, lens, tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(tmp_path))
    assert weights_checksum(tiny_model) not in lens_file.SHIPPED
    assert find_lens(tiny_model) is None
    kept = TunedLens(lens.U.clone(), lens.V.clone(), lens.b.clone(), {**lens.recipe})
    kept.recipe.pop("script", None)
    path = keep_lens(tiny_model, kept)
    assert path.parent == tmp_path / "lenses"
    found = find_lens(tiny_model)
    assert found is not None and found.recipe["script"].startswith("on demand")
    torch.testing.assert_close(found.b, kept.b)


def test_stop_ends_the_fit_between_two_texts(tiny_model):
    heard = []

    def stop_second(p):
        heard.append(p.what)
        return STOP if len(heard) == 2 else None

    with pytest.raises(Stopped):
        fit_tuned_lens(tiny_model, TRAIN, rank=4, on_progress=stop_second)
    assert heard == ["text 1 of 4", "text 2 of 4"]
