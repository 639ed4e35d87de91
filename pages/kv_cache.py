"""KV cache: what the run's cache costs, how it grew, what GQA saves, and projections for other models."""
import streamlit as st

from inspector.session.server_memory import server_memory, weights_text
from inspector.ui.common import plain, require_run_and_model, server_limits
from inspector.ui.frame import ensure_frame
from inspector.ui.widgets import chart, checked, metric_columns
from inspector.views import kv_cache as kv

ensure_frame()         # opened alone (a fresh server): into app.py's frame, once per script run

st.header("KV cache")
run, model = require_run_and_model()

cfg, cache = model.config, run.result.cache
shape = kv.KVShape.from_config(cfg)
bpe = cache["bytes_per_token"] // (2 * shape.layers * shape.kv_heads * shape.head_dim)
# the run's cache length and last position: taken where they give the engine's bytes (with every layer local and
# full, the bytes alone cannot tell a longer cache from a shorter one)
n_new = getattr(run.settings, "max_new_tokens", None)
hints = (min(run.n_prompt + n_new, model.context_length) if isinstance(n_new, int) else None,
         run.result.steps[-1].position if run.result.steps else None)
allocated, used = kv.run_positions(cache, shape, hints)
local = [w for w in shape.layer_windows if w is not None]
if local:
    st.caption(f"bytes = 2 (K and V) · {shape.kv_heads} KV heads · {shape.head_dim} head_dim · "
               f"({shape.layers - len(local)} global layers · positions + Σ over {len(local)} local layers of "
               f"min(positions, window)) · batch · {bpe} bytes per element")
else:
    st.caption(f"bytes = 2 (K and V) · {shape.layers} layers · {shape.kv_heads} KV heads · {shape.head_dim} head_dim · "
               f"positions · batch · {bpe} bytes per element")

c = metric_columns(5)
c[0].metric("Bytes per token", f"{cache['bytes_per_token']:,}")
c[1].metric("Allocated", kv.human_bytes(cache["bytes_allocated"]), f"{allocated:,} positions", delta_color="off")
c[2].metric("Used", kv.human_bytes(cache["bytes_used"]), f"{used:,} positions", delta_color="off")
c[3].metric("Used / allocated", f"{100 * used / max(1, allocated):.1f} %")
dtype_label = kv.dtype_name(model.dtype) if kv.bytes_per_element(model.dtype) == bpe else f"{bpe}-byte"
c[4].metric("Dtype", dtype_label, f"{bpe} B / element", delta_color="off")

st.subheader("The formula against the engine")
st.caption("`formula_bytes` from the formula above; `engine_bytes` is what the run's own KVCache reported "
           "(its bytes_per_token, bytes_allocated and bytes_used properties). A one-position "
           f"`model.new_cache(1)` made now says **{model.new_cache(1).bytes_per_token:,}** bytes per token.")
check = kv.formula_vs_engine(shape, bpe, cache, hints)
st.dataframe(check, hide_index=True, key="kv_check")
if not check["match"].all():
    st.error("The engine's cache size does not match the formula.")

layers = kv.per_layer_table(shape, bpe, allocated, used)
if local:
    st.subheader("Global and local (sliding-window) layers")
    st.caption("A global layer keeps every position. A local layer attends only to the last W positions, so its "
               "cache is a ring of W rows (position p in row p mod W): once the ring is full its memory stops "
               "growing. `next_token_bytes` is what one more position would add to each kind now.")
    kinds = kv.kind_table(layers, 2 * shape.kv_heads * shape.head_dim * bpe)
    st.dataframe(kinds, hide_index=True, key="kv_kinds")
    for row in kinds[kinds["kind"] != "global"].itertuples():
        w = int(row.window)
        state = "ring full: no longer growing" if not row.growing else f"{min(used, w):,} of {w:,} rows used"
        st.markdown(f"- **{row.kind}**: {row.layers} layers, {kv.human_bytes(row.used_bytes)} used of "
                    f"{kv.human_bytes(row.allocated_bytes)} allocated ({state})")

st.subheader("Growth across the run")
st.caption("After step 0 (prefill) the cache holds the prompt; each decode step writes one more position. "
           "The last chosen token is never written. The dashed line is what was preallocated."
           + (" The global layers' line keeps rising; the local layers' flattens at their window." if local else ""))
growth = kv.growth_table(run.result, shape)
chart(kv.growth_figure(growth), key="kv_growth")

st.subheader("Per layer")
chart(kv.per_layer_figure(layers), key="kv_layers")
with st.expander("Per-layer table"):
    st.dataframe(layers, hide_index=True, key="kv_layers_table")

st.subheader("Grouped-query attention")
st.caption(f"{cfg.num_heads} query heads share {cfg.num_kv_heads} KV heads ({cfg.kv_groups} per group). Full "
           f"multi-head attention would cache K and V for all {cfg.num_heads}: same formula, kv_heads = num_heads.")
st.dataframe(kv.gqa_table(shape, bpe, {"used": used, "allocated": allocated,
                                        "full context": model.context_length}), hide_index=True, key="kv_gqa")

st.subheader("Device memory")
cuda = kv.cuda_memory_table(model.device)
if cuda is None:
    st.info(f"The model is on **{model.device.type}**: torch's CUDA memory counters (memory_allocated, "
            "max_memory_allocated, memory_reserved) are shown only when it runs on a CUDA GPU.")
else:
    st.dataframe(cuda, hide_index=True, key="kv_cuda")

st.subheader("What this server holds")
by_dtype = model.weights.nbytes_by_dtype()
st.markdown(f"This model's weights: **{weights_text({kv.dtype_name(d): n for d, n in by_dtype.items()})}**; this "
            f"run's KV cache: **{kv.human_bytes(cache['bytes_allocated'])}** allocated.")
st.dataframe(kv.weights_table(by_dtype), hide_index=True, key="kv_weights")
st.caption(plain(server_memory(server_limits(show_error=False)).caption())
           + " A model that no session has chosen is unloaded when another is needed past the limit; a load is "
           "refused only while every model held is in use.")

st.subheader("Calculator")
c1, c2, c3 = st.columns(3)
contexts = c1.multiselect("Context lengths", [512, 1024, 2048, 4096, 8192, 16384, 32768, 131072],
                          default=[2048, 8192, 32768, 131072], key="kv_calc_contexts")
batch = checked(c2.number_input("Batch size", 1, 1024, 1, key="kv_calc_batch"), 1, 1024, "Batch size")
dtype = c3.selectbox("Dtype", list(kv.DTYPE_BYTES), index=2, key="kv_calc_dtype")
known = {**kv.KNOWN_MODELS, **kv.WINDOWED_MODELS}
names = st.multiselect("Models", ["this model", *known], default=["this model", *known], key="kv_calc_models")
shapes = {(f"{model.name} (this model)" if n == "this model" else n): (shape if n == "this model" else known[n])
          for n in names}
if contexts and shapes:
    proj = kv.projection_table(shapes, sorted(contexts), int(batch), dtype)
    chart(kv.projection_figure(proj), key="kv_calc_fig")
    st.caption("GiB of KV cache (K and V, all layers) per model and context length; a local (sliding-window) layer "
               "counts min(context, window) positions (Gemma 2: every other layer). Models whose caches are the "
               "same size share one line (the legend names them all).")
    st.dataframe(kv.projection_pivot(proj).style.format("{:,.3f}"), key="kv_calc_table")
else:
    st.info("Choose at least one model and one context length.")
