"""Polls in a room: a student's answer mapped to one token, and the class's answers set against the model's
distribution at the poll's step under the room's sampling settings (computed from the logits the run
captured: no model call). Nothing here knows Streamlit."""
from __future__ import annotations

import unicodedata
from typing import Callable

import pandas as pd
import torch

from engine import SamplingParams
from engine.sampling import sampler_chain
from inspector.views.sampling import step_context, step_logits

from .rooms_state import MAX_ANSWER_CHARS, RoomError


def answer_token(encode: Callable[[str], list[int]], text, candidates: dict[int, str]) -> int:
    """The token a typed answer stands for: a candidate whose text it spells (spaces aside), else the first
    token of the answer as it would follow a word (with a leading space). RoomError for an empty, too long
    or control-character answer."""
    if not isinstance(text, str) or not text.strip():
        raise RoomError("type a word or a few characters")
    if len(text) > MAX_ANSWER_CHARS:
        raise RoomError(f"an answer is at most {MAX_ANSWER_CHARS} characters")
    if any(unicodedata.category(c) in ("Cc", "Cs") for c in text):
        raise RoomError("an answer cannot hold control characters")
    want = text.strip()
    for token_id, spelled in candidates.items():
        if spelled.strip() == want:
            return token_id
    ids = encode(" " + want)
    if not ids:
        raise RoomError("that answer has no token")
    return int(ids[0])


def model_probs(run, step: int, params: SamplingParams) -> torch.Tensor | None:
    """The sampling distribution (V,) at `step` under params, from the run's captured logits; None when the run
    kept no logits for that step."""
    try:
        logits = step_logits(run.recording, step)
    except (KeyError, AttributeError, IndexError):
        return None
    context, generated = step_context(run.result, step)
    return sampler_chain(logits, params, context, generated)["sampler.probs"]


def poll_table(tally: dict[int, int], probs: torch.Tensor | None, text_of: Callable[[int], str],
               top_n: int = 8) -> pd.DataFrame:
    """One row per token that the class answered or that is among the model's top_n: its text, the share and
    count of the class's answers, the model's probability. Sorted by the model's probability, then the class's."""
    total = sum(tally.values())
    ids = set(tally)
    if probs is not None:
        k = min(top_n, int((probs > 0).sum()))
        ids |= set(torch.topk(probs, max(1, k)).indices.tolist()) if k else set()
    rows = []
    for i in ids:
        p = float(probs[i]) if probs is not None and 0 <= i < probs.numel() else float("nan")
        rows.append({"token": text_of(i), "id": i, "answers": tally.get(i, 0),
                     "class_share": tally.get(i, 0) / total if total else 0.0, "model_prob": p})
    df = pd.DataFrame(rows, columns=["token", "id", "answers", "class_share", "model_prob"])
    return df.sort_values(["model_prob", "answers"], ascending=False, na_position="last").reset_index(drop=True)
