"""Server limits (one dataclass read from environment variables) and the checks a prompt passes before the
engine sees it.

A limit keeps one user from taking the machine from the others: a classroom server sets them lower than a
laptop does. Every limit has an environment variable, a default and a one-line meaning (`LIMITS` below);
docs/CLASSROOM.md lists the same table. Nothing here knows Streamlit.

Prompt policy (`check_text`), applied to the prompt and the system message alike:
* not text, empty or only whitespace -> refused;
* longer than `max_prompt_chars` characters -> refused before anything is tokenized;
* lone surrogates (U+D800-U+DFFF: not valid Unicode, e.g. bytes decoded with errors='surrogateescape')
  -> each replaced with U+FFFD, and the run says so;
* control characters other than tab, newline and carriage return (the rest of C0, DEL, C1) -> refused,
  naming the character and where it is: they are almost always pasted by accident, several of them have
  no token in common vocabularies (SmolLM2 silently drops six), and they are invisible in the app.
"""
from __future__ import annotations

import math
import os
import re
import unicodedata
from dataclasses import dataclass, fields
from typing import Mapping

from engine import InputError
from engine.inspection.trace_check import TraceBounds

ENV_PREFIX = "LLM_INSPECTOR_"
ALLOWED_CONTROLS = "\t\n\r"
_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_CONTROL_NAMES = {0: "NUL", 0x1B: "ESC", 0x7F: "DEL", 0x85: "NEL", 0x0B: "vertical tab", 0x0C: "form feed"}


class LimitError(InputError):
    """A request over one of this server's limits (the message names the limit and its variable)."""


class PromptError(InputError):
    """A prompt (or system message) this app refuses to send to the engine."""


class LimitsConfigError(ValueError):
    """An LLM_INSPECTOR_* limit variable that is not a valid number."""


@dataclass(frozen=True)
class Limits:
    max_prompt_chars: int = 20_000       # characters, checked before tokenizing
    max_prompt_tokens: int = 4_096       # tokens of the prompt as the model sees it (chat template included)
    max_new_tokens: int = 1_024          # tokens one run may generate
    max_runs_kept: int = 3               # runs (with everything their probe captured) each session keeps
    max_concurrent_runs: int = 32        # generations on the device at the same time, all sessions together
    max_batch_rows: int = 32             # runs whose decode steps share one forward (1: each alone, exact)
    max_runs_mb: int = 0                 # memory the runs generating at once may hold together (0: half available)
    max_queue: int = 32                  # runs that may wait for a slot; one more gets "server busy"
    queue_timeout_s: float = 600.0       # longest wait in the queue before giving up with "server busy"
    max_models: int = 4                  # (model, device, dtype) combinations loaded at once in this process
    max_running_per_client: int = 1      # runs one browser (all its tabs) may have generating at once
    max_queued_per_client: int = 1       # runs one browser may have waiting in the queue
    max_session_mb: int = 400            # memory one browser session may keep (runs, maps, traces, reports)
    max_sessions_per_client: int = 8     # sessions (tabs) one browser may hold open on this server at once
    max_sessions: int = 100              # sessions on this server, every browser and script together

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            low = 0 if f.name in ("max_queue", "max_runs_mb") else 1
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < low:
                raise LimitsConfigError(f"{env_name(f.name)} must be a number >= {low}, got {v!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Limits":
        """Limits from LLM_INSPECTOR_MAX_* variables (unset or empty: the default)."""
        env = os.environ if env is None else env
        values = {}
        for f in fields(cls):
            raw = env.get(env_name(f.name), "").strip().replace("_", "")
            if not raw:
                continue
            try:
                values[f.name] = float(raw) if f.type == "float" else int(raw)
            except ValueError:
                kind = "a number" if f.type == "float" else "a whole number"
                raise LimitsConfigError(f"{env_name(f.name)} must be {kind}, got {raw!r}") from None
        return cls(**values)

    def table(self) -> list[tuple[str, str, str, str]]:
        """(variable, value, default, meaning) for each limit: for the docs and the app."""
        default = Limits()
        return [(env_name(name), _fmt(getattr(self, name)), _fmt(getattr(default, name)), meaning)
                for name, meaning in LIMITS.items()]


LIMITS = {
    "max_prompt_chars": "longest prompt (and system message) in characters; checked before tokenizing",
    "max_prompt_tokens": "longest prompt in tokens, as the model sees it (chat template included)",
    "max_new_tokens": "most tokens one run may generate (also the sidebar's maximum)",
    "max_runs_kept": "runs each browser session keeps, with everything their probe captured; older runs "
                     "and what pages derived from them are dropped",
    "max_concurrent_runs": "generations running on the device at the same time, over all sessions (their decode "
                           "steps batched: see max_batch_rows)",
    "max_batch_rows": "runs whose decode steps share one forward (each run's row, cache, probe and sampler its own; "
                      "1: every run decodes alone, its arithmetic bit for bit that of a run alone)",
    "max_runs_mb": "memory (MiB) the runs generating at once may hold together, each its KV cache and its probe's "
                   "recording at the length it asked for; a run that would pass it waits in the queue (0: half the "
                   "memory available when the first run asked; a run alone is always admitted)",
    "max_queue": "runs that may wait for a free slot (each user sees their place); one more is told the "
                 "server is busy",
    "queue_timeout_s": "seconds a run may wait in the queue before it gives up with 'server busy'",
    "max_models": "(model, device, dtype) combinations this process keeps loaded, low-precision copies "
                  "included; one more unloads the least recently used one that no session has chosen, and is "
                  "refused (saying how many sessions hold them) only while every one is in use",
    "max_running_per_client": "runs one browser (all its tabs together) may have generating at once",
    "max_queued_per_client": "runs one browser may have waiting in the queue; one more is refused",
    "max_session_mb": "MiB one browser session may keep (runs, attention maps, traces, uploads, reports); "
                      "past it the oldest derived data is dropped, and the user told",
    "max_sessions_per_client": "sessions (tabs, kept about two minutes after they close) one browser may hold on "
                               "this server; one more is told to close a tab and holds nothing",
    "max_sessions": "sessions on this server, every browser and every connection without a browser cookie "
                    "together; one more is told to try later and holds nothing",
}


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:,}"


def describe_char(c: str) -> str:
    """'U+001B (ESC)' for the error messages."""
    name = _CONTROL_NAMES.get(ord(c)) or unicodedata.name(c, "")
    return f"U+{ord(c):04X}" + (f" ({name})" if name else "")


def check_text(text: object, limits: Limits, what: str = "prompt", *, allow_empty: bool = False
               ) -> tuple[str, list[str]]:
    """The text to send to the engine and notes for the user, or PromptError/LimitError saying what is wrong."""
    if not isinstance(text, str):
        raise PromptError(f"the {what} must be text, got {type(text).__name__}")
    if len(text) > limits.max_prompt_chars:
        raise LimitError(f"the {what} is {len(text):,} characters long; this server accepts at most "
                         f"{limits.max_prompt_chars:,} ({env_name('max_prompt_chars')})")
    notes = []
    surrogates = _SURROGATE.findall(text)
    if surrogates:
        text = _SURROGATE.sub("\ufffd", text)
        notes.append(f"The {what} contained {len(surrogates)} lone surrogate code point"
                     f"{'s' if len(surrogates) > 1 else ''} (not valid Unicode, first {describe_char(surrogates[0])}); "
                     "each was replaced with U+FFFD (�).")
    if m := _CONTROL.search(text):
        count = len(_CONTROL.findall(text))
        raise PromptError(f"the {what} contains the control character {describe_char(m.group())} at character "
                          f"{m.start() + 1:,}" + (f" ({count} control characters in all)" if count > 1 else "")
                          + "; only tab, newline and carriage return are allowed. Remove it and run again.")
    if not allow_empty and not text.strip():
        raise PromptError(f"the {what} is empty" + (" (only whitespace)" if text else ""))
    return text, notes


def check_run_positions(ids, model, limits: Limits) -> None:
    """A run's token ids before a page runs the model over them again (attention maps, the logit lens, copy
    attention): at most a prompt's and a generation's worth of positions, each id in the vocabulary."""
    n, most = len(ids), limits.max_prompt_tokens + limits.max_new_tokens
    if n > min(most, model.context_length):
        raise LimitError(f"this run has {n:,} positions; this server runs the model over at most "
                         f"{min(most, model.context_length):,} ({env_name('max_prompt_tokens')} + "
                         f"{env_name('max_new_tokens')})")
    if n and not 0 <= min(ids) <= max(ids) < model.config.vocab_size:
        raise LimitError(f"this run holds token ids outside the model's vocabulary [0, {model.config.vocab_size:,})")


def check_int(value: object, lo: int, hi: int, what: str) -> int:
    """A whole number a browser sent for a widget, within the widget's own bounds [lo, hi] (a forged message can
    carry any value; the page must not rely on the widget's clamp); LimitError naming the setting otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):      # (its type only: the value is a
        raise LimitError(f"{what} must be a whole number, got {_kind(value)}")   # browser's, shown as Markdown)
    if not float(value).is_integer():
        raise LimitError(f"{what} must be a whole number, got {value!r}")
    if not lo <= value <= hi:
        raise LimitError(f"{what} must be between {lo:,} and {hi:,}, got {int(value):,}")
    return int(value)


def check_float(value: object, lo: float, hi: float, what: str) -> float:
    """A number a browser sent for a widget, finite and within [lo, hi] (check_int's twin for real values)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LimitError(f"{what} must be a number, got {_kind(value)}")
    if math.isnan(value):
        raise LimitError(f"{what} must be a number, got NaN")
    if not lo <= value <= hi:
        raise LimitError(f"{what} must be between {lo:g} and {hi:g}, got {value:g}")
    return float(value)


def _kind(value: object) -> str:
    return {str: "text", bool: "true/false", type(None): "nothing"}.get(type(value), type(value).__name__)


def check_chars(value: object, most: int, what: str) -> str:
    """Text a browser sent for a short field (a stage glob, a token, injections), at most `most` characters,
    checked before anything parses or tokenizes it: a widget's max_chars binds only an honest browser."""
    if not isinstance(value, str):
        raise LimitError(f"{what} must be text, got {_kind(value)}")
    if len(value) > most:
        raise LimitError(f"{what} is {len(value):,} characters long; this field takes at most {most:,}")
    return value


def cut_text(value: object, most: int) -> tuple[str, str | None]:
    """Text from a file or a store to show (and tokenize) on a page: at most `most` characters, and a note
    saying what was cut (None when nothing was). Anything that is not text is shown as its repr, cut alike."""
    text = value if isinstance(value, str) else repr(value)
    note = None if isinstance(value, str) else f"it is not text ({type(value).__name__}); shown as written"
    if len(text) > most:
        cut = f"only its first {most:,} of {len(text):,} characters are shown ({env_name('max_prompt_chars')})"
        note = cut if note is None else f"{note}; {cut}"
        text = text[:most]
    return text, note


def trace_bounds(limits: Limits, model=None, max_bytes: int | None = None) -> TraceBounds:
    """What a trace file from anywhere may hold on this server: its prompt and new-token limits, the loaded
    model's vocabulary and layers, and (for an upload) the session's share of bytes."""
    extra = {} if max_bytes is None else {"max_bytes": max_bytes}
    return TraceBounds(max_prompt_chars=limits.max_prompt_chars, max_prompt_tokens=limits.max_prompt_tokens,
                       max_new_tokens=limits.max_new_tokens, vocab_size=model.config.vocab_size if model else None,
                       num_layers=model.config.num_layers if model else None, **extra)
