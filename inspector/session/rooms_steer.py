"""A steering vector a teacher publishes to a room (issue 47, item 4): the vector itself (its layer, the two prompt
sets it came from), and the teacher's steered and plain continuations with the distribution shift per step, as
engine.tools.steering.steer computed them. Students' screens show the teacher's result as published, and can add
the same vector to their own prompt with their own coefficient (their own run: the room only carries the vector).

Like every document a room holds, it is validated whole when it is written and when it is read back (a store is
input like any other): bounded text, bounded counts, finite numbers, at most MAX_STEER_BYTES of UTF-8 JSON.
`SteeringStore` is the part of inspector.session.rooms.RoomStore that keeps it (its own transactions, `_change`).
Nothing here knows Streamlit."""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

from .rooms_state import RoomError, RoomState, check_code, check_int

MAX_DIM = 16_384                 # the vector's length: a model's hidden size
MAX_SET = 16                     # prompts a side (engine.tools.steering.MAX_PROMPTS)
MAX_SET_PROMPT_CHARS = 500
MAX_PROMPT_CHARS = 1_000
MAX_TEXT_CHARS = 2_000
MAX_STEPS = 64                   # the steering section's most new tokens
MAX_PIECE_CHARS = 32
MAX_MODEL_CHARS = 200
MAX_LAYER = 1 << 10
MAX_COEFFICIENT = 1e4
# The vector's floats are the bulk: a float written by json as repr takes at most 24 characters with its separator.
MAX_STEER_BYTES = 24 * MAX_DIM + 6 * (2 * MAX_SET * MAX_SET_PROMPT_CHARS + MAX_PROMPT_CHARS + 2 * MAX_TEXT_CHARS
                                      + MAX_STEPS * (2 * MAX_PIECE_CHARS + 160)) + 4096


def _text(v, limit: int, what: str) -> str:
    if not isinstance(v, str) or len(v) > limit:
        raise RoomError(f"the room's steering: {what} must be text of at most {limit} characters")
    return v


def _num(v, what: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise RoomError(f"the room's steering: {what} must be a finite number in [{lo:g}, {hi:g}]")
    return float(v)


def _prompts(v, what: str) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)) or not 1 <= len(v) <= MAX_SET:
        raise RoomError(f"the room's steering: the {what} set holds 1 to {MAX_SET} prompts")
    return tuple(_text(p, MAX_SET_PROMPT_CHARS, f"a {what} prompt") for p in v)


@dataclass(frozen=True)
class SteerStep:
    step: int
    text: str
    kl: float                        # KL(steered || plain) at this step
    p_steered: float
    p_plain: float
    plain_top_text: str

    def as_dict(self) -> dict:
        return {"step": self.step, "text": self.text, "kl_steered_plain": self.kl, "p_steered": self.p_steered,
                "p_plain": self.p_plain, "plain_top_text": self.plain_top_text}

    @classmethod
    def from_dict(cls, d) -> "SteerStep":
        if not isinstance(d, dict):
            raise RoomError("the room's steering: a step must be an object")
        return cls(step=check_int(d.get("step"), 0, MAX_STEPS - 1, "steering step"),
                   text=_text(d.get("text"), MAX_PIECE_CHARS, "a step's token"),
                   kl=_num(d.get("kl_steered_plain"), "a step's KL", 0.0),
                   p_steered=_num(d.get("p_steered"), "a probability", 0.0, 1.0),
                   p_plain=_num(d.get("p_plain"), "a probability", 0.0, 1.0),
                   plain_top_text=_text(d.get("plain_top_text"), MAX_PIECE_CHARS, "the plain top token"))


@dataclass(frozen=True)
class RoomSteering:
    """What the teacher published: the vector, and the run it made on the teacher's prompt."""
    model: str                       # the model it was computed on (a student's model must be the same)
    layer: int
    coefficient: float
    vector: tuple[float, ...]
    positive: tuple[str, ...]
    negative: tuple[str, ...]
    prompt: str
    plain_text: str
    steered_text: str
    steps: tuple[SteerStep, ...] = ()

    @property
    def stage(self) -> str:
        return f"blocks.{self.layer}.resid_post"

    @property
    def norm(self) -> float:
        return math.sqrt(sum(v * v for v in self.vector))

    @classmethod
    def of_run(cls, model: str, vector, positive, negative, prompt: str, run: dict) -> "RoomSteering":
        """From engine.tools.steering's SteeringVector parts and SteeredRun.as_dict(); checked as on reading (the
        teacher's texts cut to the room's bounds first: the room shows what fits)."""
        d = {"model": model[:MAX_MODEL_CHARS], "layer": run["layer"], "coefficient": run["coefficient"],
             "vector": [float(v) for v in vector], "positive": [p[:MAX_SET_PROMPT_CHARS] for p in positive],
             "negative": [p[:MAX_SET_PROMPT_CHARS] for p in negative], "prompt": prompt[:MAX_PROMPT_CHARS],
             "plain_text": run["plain_text"][:MAX_TEXT_CHARS], "steered_text": run["steered_text"][:MAX_TEXT_CHARS],
             "steps": [{**s, "text": s["text"][:MAX_PIECE_CHARS], "plain_top_text": s["plain_top_text"][:MAX_PIECE_CHARS]}
                       for s in run["steps"][:MAX_STEPS]]}
        return cls.from_json(json.dumps(d, ensure_ascii=False).encode("utf-8", "replace"))

    def as_json(self) -> bytes:
        return json.dumps({"model": self.model, "layer": self.layer, "coefficient": self.coefficient,
                           "vector": list(self.vector), "positive": list(self.positive),
                           "negative": list(self.negative), "prompt": self.prompt, "plain_text": self.plain_text,
                           "steered_text": self.steered_text, "steps": [s.as_dict() for s in self.steps]},
                          ensure_ascii=False).encode("utf-8", "replace")

    def digest(self) -> str:
        """The document's id in the room's state (a new publish changes it; students' screens follow it)."""
        return hashlib.sha256(self.as_json()).hexdigest()[:32]

    def as_run(self) -> dict:
        """In the form the steering section draws (SteeredRun.as_dict's fields it shows)."""
        return {"coefficient": self.coefficient, "layer": self.layer, "plain_text": self.plain_text,
                "steered_text": self.steered_text, "steps": [s.as_dict() for s in self.steps], "norm": self.norm,
                "stage": self.stage}

    @classmethod
    def from_json(cls, data) -> "RoomSteering":
        if not isinstance(data, bytes) or len(data) > MAX_STEER_BYTES:
            raise RoomError(f"the room's steering document is at most {MAX_STEER_BYTES >> 10} KiB")
        try:
            d = json.loads(data)
        except (ValueError, RecursionError):
            raise RoomError("the room's steering document is not valid JSON") from None
        if not isinstance(d, dict):
            raise RoomError("the room's steering document must be an object")
        vec = d.get("vector")
        if not isinstance(vec, list) or not 1 <= len(vec) <= MAX_DIM:
            raise RoomError(f"the room's steering vector holds 1 to {MAX_DIM} numbers")
        steps = d.get("steps", [])
        if not isinstance(steps, list) or len(steps) > MAX_STEPS:
            raise RoomError(f"the room's steering shows at most {MAX_STEPS} steps")
        return cls(model=_text(d.get("model"), MAX_MODEL_CHARS, "the model"),
                   layer=check_int(d.get("layer"), 0, MAX_LAYER, "steering layer"),
                   coefficient=_num(d.get("coefficient"), "the coefficient", -MAX_COEFFICIENT, MAX_COEFFICIENT),
                   vector=tuple(_num(v, "a vector entry") for v in vec),
                   positive=_prompts(d.get("positive"), "positive"), negative=_prompts(d.get("negative"), "negative"),
                   prompt=_text(d.get("prompt"), MAX_PROMPT_CHARS, "the prompt"),
                   plain_text=_text(d.get("plain_text"), MAX_TEXT_CHARS, "the plain text"),
                   steered_text=_text(d.get("steered_text"), MAX_TEXT_CHARS, "the steered text"),
                   steps=tuple(SteerStep.from_dict(s) for s in steps))


class SteeringStore:
    """RoomStore's steering methods (a mixin: RoomStore provides b, _k, _state and _change)."""

    def publish_steering(self, code: str, token: str, steering: RoomSteering) -> RoomState:
        """Show a steering vector and the teacher's steered run in the room (replacing the one shown); the state's
        new version reruns the students' screens. Forbidden without the room's token."""
        data = steering.as_json()
        RoomSteering.from_json(data)                  # the same checks as on reading: nothing oversized stored
        sid = steering.digest()

        def f(s: RoomState):
            if sid == s.steer_id:
                return {}, []
            return {"steer_id": sid}, [("set", self._k(s.code, "steer"), data, self.ttl)]
        return self._change(code, token, f, send=len(data))

    def steering(self, code: str, state: RoomState | None = None) -> RoomSteering | None:
        """The steering vector the room shows (None: none published, or its document is gone); state: the room's
        state already read. A document that does not match the state's id (a publish in between) reads as the
        newer one; one that fails its checks is a RoomError."""
        code = check_code(code)
        s = self._state(code) if state is None else state
        if s.steer_id is None:
            return None
        data = self.b.get(self._k(code, "steer"), MAX_STEER_BYTES)
        return None if data is None else RoomSteering.from_json(data)
