"""Overview: what went in, what came out, why it stopped, how long it took, and every step's choice."""
import streamlit as st

from inspector.views.tokens import steps_table, token_counts
from pages.common import get_model, require_run

st.header("Overview")
run = require_run()
res = run.result
model = get_model()
tok = model.tokenizer if model is not None and model.name == run.model_name else None

st.caption(f"Model **{run.model_name}** · {run.n_prompt} prompt tokens · {len(res.token_ids)} generated · "
           f"seed {res.seed} · chat format {'on' if run.settings.chat else 'off'}")

left, right = st.columns(2)
with left:
    st.subheader("Prompt (as the model saw it)")
    prompt = tok.decode(res.prompt_ids) if tok is not None else run.settings.prompt
    st.code(prompt.replace("\n", "⏎\n"), language=None, wrap_lines=True)      # ⏎: each newline, the last too
with right:
    st.subheader("Generated text")
    st.code(res.text or "(nothing)", language=None, wrap_lines=True)

t = res.timings
c = st.columns(6)
c[0].metric("Stop reason", res.stop_reason)
c[1].metric("Tokenize", f"{t.get('tokenize', 0) * 1e3:.1f} ms")
c[2].metric("Prefill", f"{t.get('prefill', 0) * 1e3:.0f} ms")
c[3].metric("Decode (total)", f"{t.get('decode', 0):.2f} s")
c[4].metric("Per decoded token", f"{t.get('per_token_decode', 0) * 1e3:.1f} ms")
c[5].metric("Run (with inspection)", f"{run.seconds:.2f} s")
if len(res.token_ids) > 1 and t.get("decode"):
    st.caption(f"Decode speed {(len(res.token_ids) - 1) / t['decode']:.1f} tokens/s · KV cache "
               f"{res.cache['bytes_used'] / 2**20:.2f} MiB used of {res.cache['bytes_allocated'] / 2**20:.2f} MiB")
if tok is not None:
    n = token_counts(tok, res.prompt_ids)
    st.caption(f"Prompt: {n['characters']} characters, {n['tokens']} tokens ({n['special']} special), "
               f"{n['bytes_per_token']:.2f} bytes per token")

st.subheader("Steps")
st.caption("prob: under the sampling distribution (after penalties, temperature, top-k/p, min-p); "
           "model prob and entropy (nats): the raw softmax; kept: tokens left with p > 0.")
st.dataframe(steps_table(res.steps, tok), key="ov_steps", hide_index=True,
             column_config={"prob": st.column_config.NumberColumn(format="%.4f"),
                            "model_prob": st.column_config.NumberColumn(format="%.4f"),
                            "entropy": st.column_config.NumberColumn(format="%.3f")})
