"""The pages on the new model families (AppTest, tiny transformers-made models): the KV cache page counts global and
local layers apart, the Attention page says which layers are local and shows their band, the Activations page shows
a mixture-of-experts model's routing, and the Sampling page shows Gemma 2's logits before and after the final cap."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from inspector.views import experts as ex
from inspector.views import kv_cache as kv
from inspector.views import softcap as sc
from tests.app.test_app_pages_b import arr, chart, find_df
from tests.unit.test_family_kv_cache import WINDOW, family_model, family_run


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, tokenizer_files):
    model, folder = family_model("gemma2", tmp_path_factory.mktemp("fam") / "gemma2", tokenizer_files)
    return model, folder, family_run(model)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory, tokenizer_files):
    model, folder = family_model("mixtral", tmp_path_factory.mktemp("fam") / "mixtral", tokenizer_files)
    return model, folder, family_run(model)


def test_kv_cache_page_counts_global_and_local_layers(page, gemma):
    model, folder, run = gemma
    at = page("kv_cache", run, model, str(folder)).run()
    assert not at.exception, at.exception
    assert not at.error                                                 # the formula matched the engine
    check = find_df(at, "quantity", "formula_bytes", "engine_bytes").set_index("quantity")
    assert check["match"].all() and check.loc["allocated", "engine_bytes"] == run.result.cache["bytes_allocated"]
    per_row = run.result.cache["bytes_per_token"] // model.config.num_layers
    kinds = find_df(at, "kind", "next_token_bytes").set_index("kind")
    local = f"local (window {WINDOW})"
    assert kinds.loc[local, "layers"] == 2 and kinds.loc["global", "layers"] == 2
    assert kinds.loc[local, "used_bytes"] == 2 * WINDOW * per_row and not kinds.loc[local, "growing"]
    assert kinds.loc[local, "next_token_bytes"] == 0 and kinds.loc["global", "next_token_bytes"] == 2 * per_row
    assert kinds["used_bytes"].sum() == run.result.cache["bytes_used"]
    assert any("ring full: no longer growing" in m.value for m in at.markdown)
    traces = {t["name"]: t for t in chart(at, "kv_growth")["data"]}
    assert len(set(arr(traces["used: local (window) layers"]["y"]).tolist())) == 1      # flat
    assert np.all(np.diff(arr(traces["used: global layers"]["y"])) == 2 * per_row)      # still growing
    layers = find_df(at, "layer", "kind", "allocated_bytes", "used_bytes")
    cache = model.new_cache(len(run.result.prompt_ids) + 6)
    assert list(layers["allocated_bytes"]) == [a for a, _ in cache.layer_bytes()]
    pivot = [el.value for el in at.dataframe if 8192 in list(el.value.columns)][0]
    shape = kv.KVShape.from_config(model.config)
    this = [i for i in pivot.index if "(this model)" in i][0]
    assert float(pivot.loc[this, 8192]) == pytest.approx(shape.bytes(8192, 1, 2) / 2 ** 30)   # bf16 default
    assert shape.bytes(8192, 1, 2) == 2 * 2 * 16 * 2 * (2 * 8192 + 2 * WINDOW)
    assert "Gemma-2-9B" in pivot.index


def test_attention_page_says_which_layers_are_local_and_draws_their_band(page, gemma):
    model, folder, run = gemma
    at = page("attention", run, model, str(folder)).run()
    assert not at.exception, at.exception
    sel = at.selectbox(key="att_layer")
    assert sel.options == [f"Layer 0 · local (window {WINDOW})", "Layer 1 · global",
                           f"Layer 2 · local (window {WINDOW})", "Layer 3 · global"]
    assert any("Layer 0 is **local**" in c.value for c in at.caption)
    T = len(run.ids)
    z = arr(chart(at, "att_map")["data"][0]["z"]).astype(float)                          # (T, T), layer 0
    q, k = np.arange(T)[:, None], np.arange(T)[None, :]
    assert z.shape == (T, T) and T > 2 * WINDOW
    assert np.all(np.nan_to_num(z[k <= q - WINDOW]) == 0)                                 # nothing past the band
    assert np.allclose(np.nansum(z, axis=1), 1, atol=1e-4)
    ticks = chart(at, "att_entropy")["layout"]["yaxis"]["ticktext"]
    assert ticks == [f"0 · local {WINDOW}", "1 · global", f"2 · local {WINDOW}", "3 · global"]
    sel.set_value(1).run()
    assert not at.exception
    assert any("Layer 1 is **global**" in c.value for c in at.caption)
    z1 = np.nan_to_num(arr(chart(at, "att_map")["data"][0]["z"]).astype(float))
    assert z1[k <= q - WINDOW].sum() > 0.1                                               # a global layer looks back


def test_entropy_overview_follows_the_windows_and_the_soft_cap(gemma):
    from inspector.views.attention import attention_pattern, entropy_overview, outside_window, row_entropy
    model, _, run = gemma
    ids = run.ids
    ent = entropy_overview(model, ids)
    for layer in range(model.config.num_layers):
        pattern = attention_pattern(model, ids, layer)
        if model.config.layer_window[layer]:
            assert outside_window(pattern, WINDOW) == 0
        assert np.allclose(ent[layer], row_entropy(pattern).mean(-1).numpy(), atol=1e-4), layer


def test_activations_page_shows_expert_routing(page, mixtral):
    model, folder, run = mixtral
    at = page("activations", run, model, str(folder)).run()
    assert not at.exception, at.exception
    routing = ex.expert_routing(model, run.ids)
    T, k, E = len(run.ids), model.config.experts_per_token, model.config.num_experts
    assert routing.layers == (0, 1, 2, 3) and routing.gates.shape == (4, T, E)
    assert torch.all(routing.gates.ne(0).sum(-1) == k)                   # every token went to exactly k experts
    load = find_df(at, "layer", "expert", "tokens", "share")
    assert (load.groupby("layer")["tokens"].sum() == T * k).all()
    assert list(load["tokens"]) == ex.expert_load(routing)["tokens"].tolist()
    table = find_df(at, "position", "expert", "rank", "gate", "router_prob")
    assert len(table) == T * k and set(table["layer"]) == {0}
    top = table[table["rank"] == 0].set_index("position")["expert"]
    assert list(top) == routing.gates[0].argmax(-1).tolist()
    gates = arr(chart(at, "act_moe_map")["data"][0]["z"]).astype(float)
    assert np.allclose(gates, routing.gates[0].numpy(), atol=1e-6)
    at.radio(key="act_moe_what").set_value("probs").run()
    probs = arr(chart(at, "act_moe_map")["data"][0]["z"]).astype(float)
    assert np.allclose(probs.sum(1), 1, atol=1e-5)
    # the gates are the router's top-k probabilities, renormalised (Mixtral)
    chosen = routing.gates[0].ne(0).numpy()
    p = probs * chosen
    assert np.allclose(p / p.sum(1, keepdims=True), routing.gates[0].numpy(), atol=1e-5)


def test_activations_page_has_no_experts_section_without_experts(page, gemma):
    model, folder, run = gemma
    at = page("activations", run, model, str(folder)).run()
    assert not at.exception
    assert not [e for e in at.get("plotly_chart") if e.key == "act_moe_load"]


def test_sampling_page_shows_the_logits_before_and_after_the_final_cap(page, gemma):
    model, folder, run = gemma
    cap = model.config.final_softcap
    at = page("sampling", run, model, str(folder)).run()
    assert not at.exception, at.exception
    step = len(run.result.steps) - 1
    at.number_input(key="smp_step").set_value(step).run()
    assert not at.exception, at.exception
    tbl = find_df(at, "uncapped", "capped", "bent")
    assert np.allclose(tbl["capped"], cap * np.tanh(tbl["uncapped"] / cap), atol=1e-5)
    # the capped logits are the ones the run sampled from at this step
    (logits,) = run.recording.captured("logits", step=step)
    assert np.allclose(tbl["capped"], logits.value[-1].double().numpy()[tbl["token_id"]], atol=1e-4)
    assert (tbl["bent"] > 0).all() and tbl["uncapped"].is_monotonic_decreasing
    fig = chart(at, "smp_softcap_fig")
    pts = [t for t in fig["data"] if t["name"] == "top tokens"][0]
    assert np.allclose(arr(pts["x"]), tbl["uncapped"]) and np.allclose(arr(pts["y"]), tbl["capped"])
    u, c = sc.capped_logits(model, run.ids, run.n_prompt - 1 + step)
    assert float(u.abs().max()) > float(c.abs().max())


PAGES = ["overview", "tokens", "attention", "activations", "kv_cache", "sampling", "timeline", "debugger", "compare",
         "nan_doctor", "repetition", "explain", "quantization", "trace_files"]


@pytest.mark.parametrize("family", ["gemma", "mixtral"])
def test_every_page_opens_on_a_family_run(page, family, request):
    model, folder, run = request.getfixturevalue(family)
    for name in PAGES:
        at = page(name, run, model, str(folder)).run()
        assert not at.exception, (name, at.exception)


def test_overview_says_what_the_family_changes(page, gemma, mixtral, tiny_model):
    from inspector.views.family import family_notes
    assert family_notes(tiny_model.config) == []                        # a plain Llama: nothing to say
    model, folder, run = gemma
    at = page("overview", run, model, str(folder)).run()
    assert not at.exception, at.exception
    text = " ".join(m.value for m in at.markdown)
    assert f"2 of 4 layers are local (sliding window of {WINDOW} positions)" in text
    assert f"soft-capped: {model.config.final_softcap:g} · tanh" in text and "experts" not in text
    model, folder, run = mixtral
    at = page("overview", run, model, str(folder)).run()
    assert not at.exception, at.exception
    text = " ".join(m.value for m in at.markdown)
    assert "4 of 4 layers are mixture-of-experts layers: each token goes to 2 of 4 experts" in text
    assert "sliding window" not in text and "soft-capped" not in text
