"""Tokens: the prompt and the generated text as token spans, a token table, counts, the chat template, and
how the streaming detokenizer assembles multi-byte characters. Nothing here runs the model."""
import streamlit as st

from engine import InputError
from inspector.session.limits import LimitError, check_text, cut_text
from inspector.ui.common import get_model, plain, require_run, server_limits
from inspector.ui.frame import ensure_frame
from inspector.views.tokens import chat_messages, run_token_table, spans_html, stream_table, token_counts

ensure_frame()         # opened alone (a fresh server): into app.py's frame, once per script run

MAX_SAMPLE_CHARS = 2_000      # "Try any text": one row per token in the table below

st.header("Tokens")
run = require_run()
model = get_model()
if model is None or model.name != run.model_name:
    st.warning(f"This run was made with **{plain(run.model_name)}**; choose that model in the sidebar (or press Run "
               "again) to see its tokens.")
    st.stop()
tok, res = model.tokenizer, run.result
table = run_token_table(tok, res.prompt_ids, res.token_ids)

cols = st.columns(2)
for col, part, ids in ((cols[0], "Prompt", res.prompt_ids), (cols[1], "Generated", res.token_ids)):
    n = token_counts(tok, ids)
    with col:
        st.subheader(part)
        m = st.columns(4)
        m[0].metric("Characters", n["characters"])
        m[1].metric("Tokens", n["tokens"])
        m[2].metric("Bytes / token", f"{n['bytes_per_token']:.2f}")
        m[3].metric("Special tokens", n["special"])

st.caption("Hover a token for its position, id, text (· space, ⏎ newline, → tab), bytes and character offsets. "
           "Dark: special tokens; underlined: generated; ‹f0›: a byte that is only part of a UTF-8 character.")
st.markdown("**Prompt tokens**")
st.html(spans_html(table[table["part"] == "prompt"]))
st.markdown("**Generated tokens**")
st.html(spans_html(table[table["part"] == "generated"]))

st.subheader("Token table")
st.caption("start/end: character offsets within the prompt's or the generated text's own text.")
st.dataframe(table, key="tok_table", hide_index=True)

st.subheader("Chat template")
limits = server_limits(show_error=False)
if run.settings.chat and tok.chat_template:
    # A reopened trace's prompt and system message are whatever its file holds: cut to this server's prompt
    # limit before anything tokenizes them (the tokenizer holds the GIL: every session would wait).
    prompt, cut = cut_text(run.settings.prompt, limits.max_prompt_chars)
    system, cut_system = (None, None) if run.settings.system is None else \
        cut_text(run.settings.system, limits.max_prompt_chars)
    for what, note in (("prompt", cut), ("system message", cut_system)):
        if note:
            st.warning(f"The run's {what}: {note}. The template below is drawn from what is shown.")
    messages = chat_messages(prompt, system)
    rendered = tok.render_chat(messages)
    plain = tok.encode(prompt)
    st.caption(f"The template wraps the {len(plain)} tokens of your prompt into {len(res.prompt_ids)} tokens "
               f"({len(res.prompt_ids) - len(plain)} added by the template); they are the prompt tokens above.")
    st.code(rendered.replace("\n", "⏎\n"), language=None, wrap_lines=True)   # ⏎: each newline, the last too
    with st.expander("Messages passed to the template"):
        st.json(messages)
else:
    st.caption("Chat format was off for this run: the prompt was tokenized as plain text.")

st.subheader("Streaming detokenizer")
st.caption("A token can end in the middle of a UTF-8 character (emoji, CJK). The streaming decoder emits '' "
           "until the character is complete, then the whole character.")
st.markdown("**This run's generated tokens**")
fed = res.token_ids[:-1] if res.stop_reason == "eos" else res.token_ids    # generation never decodes the EOS
st.dataframe(stream_table(tok, fed), key="tok_stream_run", hide_index=True)
most = min(MAX_SAMPLE_CHARS, limits.max_prompt_chars)
sample = st.text_input("Try any text", "héllo 👋 世界", key="tok_stream_text", max_chars=most)
try:        # checked here too, before any tokenizing: a forged message is not held to the widget's max_chars
    if isinstance(sample, str) and len(sample) > most:
        raise LimitError(f"the text is {len(sample):,} characters long; this box takes at most {most:,}")
    sample, notes = check_text(sample, limits, "text", allow_empty=True)
except InputError as e:
    st.error(str(e))
else:
    for note in notes:
        st.info(note)
    if sample:
        st.dataframe(stream_table(tok, tok.encode(sample)), key="tok_stream_sample", hide_index=True)
