"""What a room holds (inspector.session.rooms keeps it): the view a teacher shows, the poll asked, the
room's state document with its version; and the checks every value passes when it is read back, from a
store or from a browser: code format, page names from a fixed list, integers in range, sampling settings
through SamplingParams. Nothing here knows Streamlit or a store."""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields

from engine import InputError, SamplingParams

from .rooms_redis import RedisError, Unreachable

CODE_ALPHABET = "23456789ABCDEFGHJKLMNPQRSTUVWXYZ"        # 32 symbols: no 0/O, 1/I/L to misread
CODE_LEN = 6                                              # 32**6 ≈ 1.07e9 codes; failed joins are rate-limited
CODE_RE = re.compile(f"[{CODE_ALPHABET}]{{{CODE_LEN}}}")
ROOM_PAGES = ("overview", "tokens", "attention", "activations", "kv_cache", "sampling", "timeline", "debugger",
              "compare", "nan_doctor", "repetition", "explain", "quantization", "trace_files")
MAX_STEP, MAX_LAYER, MAX_HEAD, MAX_TOKEN_ID = 1 << 20, 1 << 10, 1 << 12, 1 << 24
MAX_RUN_BYTES = 128 << 20        # one published run's trace (a 32-token run of a 49k vocabulary: about 7 MB)
MAX_CHOICES = 12                 # choices offered in a poll
MAX_ANSWER_CHARS = 64            # a student's free-text answer, before it is mapped to a token
ROOM_ANSWERS = 60                # answers one poll accepts (a class; $LLM_INSPECTOR_ROOM_ANSWERS sets it)
MAX_VOTERS = 2_000               # the most that setting may be, and the most answers a tally reads
MAX_PAST_POLLS = 50
HASH_RE = re.compile(r"[0-9a-f]{1,64}")


class RoomError(InputError):
    """Something about a room the user should be told (the message says what)."""


class Forbidden(RoomError):
    """A publish without the room's token: refused."""


class NoRoom(RoomError):
    """No room with this code (never created, ended, or expired)."""


ROOM_ERRORS = (RoomError, RedisError)       # what a page catches around a store call: each says what failed
STORE_DOWN = Unreachable                    # of those, the store not answering now (a later call may succeed)


# ---- what a room holds -----------------------------------------------------------------------------------
def check_int(v, lo: int, hi: int, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RoomError(f"{what} must be a whole number in [{lo}, {hi}], got {str(v)[:40]!r}")
    return v


def check_code(code) -> str:
    """A room code as typed or read from a link (case and spaces forgiven), or RoomError."""
    c = code.strip().upper() if isinstance(code, str) else ""
    if not CODE_RE.fullmatch(c):
        raise RoomError(f"a room code is {CODE_LEN} letters and digits (e.g. {'K7QM2X'})")
    return c


def check_page(page) -> str:
    if page not in ROOM_PAGES:
        raise RoomError(f"not a page a room can show: {str(page)[:40]!r}")
    return page


def check_params(d) -> SamplingParams:
    """SamplingParams from a dict of known fields with numbers only (SamplingParams checks the ranges)."""
    names = {f.name: f for f in fields(SamplingParams)}
    if not isinstance(d, dict) or not set(d) <= set(names):
        raise RoomError("sampling settings: unknown fields")
    for k, v in d.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RoomError(f"sampling settings: {k} must be a number")
    try:
        return SamplingParams(**d)
    except InputError as e:
        raise RoomError(f"sampling settings: {str(e).split('; got')[0]}") from None


@dataclass(frozen=True)
class View:
    """What the teacher's screen shows: the page, and the selection the following screens copy."""
    page: str = "overview"
    step: int = 0
    layer: int = 0
    head: int | None = None                    # None: the average of all heads
    params: SamplingParams = field(default_factory=SamplingParams)

    def as_dict(self) -> dict:
        return {"page": self.page, "step": self.step, "layer": self.layer, "head": self.head,
                "params": asdict(self.params)}

    @classmethod
    def from_dict(cls, d) -> "View":
        if not isinstance(d, dict):
            raise RoomError("a room's view must be an object")
        head = d.get("head")
        return cls(page=check_page(d.get("page")), step=check_int(d.get("step"), 0, MAX_STEP, "step"),
                   layer=check_int(d.get("layer"), 0, MAX_LAYER, "layer"),
                   head=None if head is None else check_int(head, 0, MAX_HEAD, "head"),
                   params=check_params(d.get("params", {})))


@dataclass(frozen=True)
class Poll:
    """"What comes next?" at one step of the room's run: the candidates offered, and whether the class's
    answers are shown."""
    id: int
    step: int
    choices: tuple[int, ...] = ()             # token ids offered as buttons (the model's top candidates)
    revealed: bool = False
    run_id: str | None = None                 # the run it was asked about

    def as_dict(self) -> dict:
        return {"id": self.id, "step": self.step, "choices": list(self.choices), "revealed": self.revealed,
                "run_id": self.run_id}

    @classmethod
    def from_dict(cls, d) -> "Poll":
        if not isinstance(d, dict):
            raise RoomError("a poll must be an object")
        ch = d.get("choices", [])
        if not isinstance(ch, list) or len(ch) > MAX_CHOICES:
            raise RoomError(f"a poll offers at most {MAX_CHOICES} choices")
        return cls(id=check_int(d.get("id"), 1, 1 << 31, "poll id"),
                   step=check_int(d.get("step"), 0, MAX_STEP, "poll step"),
                   choices=tuple(check_int(c, 0, MAX_TOKEN_ID, "choice") for c in ch),
                   revealed=d.get("revealed") is True, run_id=check_run_id(d.get("run_id")))


def check_run_id(v) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not HASH_RE.fullmatch(v):
        raise RoomError("a run id must be hexadecimal")
    return v


@dataclass(frozen=True)
class RoomState:
    code: str
    version: int
    run_id: str | None = None
    view: View = field(default_factory=View)
    poll: Poll | None = None
    past_polls: tuple[Poll, ...] = ()
    prev_run_id: str | None = None            # kept one publish longer, for a student still loading it
    steer_id: str | None = None               # the steering vector published to the room (rooms_steer), if any

    def as_json(self) -> bytes:
        return json.dumps({"code": self.code, "version": self.version, "run_id": self.run_id,
                           "prev_run_id": self.prev_run_id, "view": self.view.as_dict(),
                           "poll": None if self.poll is None else self.poll.as_dict(),
                           "past_polls": [p.as_dict() for p in self.past_polls], "steer_id": self.steer_id}).encode()

    @classmethod
    def from_json(cls, data: bytes, code: str) -> "RoomState":
        try:
            d = json.loads(data)
        except (ValueError, RecursionError):
            raise RoomError("the room's state is not valid JSON") from None
        if not isinstance(d, dict) or d.get("code") != code:
            raise RoomError("the room's state belongs to another room")
        past = d.get("past_polls", [])
        if not isinstance(past, list) or len(past) > MAX_PAST_POLLS:
            raise RoomError("too many past polls")
        return cls(code=code, version=check_int(d.get("version"), 0, 1 << 62, "version"),
                   run_id=check_run_id(d.get("run_id")), view=View.from_dict(d.get("view")),
                   prev_run_id=check_run_id(d.get("prev_run_id")),
                   poll=None if d.get("poll") is None else Poll.from_dict(d["poll"]),
                   past_polls=tuple(Poll.from_dict(p) for p in past), steer_id=check_run_id(d.get("steer_id")))
