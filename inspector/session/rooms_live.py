"""A teacher's run while it generates, carried to the room's students (issue 23, item 1): the prompt, the
prefill's progress, the text so far and the newest token with its probability and the model's top
candidates; then, when the run ends, the whole run as any published run (RoomStore.publish).

A run is live while the room holds its live document: it appears when the run starts and goes when the full
run is published (in the same transaction as the room's new version) or when it ends with nothing to show. A
run changes the room's state version once, when it is published whole. What changes with every token is that
one small document (`Live`, UTF-8 JSON of at most MAX_LIVE_BYTES, its text cut to the last
MAX_TEXT_CHARS characters, five candidates of at most MAX_TOKEN_CHARS each) under a counter the room's watcher
reads (inspector.ui.room_push): a student's screen redraws only its live panel when it moves.

`LivePublisher` is what the teacher's LiveRun calls from its generating thread, for every progress record and
token: it publishes at most every `every_s` seconds (and always at a change of phase and at the end), and a
store that fails never reaches the engine: the run goes on, and the next publish tries again. Nothing here
knows Streamlit."""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass, replace

from .rooms_state import ROOM_ERRORS, RoomError, check_int

PHASES = ("queued", "prefill", "decode", "done", "stopped", "failed")
MAX_TEXT_CHARS = 2_000
MAX_PROMPT_CHARS = 1_000
MAX_TOKEN_CHARS = 32
MAX_TOP = 5
# What is shown is bounded in characters (above); the document's bytes follow from them: written as UTF-8 JSON
# (not ASCII-escaped), a character takes at most 6 bytes (a control character's \u00XX; Chinese 3, an emoji 4),
# plus the keys and numbers. Chinese or emoji text fills the same 2,000 characters as English.
SHOWN_CHARS = MAX_PROMPT_CHARS + MAX_TEXT_CHARS + (1 + MAX_TOP) * MAX_TOKEN_CHARS
MAX_LIVE_BYTES = 6 * SHOWN_CHARS + 1024
PUBLISH_EVERY_S = 0.15
log = logging.getLogger("llm_inspector")


def _text(v, limit: int, what: str) -> str:
    if not isinstance(v, str) or len(v) > limit:
        raise RoomError(f"the live run's {what} must be text of at most {limit} characters")
    return v


def _prob(v, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.0 <= v <= 1.0 or math.isnan(v)):
        raise RoomError(f"the live run's {what} must be a probability")
    return float(v)


@dataclass(frozen=True)
class LiveToken:
    """The newest token: its text, its sampling probability, the model's top candidates (text, probability)."""
    text: str
    prob: float
    top: tuple[tuple[str, float], ...] = ()

    def as_dict(self) -> dict:
        return {"text": self.text, "prob": self.prob, "top": [list(c) for c in self.top]}

    @classmethod
    def from_dict(cls, d) -> "LiveToken":
        if not isinstance(d, dict) or not isinstance(d.get("top", []), list) or len(d.get("top", [])) > MAX_TOP:
            raise RoomError(f"the live run's token must be an object with at most {MAX_TOP} candidates")
        top = []
        for c in d.get("top", []):
            if not isinstance(c, list) or len(c) != 2:
                raise RoomError("a live candidate is [text, probability]")
            top.append((_text(c[0], MAX_TOKEN_CHARS, "candidate"), _prob(c[1], "candidate probability")))
        return cls(_text(d.get("text"), MAX_TOKEN_CHARS, "token"), _prob(d.get("prob"), "token probability"),
                   tuple(top))


@dataclass(frozen=True)
class Live:
    """The teacher's run as it generates."""
    seq: int                         # its number in the room (counted by the room's liveseq)
    prompt: str
    max_new: int
    phase: str = "queued"
    prefill: float = 0.0             # the prefill's fraction done
    tokens: int = 0
    text: str = ""                   # the last MAX_TEXT_CHARS characters generated
    last: LiveToken | None = None

    def as_json(self) -> bytes:
        return json.dumps({"seq": self.seq, "prompt": self.prompt, "max_new": self.max_new, "phase": self.phase,
                           "prefill": self.prefill, "tokens": self.tokens, "text": self.text,
                           "last": None if self.last is None else self.last.as_dict()},
                          ensure_ascii=False).encode("utf-8", "replace")      # a lone surrogate becomes ?

    @classmethod
    def from_json(cls, data: bytes) -> "Live":
        if not isinstance(data, bytes) or len(data) > MAX_LIVE_BYTES:
            raise RoomError(f"the live run's document is at most {MAX_LIVE_BYTES} bytes")
        try:
            d = json.loads(data)
        except (ValueError, RecursionError):
            raise RoomError("the live run's document is not valid JSON") from None
        if not isinstance(d, dict) or d.get("phase") not in PHASES:
            raise RoomError("the live run's document has no known phase")
        return cls(seq=check_int(d.get("seq"), 1, 1 << 62, "live run"),
                   prompt=_text(d.get("prompt"), MAX_PROMPT_CHARS, "prompt"),
                   max_new=check_int(d.get("max_new"), 0, 1 << 20, "max new tokens"), phase=d["phase"],
                   prefill=_prob(d.get("prefill"), "prefill fraction"),
                   tokens=check_int(d.get("tokens"), 0, 1 << 20, "token count"),
                   text=_text(d.get("text"), MAX_TEXT_CHARS, "text"),
                   last=None if d.get("last") is None else LiveToken.from_dict(d["last"]))


def cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def live_token(step) -> LiveToken:
    """The room's copy of an engine Step: its text and probability, the top MAX_TOP candidates, each cut."""
    return LiveToken(cut(step.text, MAX_TOKEN_CHARS), float(step.prob),
                     tuple((cut(c.text, MAX_TOKEN_CHARS), float(c.prob)) for c in step.top[:MAX_TOP]))


class LivePublisher:
    """Publishes a LiveRun to its room as it generates (called in the run's thread; see the module's text).
    publish(live_doc) is the store call (RoomStore.publish_live with the room and token bound); end(seq) says
    that the run ended without a run to show (RoomStore.end_live)."""

    def __init__(self, seq: int, prompt: str, max_new: int, publish, end, every_s: float = PUBLISH_EVERY_S,
                 clock=time.monotonic) -> None:
        self.doc = Live(seq, cut(prompt, MAX_PROMPT_CHARS), max_new)
        self.publish, self.end, self.every_s, self.clock = publish, end, every_s, clock
        self._text, self._sent_at, self._lock = "", -math.inf, threading.Lock()
        self.failures = 0

    def progress(self, fraction: float) -> None:
        self._update(phase="prefill", prefill=min(1.0, max(0.0, float(fraction))))

    def token(self, step) -> None:
        self._text = (self._text + step.text)[-MAX_TEXT_CHARS:]
        self._update(phase="decode", prefill=1.0, tokens=self.doc.tokens + 1, text=self._text,
                     last=live_token(step))

    def finished(self, kept: bool, stopped: bool) -> None:
        """The run ended: kept (its full run follows through RoomStore.publish) or not (failed, or stopped
        before its first token: the room goes back to the run it showed)."""
        phase = ("stopped" if stopped else "done") if kept else "failed"
        self._update(phase=phase, force=True)
        if not kept:
            self._call(self.end, self.doc.seq)

    def _update(self, force: bool = False, **changes) -> None:
        with self._lock:
            before = self.doc.phase
            self.doc = replace(self.doc, **changes)
            now = self.clock()
            if not force and self.doc.phase == before and now - self._sent_at < self.every_s:
                return
            self._sent_at = now
            doc = self.doc
        self._call(self.publish, doc)

    def _call(self, f, arg) -> None:
        try:
            f(arg)
        except ROOM_ERRORS as e:       # the store is down or the room ended: the run goes on regardless
            self.failures += 1
            log.debug("live publish failed: %s", e)
