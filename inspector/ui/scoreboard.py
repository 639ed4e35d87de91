"""The quantization scoreboard section of the Quantization page (engine.tools.quant_scoreboard): llama.cpp's
--kl-divergence figures per GGUF format over texts (the built-in set, editable), computed on a button press in a
device slot with a progress bar and Stop (inspector.ui.common.on_demand), bounded to MAX_TOKENS tokens and
MAX_CHARS characters (checked here, on the server, before any model work), and kept in this session keyed by the
model and the choices."""
from __future__ import annotations

import streamlit as st
import torch

from engine import InputError
from engine.tools.quant import FORMATS
from engine.tools.quant_scoreboard import DEFAULT_FORMATS, FEW_TOKENS, PROMPTS, split_texts, text_ids
from engine.tools.quant_scoreboard import scoreboard as score_formats
from engine.variants import cast_model
from inspector.ui.common import on_demand, plain, was_stopped
from inspector.ui.state import session
from inspector.ui.widgets import checked_text
from inspector.views import scoreboard as sv

MAX_TOKENS = 1024        # the base's logits are kept while the formats run: tokens x vocab x 4 bytes (200 MB here)
MAX_CHARS = 20_000


def scoreboard_section(model) -> None:
    st.subheader("Scoreboard in llama.cpp's terms")
    st.caption("Each text read teacher-forced by the float32 model (the base) and by each format's quantized copy; "
               "every position but a text's last is scored: KL(p_base ‖ p_q), whether the top tokens agree, and Δp, "
               "the change in probability of the text's own next token — the figures `llama-perplexity "
               "--kl-divergence` prints, with its uncertainties (mean ± sd/√n; same top p ± √(p(1−p)/(n−1))). The "
               "texts are short, so early positions with little context are scored too (llama.cpp scores the "
               "second half of each 512-token chunk): hold the two side by side by format, not digit by digit.")
    c1, c2 = st.columns([3, 1])
    formats = c1.multiselect("Formats", list(FORMATS), default=list(DEFAULT_FORMATS), key="qsb_formats")
    embed = c2.checkbox("Quantize the embedding too", key="qsb_embed")
    box = st.text_area("Texts (a blank line between two)", "\n\n".join(PROMPTS), key="qsb_texts", height=220,
                       max_chars=MAX_CHARS)
    texts = split_texts(checked_text(box, MAX_CHARS, "the texts"))
    try:
        ids = text_ids(model, texts, max_tokens=MAX_TOKENS)
    except InputError as e:
        st.error(f"Cannot score these texts: {plain(e)}")
        return
    st.caption(f"{len(ids)} texts, {sum(len(x) for x in ids):,} tokens (at most {MAX_TOKENS:,} on this server).")
    store = session().memo("qsb_boards")
    key = (id(model), model.name, tuple(texts), tuple(formats), embed)

    def compute(progress):
        ref = model if model.dtype == torch.float32 else cast_model(model, "float32")
        return score_formats(ref, texts, formats, embed=embed, max_tokens=MAX_TOKENS, on_progress=progress)
    what = "the quantization scoreboard"
    if st.button("Score the formats", key="qsb_run", type="primary", disabled=not formats) \
            or (formats and was_stopped(what, key)):
        on_demand(store, key, what, compute, stop_on_error=False, max_entries=2)
    board = store.get(key)
    if board is None:
        return
    if board.count < FEW_TOKENS:
        st.caption(f"{board.count} scored positions: llama.cpp prints its statistics only from {FEW_TOKENS}.")
    st.dataframe(sv.summary_frame(board), key="qsb_summary", hide_index=True)
    for r in board.formats:
        st.markdown(f"**{r.format}** ({r.count} positions)")
        st.dataframe(sv.format_frame(board, r.format), key=f"qsb_table_{r.format}", hide_index=True)
