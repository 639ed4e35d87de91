"""The bundled model's shipped tuned lens (engine/lenses/, made by scripts/fit_tuned_lens.py): found by its weights'
checksum and checked at load; on held-out text (stdlib docstrings of modules the fit never read) its KL to the final
distribution is at most the logit lens' at every layer and at least 30 % lower averaged over the first half of the
layers; the last layer's map is the identity (the fit regresses the final stream on itself) while earlier maps are
not; a copy of the file that was altered, or read for other weights, or held to another recipe, is refused."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.tools import lens_file
from engine.tools.lens_file import LensFileError, find_lens, read_lens, weights_checksum
from engine.tools.lens_corpus import HELDOUT_MODULES, TRAIN_MODULES
from engine.tools.tuned_lens import compare_lenses

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def shipped(bundled_model):
    return find_lens(bundled_model)


@pytest.fixture(scope="module")
def held_out(bundled_model, shipped):
    return compare_lenses(bundled_model, shipped, max_tokens=512)


def test_the_shipped_lens_is_the_bundled_weights_and_its_recipe(bundled_model, shipped):
    assert shipped is not None and shipped.weights_checksum == weights_checksum(bundled_model)
    name, _ = lens_file.SHIPPED[shipped.weights_checksum]
    assert (lens_file.SHIPPED_DIR / name).stat().st_size < 4_000_000
    r = shipped.recipe
    assert r["script"] == "scripts/fit_tuned_lens.py" and r["corpus"] == "python-stdlib-docstrings:train"
    assert r["modules"] == list(TRAIN_MODULES) and not set(TRAIN_MODULES) & set(HELDOUT_MODULES)
    assert shipped.layers == bundled_model.config.num_layers and shipped.rank == r["rank"]


def test_held_out_kl_is_at_most_the_logit_lens_everywhere_and_30_percent_lower_over_the_first_half(held_out):
    L = len(held_out.logit_kl)
    assert held_out.tokens == 512 and L == 30
    for layer, (logit, tuned) in enumerate(zip(held_out.logit_kl, held_out.tuned_kl)):
        assert tuned <= logit, f"layer {layer}: tuned lens {tuned:.4f} nats > logit lens {logit:.4f}"
    half = L // 2
    first_logit, first_tuned = sum(held_out.logit_kl[:half]) / half, sum(held_out.tuned_kl[:half]) / half
    assert first_tuned <= 0.7 * first_logit, (first_tuned, first_logit)
    assert held_out.logit_kl[-1] == pytest.approx(0.0, abs=1e-4)      # the last layer's logit lens is the output


def test_the_last_layers_map_is_the_identity_and_the_first_is_not(shipped):
    assert shipped.identity_distance(shipped.layers - 1) < 1e-3
    assert shipped.identity_distance(0) > 0.1
    h = torch.randn(4, shipped.b.shape[1])
    torch.testing.assert_close(shipped.translate(shipped.layers - 1, h), h, atol=1e-3, rtol=1e-3)


def test_the_shipped_file_is_checked_at_load(bundled_model, tiny_model, shipped, tmp_path):
    name, recipe_sha = lens_file.SHIPPED[shipped.weights_checksum]
    src = lens_file.SHIPPED_DIR / name
    with pytest.raises(LensFileError, match="fitted for weights gguf-sha256"):
        read_lens(src, tiny_model)
    with pytest.raises(LensFileError, match="not the one shipped"):
        read_lens(src, bundled_model, expect_recipe_sha=recipe_sha[::-1])
    with safe_open(str(src), framework="pt") as f:
        meta, t = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    t["U"] = t["U"].clone()
    t["U"][3, 0, 0] += 1
    save_file(t, str(tmp_path / name), metadata=meta)
    with pytest.raises(LensFileError, match="altered"):
        read_lens(tmp_path / name, bundled_model)
    shutil.copy(src, tmp_path / "copy.safetensors")
    assert read_lens(tmp_path / "copy.safetensors", bundled_model, expect_recipe_sha=recipe_sha).recipe == \
        shipped.recipe
