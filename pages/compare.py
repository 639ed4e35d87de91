"""Compare two runs of one prompt (the current run's or the sidebar's) with one seed: sampler settings, dtype
(another load of the model; for a GGUF file, the file as stored against its dequantised self), KV cache on/off, an
intervention. A token-aligned table, the first step where the
runs diverge, and how much every stage differs at that step; and a determinism check (inspector.ui.determinism_panel:
the same request alone, in a class's batch, on one thread, on the other path, compared bit for bit) and steering
(inspector.ui.steering_panel). Only the Compare, Check determinism and Steer buttons run the model; the rest is
display."""
import streamlit as st

from engine import EngineError, Probe, RunSettings, SamplingParams
from inspector.session.limits import LimitError
from inspector.session.model_choices import is_gguf
from inspector.session.models import shared_model
from inspector.session.run import check_settings
from inspector.ui.common import chosen_source, current_run, device_slot, get_model, plain, server_limits
from inspector.ui.determinism_panel import determinism_section
from inspector.ui.steering_panel import steering_section
from inspector.ui.frame import ensure_frame
from inspector.ui.state import session
from inspector.ui.widgets import chart, checked, checked_float, checked_text, sampling_form
from inspector.views import compare as cmp
from inspector.views.tokens import visible

MAX_RECOMPUTED_POSITIONS = 16_384     # KV cache off: positions computed over all steps, per configuration
MAX_ATTENTION_POSITIONS = 1_024       # attention maps: (heads, T, T) of one layer at a time
DTYPES = ["sidebar's", "float32", "bfloat16", "float16"]
STORED = "GGUF as stored"             # the sidebar's GGUF file with its matrices kept in blocks (CPU, float32)
IV_KINDS = ["none", "zero heads", "scale a stage"]
MAX_FIELD_CHARS = 200                 # heads or a stage glob, parsed and matched against every stage
MAX_FACTOR = 1e30
MAX_SEED = 2**31 - 1
s = st.session_state

st.header("Compare two runs")
ensure_frame()
model = get_model()
if model is None:
    st.stop()


def prompt_settings() -> RunSettings:
    """The prompt both runs continue, said on the page: the current run's (the run every other page shows, a
    trace file opened among them) where it is not the sidebar's, unless the user picks the sidebar's; otherwise
    the sidebar's. Only its text, chat format, system message and special-token switch are used, and its seed
    as the first seed offered."""
    sidebar = RunSettings(prompt=s.get("sb_prompt", "What is the capital of France?"),
                          chat=bool(s.get("sb_chat", True)), allow_special=bool(s.get("sb_allow_special", False)),
                          seed=s.get("sb_seed", 0))
    run = current_run()
    run = run.settings if run is not None else None
    if run is None or (run.prompt, run.chat, run.system) == (sidebar.prompt, sidebar.chat, None) or st.radio(
            "Prompt from", ["the current run", "the sidebar"], key="cmp_source", horizontal=True) == "the sidebar":
        st.caption(f"Prompt (from the sidebar): {plain(repr(sidebar.prompt)[:200])} · "
                   f"chat format {'on' if sidebar.chat else 'off'}")
        return sidebar
    st.caption(f"Prompt (from the current run, the one every other page shows; choose the sidebar to compare its "
               f"prompt instead): {plain(repr(run.prompt)[:200])} · chat format {'on' if run.chat else 'off'}")
    return run


base = prompt_settings()
prompt = base.prompt
limits = server_limits(show_error=False)
c1, c2 = st.columns(2)
max_new = int(c1.number_input("Max new tokens", 1, min(256, limits.max_new_tokens), min(16, limits.max_new_tokens),
                              key="cmp_max_new"))
seed0 = base.seed                    # the sidebar's as its widget holds it, or a file's: any value, checked here
seed0 = seed0 if type(seed0) is int and 0 <= seed0 <= MAX_SEED else 0
seed = checked(c2.number_input("Seed (both runs)", 0, MAX_SEED, seed0, key="cmp_seed"), 0, MAX_SEED, "Seed (both runs)")


def config_panel(k: str, temperature: float) -> cmp.RunConfig | None:
    """One run's configuration from its widgets (keys cmp_*_a / cmp_*_b)."""
    st.markdown(f"**Run {k.upper()}**")
    params = sampling_form(f"cmp_{k}", SamplingParams(temperature=temperature))
    c = st.columns(2)
    dtype = c[0].selectbox("Dtype", DTYPES + ([STORED] if is_gguf(chosen_source()) else []), key=f"cmp_dtype_{k}",
                           help="A dtype loads the sidebar's model again dequantised to it; for a GGUF file, "
                                f"{STORED!r} loads it with its matrices kept in the file's blocks.")
    cache = c[1].toggle("KV cache", True, key=f"cmp_cache_{k}", help="Off: the whole sequence is recomputed "
                        "with model.logits at every step")
    kind = st.selectbox("Intervention", IV_KINDS, key=f"cmp_iv_{k}")
    iv = None
    if kind == "zero heads":
        c = st.columns(3)
        last = model.config.num_layers - 1
        layer = checked(c[0].number_input("Layer", 0, last, 0, key=f"cmp_iv_layer_{k}"), 0, last, "Layer")
        stage = c[1].selectbox("Stage", ["attn.z", "attn.q", "attn.k", "attn.v"], key=f"cmp_iv_stage_{k}")
        heads = checked_text(c[2].text_input("Heads", "0", key=f"cmp_iv_heads_{k}", max_chars=MAX_FIELD_CHARS),
                             MAX_FIELD_CHARS, "Heads")
        try:
            iv = cmp.Intervention("zero_heads", f"blocks.{layer}.{stage}",
                                  tuple(int(h) for h in heads.replace(",", " ").split()))
        except ValueError:
            st.error(f"heads must be whole numbers separated by commas, got {plain(repr(heads))}")
            return None
    elif kind == "scale a stage":
        c = st.columns(2)
        stage = checked_text(c[0].text_input("Stages (glob)", "blocks.0.mlp.act", key=f"cmp_iv_pattern_{k}",
                                             max_chars=MAX_FIELD_CHARS), MAX_FIELD_CHARS, "Stages (glob)")
        factor = checked_float(c[1].number_input("Factor", value=0.5, key=f"cmp_iv_factor_{k}"), -MAX_FACTOR,
                               MAX_FACTOR, "Factor")
        iv = cmp.Intervention("scale", stage, factor=factor)
    if params is None:
        return None
    try:
        if iv is not None:
            iv.apply(model, Probe())                # validate the stage and heads now
    except EngineError as e:
        st.error(str(e))
        return None
    return cmp.RunConfig(label=k.upper(), params=params, dtype=dtype, cache=cache, intervention=iv)


cols = st.columns(2)
configs = []
for col, k, t in zip(cols, "ab", (0.0, 1.0)):
    with col.container(border=True):
        configs.append(config_panel(k, t))
attention_maps = st.toggle("Include attention scores/pattern in the stage differences (leaves the fused "
                           "attention path)", False, key="cmp_attn")


def model_for(dtype: str):
    """The sidebar's model, or the same source loaded in another dtype or, for a GGUF file, as stored (shared, cached
    like the sidebar's). dtype came from the browser: the registry refuses anything but a dtype (pick_dtype)."""
    stored = bool(model.weights.quantized())          # the sidebar's model is the GGUF file as stored
    if dtype == DTYPES[0] or (dtype == STORED and stored) or (
            not stored and dtype == str(model.dtype).removeprefix("torch.")):
        return model
    source = chosen_source()
    if dtype == STORED:
        if not is_gguf(source):
            raise EngineError(f"{STORED!r} needs a GGUF model in the sidebar")
        return shared_model(source, "cpu", "float32", quant="stored")
    return shared_model(source, model.device.type, dtype)


def checked_ids(cfg_a, cfg_b) -> list[int]:
    """The prompt's ids after the same server-side checks as a Run (the widgets' bounds are not a guard), and
    the comparison's own bounds: recomputing without a cache and attention maps cost O(positions²)."""
    ids = list(check_settings(model, RunSettings(prompt=prompt, chat=bool(base.chat), system=base.system,
                                                 allow_special=bool(base.allow_special), max_new_tokens=max_new,
                                                 params=cfg_a.params, seed=seed), limits).prompt_ids)
    n = len(ids) + max_new
    if not (cfg_a.cache and cfg_b.cache) and n * max_new > MAX_RECOMPUTED_POSITIONS:
        raise LimitError(f"KV cache off recomputes every position at every step: {len(ids):,} prompt tokens and "
                         f"{max_new} new tokens would be {n * max_new:,} positions; this page recomputes at most "
                         f"{MAX_RECOMPUTED_POSITIONS:,}. Use fewer tokens or keep the cache on.")
    if attention_maps and n > MAX_ATTENTION_POSITIONS:
        raise LimitError(f"attention maps in the comparison are limited to {MAX_ATTENTION_POSITIONS:,} positions "
                         f"(this run has {n:,}); turn them off or shorten the prompt")
    return ids


def progress(bar, label: str, half: int):
    """on_token for one configuration: the bar and its words after every token (a Streamlit call, so a press
    of Stop, which asks for a new script run, ends the comparison here)."""
    def on_token(step) -> None:
        k = step.index + 1
        bar.progress(min(1.0, (half + k / max_new) / 2), text=f"Configuration {label}: token {k} of at most "
                                                             f"{max_new}")
    return on_token


if s.get("cmp_stop"):
    st.warning("Comparison stopped: nothing of it was kept. Press **Compare** to run it again.")
if st.button("Compare", key="cmp_run", type="primary", disabled=None in configs):
    cfg_a, cfg_b = configs
    try:
        ids = checked_ids(cfg_a, cfg_b)
        st.button("Stop the comparison", key="cmp_stop",
                  help="Ends it after the current token; the previous comparison stays on the page.")
        bar = st.progress(0.0, text="Waiting for the model…")
        with device_slot("the comparison"):
            ma, mb = model_for(cfg_a.dtype), model_for(cfg_b.dtype)
            ta = cmp.run_config(ma, ids, cfg_a, max_new_tokens=max_new, seed=seed, on_token=progress(bar, "A", 0))
            tb = cmp.run_config(mb, ids, cfg_b, max_new_tokens=max_new, seed=seed, on_token=progress(bar, "B", 1))
            bar.progress(1.0, text="Finding where they part…")
            d = cmp.first_divergence(ta.token_ids, tb.token_ids)
            at = d if d is not None and d < min(len(ta.token_ids), len(tb.token_ids)) else None
            diff = None if at is None else cmp.divergence_stages(ma, cfg_a, mb, cfg_b, ids, ta.token_ids, at,
                                                                 attention_maps=attention_maps)
    except EngineError as e:
        st.error(str(e))
        st.stop()
    bar.empty()
    session().compared = dict(a=ta, b=tb, cfg_a=cfg_a, cfg_b=cfg_b, divergence=d, diff_step=at, diff=diff,
                     names=(ma.name, str(ma.dtype), mb.name, str(mb.dtype)))

with st.expander("Determinism: thirty students, T = 0 — thirty identical answers?",
                 expanded=bool(s.get("det_run")) or session().determinism is not None):
    determinism_section(model, RunSettings(prompt=prompt, chat=bool(base.chat), system=base.system,
                                           allow_special=bool(base.allow_special), seed=seed), limits)

with st.expander("Steering: add a direction to the residual stream",
                 expanded=bool(s.get("steer_run")) or session().steered is not None):
    steering_section(model, RunSettings(prompt=prompt, chat=bool(base.chat), system=base.system,
                                        allow_special=bool(base.allow_special), seed=seed), limits)

res = session().compared
if res is None:
    st.info("Choose two configurations and press **Compare**.")
    st.stop()
tok = model.tokenizer
ta, tb, d = res["a"], res["b"], res["divergence"]
na, da, nb, db = res["names"]
st.caption(f"{res['cfg_a'].describe()} ({na}, {da.removeprefix('torch.')}, {cmp.seconds(ta):.2f} s) — "
           f"{res['cfg_b'].describe()} ({nb}, {db.removeprefix('torch.')}, {cmp.seconds(tb):.2f} s)")
m = st.columns(3)
m[0].metric("First divergence", "none" if d is None else f"step {d}")
m[1].metric("Tokens A / B", f"{len(ta.token_ids)} / {len(tb.token_ids)}")
m[2].metric("Same tokens", f"{sum(x == y for x, y in zip(ta.token_ids, tb.token_ids))}")
left, right = st.columns(2)
left.code(tok.decode(ta.token_ids) or "(nothing)", language=None, wrap_lines=True)
right.code(tok.decode(tb.token_ids) or "(nothing)", language=None, wrap_lines=True)

table = cmp.aligned_table(ta, tb, lambda i: visible(tok.decode([i])))
st.subheader("Token by token")
shown = table
if d is not None and len(cmp.from_divergence(table, d)) < len(table):
    every = st.toggle(f"Show steps 0–{d - 3} too (the same in both runs)", False, key="cmp_all_steps")
    shown = table if every else cmp.from_divergence(table, d)
    if not every:
        st.caption(f"The table opens at the first divergence, step {d}, with the two steps before it.")
st.dataframe(shown, hide_index=True, key="cmp_table",
             column_config={"prob_a": st.column_config.NumberColumn(format="%.4f"),
                            "prob_b": st.column_config.NumberColumn(format="%.4f")})
chart(cmp.tokens_figure(table), key="cmp_tokens_fig")

st.subheader("Stages at the divergence step")
if res["diff"] is None:
    st.info("The runs chose the same tokens" + ("" if d is None else " until one of them ended") +
            ": there is no step where both chose and differ.")
    st.stop()
diff = res["diff"]
first = cmp.first_differing_stage(diff)
st.caption(f"Both configurations replayed over the prompt and the {res['diff_step']} tokens they share, each its "
           f"own way (cache on: prefill then one token at a time; off: one full forward), every stage captured at "
           f"the position whose logits chose step {res['diff_step']}'s token. Relative error ||B − A|| / ||A||; "
           f"first stage above 1e-6: **{first or 'none'}**.")
chart(cmp.differences_figure(diff), key="cmp_diff_fig")
st.dataframe(diff, hide_index=True, key="cmp_diff",
             column_config={"rel_error": st.column_config.NumberColumn(format="%.3e"),
                            "max_abs_diff": st.column_config.NumberColumn(format="%.3e")})
