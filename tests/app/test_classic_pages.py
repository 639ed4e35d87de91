"""Every page opens on a GPT-2, a GPT-NeoX, a StarCoder 2 and a Cohere run (AppTest, tiny transformers-made models
from the reference tier's configs): no exception, no error, except Explain, which says by name that it does not
split LayerNorm blocks yet."""
from __future__ import annotations

import pytest

from engine import load_model
from tests.unit.test_family_kv_cache import family_run

PAGES = ("overview", "tokens", "attention", "activations", "kv_cache", "sampling", "timeline", "debugger",
         "repetition", "nan_doctor", "compare", "quantization", "trace_files")


@pytest.fixture(scope="module", params=["gpt2", "gpt_neox", "starcoder2", "cohere"])
def classic_run(request, tmp_path_factory, tokenizer_files):
    from tests.reference.family_models import build
    folder = build(request.param, tmp_path_factory.mktemp("classic") / request.param, tokenizer_files)
    model = load_model(folder, device="cpu", dtype="float32")
    return model, folder, family_run(model)


@pytest.mark.parametrize("name", PAGES)
def test_every_page_opens_on_the_classic_families(page, classic_run, name):
    model, folder, run = classic_run
    at = page(name, run, model, str(folder)).run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    if name == "overview":      # the page is about this model, and says what its family changes
        text = " ".join(str(e.value) for e in [*at.markdown, *at.caption])
        assert ("learned vectors" in text) == (model.config.model_type == "gpt2") and (
            "parallel residual" in text) == model.config.parallel_residual and (
            "adjacent pairs" in text) == (model.config.model_type == "cohere")


def test_explain_says_it_does_not_split_layernorm_blocks(page, classic_run):
    model, folder, run = classic_run
    at = page("explain", run, model, str(folder)).run()
    assert not at.exception, at.exception
    assert any("not implemented for" in e.value for e in at.error) or any(
        "not implemented for" in m.value for m in at.warning)
