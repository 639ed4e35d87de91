"""Every page opens on a GPT-2, a GPT-NeoX, a StarCoder 2 and a Cohere run (AppTest, tiny transformers-made models
from the reference tier's configs): no exception, no error; Explain and the Attention page's score split show their
numbers through the LayerNorm blocks, and those numbers add up to the forward's own (logit difference, pre-softmax
score)."""
from __future__ import annotations

import numpy as np
import pytest

from engine import Probe, load_model
from inspector.ui.state import session_of
from tests.app.test_app_explain import metric
from tests.app.test_app_pages_a import arr, chart
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


def test_explain_splits_the_logit_difference_through_the_layernorm(page, classic_run):
    """Step 0 of the run: the page's difference is the engine's logits' own (computed here apart), the sum of
    contributions it shows equals it (to the six decimals shown), and it calls the split exact; the final norm's bias
    is a row of its own."""
    model, folder, run = classic_run
    at = page("explain", run, model, str(folder)).run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    logits = model.logits(run.result.prompt_ids)[-1]
    a = run.result.token_ids[0]
    b = int(logits.topk(2).indices[1]) if int(logits.argmax()) == a else int(logits.argmax())
    want = float(logits[a] - logits[b])     # a full forward here, the page's a last-row one: fp32 rounding apart
    bound = 1e-4 * max(1.0, abs(want))
    assert metric(at, "logit(A) − logit(B)") == pytest.approx(want, abs=bound)
    assert metric(at, "Sum of contributions") == pytest.approx(metric(at, "logit(A) − logit(B)"), abs=2e-6)
    assert any(c.value.startswith("Decomposition exact") for c in at.caption)
    shares = list(session_of(at.session_state).memos["explain_memo"].values())
    assert shares and "final_norm.bias" in shares[-1].contributions


def test_the_attention_page_splits_a_score_through_the_layernorm(page, classic_run):
    """Head 1 of layer 1, the last query to key 2: the map's cells sum to the score the page states, which is the
    forward's own (its attn.scores stage, captured here)."""
    model, folder, run = classic_run
    at = page("attention", run, model, str(folder)).run()
    at.selectbox(key="att_layer").set_value(1)
    at.selectbox(key="att_head").set_value(1).run()
    at.number_input(key="qk_key").set_value(2)
    at.button(key="qk_run").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    ids = session_of(at.session_state).run.ids
    probe = Probe().capture("blocks.1.attn.scores")
    model.logits(ids, probe)
    score = float(probe.recording.captured("blocks.1.attn.scores")[0].value[1, len(ids) - 1, 2])
    total = float(np.sum(arr(chart(at, "qk_map")["data"][0]["z"])))
    assert abs(total - score) <= 1e-4 * max(1.0, abs(score))
    assert any(f"Score {score:.5g}" in c.value and "exact" in c.value for c in at.caption)
