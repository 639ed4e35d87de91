"""Tables and labels for the Debugger page: a step's candidates, the sampler settings in force per step,
and a token breakpoint's ids from what the user typed."""
from __future__ import annotations

from dataclasses import asdict

import pandas as pd

from engine import InputError, SamplingParams, Step
from engine.tools.breakpoints import TokenIs

from .tokens import bytes_label, visible


def candidates_table(step: Step, tok=None) -> pd.DataFrame:
    """The step's top candidates under the raw model distribution; the chosen token is flagged (and added
    at the end when the sampler chose one outside the top)."""
    def label(i: int, text: str) -> str:
        return visible(bytes_label(tok.token_bytes(i)) if tok is not None else text)
    rows = [{"rank": r + 1, "id": c.id, "token": label(c.id, c.text), "model_prob": c.prob,
             "chosen": c.id == step.token_id} for r, c in enumerate(step.top)]
    if not any(r["chosen"] for r in rows):
        rows.append({"rank": None, "id": step.token_id, "token": label(step.token_id, step.text),
                     "model_prob": step.model_prob, "chosen": True})
    return pd.DataFrame(rows, columns=["rank", "id", "token", "model_prob", "chosen"])


def params_table(log: list[tuple[int, SamplingParams]]) -> pd.DataFrame:
    """One row per change of the sampler settings: from which step on, and the settings."""
    return pd.DataFrame([{"from_step": s, **asdict(p)} for s, p in log])


def describe_step(step: Step, tok=None) -> str:
    text = visible(bytes_label(tok.token_bytes(step.token_id)) if tok is not None else step.text)
    return (f"step {step.index}: {text!r} (id {step.token_id}) p={step.prob:.4f} "
            f"model p={step.model_prob:.4f} entropy {step.entropy:.3f} nats")


def token_ids_for(tok, text: str, vocab_size: int | None = None) -> tuple[int, ...]:
    """A token breakpoint's ids from what the user typed: ids ('7042' or '7042, 13') or text of one token."""
    parts = [p.strip() for p in text.split(",")]
    if parts and all(p.isdigit() for p in parts):
        ids = tuple(int(p) for p in parts)
        if vocab_size is not None and max(ids) >= vocab_size:
            raise InputError(f"token id {max(ids)} is outside the vocabulary [0, {vocab_size})")
        return ids
    if not text:
        raise InputError("enter a token's text (' Paris') or its id")
    ids = tok.encode(text)
    if len(ids) != 1:
        raise InputError(f"{text!r} is {len(ids)} tokens {ids}; a token breakpoint needs one token "
                         "(mind the leading space: ' Paris') or its id")
    return (ids[0],)


def token_breakpoint(tok, text: str, vocab_size: int | None = None) -> TokenIs:
    """The token breakpoint for what the user typed, named by its tokens' texts (not "token id in [7042]")."""
    ids = token_ids_for(tok, text, vocab_size)
    return TokenIs(ids, texts=tuple(tok.decode([i]) for i in ids))
