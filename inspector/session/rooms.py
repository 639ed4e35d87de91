"""Rooms: a teacher's run and view that students' sessions follow, and the polls asked in them.

A teacher (a session that entered $LLM_INSPECTOR_TEACHER_KEY) creates a room: a short code and a publish
token. Only the token opens publishing; it is random (secrets.token_urlsafe), held in the teacher's server-side
session, and the store keeps only its SHA-256. Students follow by reading the room's state, a small JSON
document with a version number, and load the run (trace bytes, engine.trace's format) only when its id changes.

All the rules live in `RoomStore`, once; where the state is kept is a `Backend` of a handful of key-value
operations (get, set, delete, incr, hsetnx, hgetall, hlen): `MemoryBackend` here (one process, the default)
and `RedisBackend` in rooms_redis.py (several app processes behind a load balancer share one Redis). This
is the shape of Django's cache backends: one API, small storage drivers, the same tests run against each.

What a room holds, and the checks on it, are in rooms_state.py. Everything read from a backend or a browser
is validated (code format, page names from a fixed list, integers in range, sampling settings through
SamplingParams, bounded strings): a store someone else can write to is input like any other. Nothing here
knows Streamlit; nothing here unpickles.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time
from dataclasses import replace
from typing import Protocol

from .rooms_redis import RedisBackend
from .rooms_state import (
    CODE_ALPHABET,
    CODE_LEN,
    HASH_RE,
    MAX_CHOICES,
    MAX_PAST_POLLS,
    MAX_RUN_BYTES,
    MAX_TOKEN_ID,
    MAX_VOTERS,
    Forbidden,
    NoRoom,
    Poll,
    RoomError,
    RoomState,
    View,
    check_code,
    check_int,
    check_run_id,
)

KEY_ENV, STORE_ENV, TTL_ENV = "LLM_INSPECTOR_TEACHER_KEY", "LLM_INSPECTOR_ROOMS", "LLM_INSPECTOR_ROOM_TTL_S"
MIN_KEY_CHARS = 8
DEFAULT_TTL_S = 12 * 3600        # a room nobody touches for this long ends by itself


# ---- where it is kept ------------------------------------------------------------------------------------
class Backend(Protocol):
    """The storage a RoomStore needs: bytes under string keys, each key with a time to live (seconds)."""

    def get(self, key: str) -> bytes | None: ...
    def set(self, key: str, value: bytes, ttl: int, only_new: bool = False) -> bool: ...
    def delete(self, *keys: str) -> None: ...
    def expire(self, key: str, ttl: int) -> None: ...
    def incr(self, key: str, ttl: int) -> int: ...
    def hsetnx(self, key: str, name: str, value: bytes, ttl: int) -> bool: ...
    def hgetall(self, key: str) -> dict[str, bytes]: ...
    def hlen(self, key: str) -> int: ...


class MemoryBackend:
    """In this process (the default): a dict under a lock, expired keys dropped as they are met."""

    def __init__(self, clock=time.monotonic) -> None:
        self._d: dict[str, tuple[float, object]] = {}
        self._lock = threading.Lock()
        self._clock = clock

    def _live(self, key: str):
        item = self._d.get(key)
        if item is not None and item[0] <= self._clock():
            del self._d[key]
            return None
        return None if item is None else item[1]

    def get(self, key):
        with self._lock:
            v = self._live(key)
            return v if isinstance(v, bytes) else None

    def set(self, key, value, ttl, only_new=False):
        with self._lock:
            if only_new and self._live(key) is not None:
                return False
            self._d[key] = (self._clock() + ttl, bytes(value))
            return True

    def delete(self, *keys):
        with self._lock:
            for k in keys:
                self._d.pop(k, None)

    def expire(self, key, ttl):
        with self._lock:
            v = self._live(key)
            if v is not None:
                self._d[key] = (self._clock() + ttl, v)

    def incr(self, key, ttl):
        with self._lock:
            v = self._live(key)
            n = (int(v) if isinstance(v, bytes) else 0) + 1
            self._d[key] = (self._clock() + ttl, str(n).encode())
            return n

    def hsetnx(self, key, name, value, ttl):
        with self._lock:
            h = self._live(key)
            h = dict(h) if isinstance(h, dict) else {}
            if name in h:
                return False
            h[name] = bytes(value)
            self._d[key] = (self._clock() + ttl, h)
            return True

    def hgetall(self, key):
        with self._lock:
            h = self._live(key)
            return dict(h) if isinstance(h, dict) else {}

    def hlen(self, key):
        return len(self.hgetall(key))


# ---- the rules -------------------------------------------------------------------------------------------
def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest().encode()


def run_id_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


class RoomStore:
    """Rooms over a Backend. Publishing (run, view, polls, ending) needs the token `create` returned;
    reading the state and answering a poll do not."""

    def __init__(self, backend: Backend, ttl_s: int = DEFAULT_TTL_S, prefix: str = "llmi:room:") -> None:
        self.b, self.ttl, self.prefix = backend, int(ttl_s), prefix

    def _k(self, code: str, *parts) -> str:
        return self.prefix + ":".join([code, *map(str, parts)])

    def create(self) -> tuple[str, str]:
        """A new room: (code, publish token)."""
        token = secrets.token_urlsafe(32)
        for _ in range(20):
            code = "".join(secrets.choice(CODE_ALPHABET) for _ in range(CODE_LEN))
            if self.b.set(self._k(code, "auth"), _digest(token), self.ttl, only_new=True):
                self._write(RoomState(code, self.b.incr(self._k(code, "ver"), self.ttl)))
                return code, token
        raise RoomError("could not find a free room code; try again")

    def take_over(self, code: str) -> str:
        """A new token for an existing room (the old one stops working). Call only for a session that
        proved it holds the teacher key: the store itself knows no key."""
        code = check_code(code)
        self._state(code)
        token = secrets.token_urlsafe(32)
        self.b.set(self._k(code, "auth"), _digest(token), self.ttl)
        return token

    def _authorize(self, code: str, token) -> str:
        code = check_code(code)
        stored = self.b.get(self._k(code, "auth"))
        if stored is None:
            raise NoRoom(f"room {code} has ended")
        if not isinstance(token, str) or not hmac.compare_digest(_digest(token), stored):
            raise Forbidden(f"only the teacher who opened room {code} can change what it shows")
        return code

    def _state(self, code: str) -> RoomState:
        data = self.b.get(self._k(code, "state"))
        if data is None:
            raise NoRoom(f"there is no room {code} (ended, expired, or mistyped)")
        return RoomState.from_json(data, code)

    def _write(self, s: RoomState) -> None:
        self.b.set(self._k(s.code, "state"), s.as_json(), self.ttl)

    def _bump(self, code: str, **changes) -> RoomState:
        """The room's state with changes, under a new version; every key of the room lives on."""
        s = replace(self._state(code), **changes, version=self.b.incr(self._k(code, "ver"), self.ttl))
        self._write(s)
        for key in [self._k(code, "auth"), self._k(code, "polls")] + [self._k(code, "run", r) for r in (
                s.run_id, s.prev_run_id) if r] + ([self._k(code, "poll", s.poll.id)] if s.poll else []):
            self.b.expire(key, self.ttl)
        return s

    def state(self, code: str) -> RoomState | None:
        """The room's state (one small read: what a following screen polls), None if there is none."""
        try:
            return self._state(check_code(code))
        except NoRoom:
            return None

    def publish(self, code: str, token: str, *, view: View | None = None, run: bytes | None = None) -> RoomState:
        """Show a view and/or a run (trace bytes) in the room; Forbidden without the room's token."""
        code = self._authorize(code, token)
        s = self._state(code)
        changes: dict = {}
        if view is not None and view != s.view:
            changes["view"] = View.from_dict(view.as_dict())      # the same checks as on reading
        if run is not None:
            if not isinstance(run, bytes) or not 8 <= len(run) <= MAX_RUN_BYTES:
                raise RoomError(f"a run shown in a room is at most {MAX_RUN_BYTES >> 20} MiB")
            rid = run_id_of(run)
            if rid != s.run_id:
                self.b.set(self._k(code, "run", rid), run, self.ttl)
                if s.prev_run_id not in (None, rid):
                    self.b.delete(self._k(code, "run", s.prev_run_id))
                changes |= {"run_id": rid, "prev_run_id": s.run_id}
        if not changes:
            return s
        return self._bump(code, **changes)

    def run_bytes(self, code: str, run_id: str) -> bytes | None:
        data = self.b.get(self._k(check_code(code), "run", check_run_id(run_id)))
        return data if data is not None and len(data) <= MAX_RUN_BYTES else None

    # ---- polls ------------------------------------------------------------------------------------------
    def ask(self, code: str, token: str, step: int, choices=()) -> Poll:
        """Open a poll at a step of the current run (the open one, if any, is closed and kept)."""
        code = self._authorize(code, token)
        s = self._state(code)
        n = self.b.incr(self._k(code, "polls"), self.ttl)
        poll = Poll.from_dict({"id": n, "step": step, "choices": list(choices)[:MAX_CHOICES], "run_id": s.run_id})
        past = (s.past_polls + ((s.poll,) if s.poll else ()))[-MAX_PAST_POLLS:]
        return self._bump(code, poll=poll, past_polls=past).poll

    def reveal(self, code: str, token: str) -> Poll:
        code = self._authorize(code, token)
        s = self._state(code)
        if s.poll is None:
            raise RoomError("no poll is open")
        return self._bump(code, poll=replace(s.poll, revealed=True)).poll

    def close_poll(self, code: str, token: str) -> None:
        code = self._authorize(code, token)
        s = self._state(code)
        if s.poll is not None:
            self._bump(code, poll=None, past_polls=(s.past_polls + (s.poll,))[-MAX_PAST_POLLS:])

    def answer(self, code: str, poll_id: int, voter: str, token_id: int) -> bool:
        """One student's answer (a token id) to the open poll; False if this voter already answered or the
        poll has closed. voter: a hash that names the student's session (one answer per session)."""
        code = check_code(code)
        s = self._state(code)
        if s.poll is None or s.poll.id != poll_id:
            raise RoomError("this poll has closed")
        if not isinstance(voter, str) or not HASH_RE.fullmatch(voter):
            raise RoomError("bad voter id")
        token_id = check_int(token_id, 0, MAX_TOKEN_ID, "token id")
        key = self._k(code, "poll", poll_id)
        if self.b.hlen(key) >= MAX_VOTERS:
            raise RoomError(f"this poll already has {MAX_VOTERS} answers")
        return self.b.hsetnx(key, voter, str(token_id).encode(), self.ttl)

    def tally(self, code: str, poll_id: int) -> dict[int, int]:
        """token id -> number of students who answered it (values that are not token ids are skipped)."""
        counts: dict[int, int] = {}
        raw = self.b.hgetall(self._k(check_code(code), "poll", check_int(poll_id, 1, 1 << 31, "poll id")))
        for v in list(raw.values())[:MAX_VOTERS]:
            if isinstance(v, bytes) and v.isdigit() and len(v) <= 9 and int(v) <= MAX_TOKEN_ID:
                counts[int(v)] = counts.get(int(v), 0) + 1
        return counts

    def answer_count(self, code: str, poll_id: int) -> int:
        """How many answers a poll has (one small read: what the teacher's screen watches)."""
        return self.b.hlen(self._k(check_code(code), "poll", check_int(poll_id, 1, 1 << 31, "poll id")))

    def end(self, code: str, token: str) -> None:
        """End the room: its runs, state and every poll's answers are deleted."""
        code = self._authorize(code, token)
        s = self._state(code)
        polls = [p.id for p in s.past_polls] + ([s.poll.id] if s.poll else [])
        runs = [r for r in (s.run_id, s.prev_run_id) if r]
        self.b.delete(*[self._k(code, "poll", i) for i in polls], *[self._k(code, "run", r) for r in runs],
                      self._k(code, "state"), self._k(code, "ver"), self._k(code, "polls"), self._k(code, "auth"))


# ---- the teacher key, rate limits, the process's store ---------------------------------------------------
def teacher_key_state(env=os.environ) -> str | None:
    """None when the room feature is on; otherwise why not (said to the user, naming the variable)."""
    key = env.get(KEY_ENV, "")
    if not key:
        return f"Rooms are off on this server. To turn them on, start the app with {KEY_ENV} set to a secret."
    if len(key) < MIN_KEY_CHARS:
        return f"Rooms are off: {KEY_ENV} must be at least {MIN_KEY_CHARS} characters."
    return None


def teacher_key_ok(entered, env=os.environ) -> bool:
    key = env.get(KEY_ENV, "")
    if teacher_key_state(env) is not None or not isinstance(entered, str) or len(entered) > 1024:
        return False
    return hmac.compare_digest(entered.encode("utf-8", "surrogatepass"), key.encode("utf-8", "surrogatepass"))


class RateLimiter:
    """At most `limit` events per `window_s` for each key, and `total` for all keys together."""

    def __init__(self, limit: int, total: int, window_s: float = 60.0, clock=time.monotonic) -> None:
        self.limit, self.total, self.window, self.clock = limit, total, window_s, clock
        self._events: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def allow(self, key: str) -> bool:
        """Record one event for key; False (not recorded) when key or everyone is over the limit."""
        now = self.clock()
        with self._lock:
            for k in list(self._events):
                self._events[k] = [t for t in self._events[k] if now - t < self.window]
                if not self._events[k]:
                    del self._events[k]
            mine = self._events.get(key, [])
            if len(mine) >= self.limit or sum(map(len, self._events.values())) >= self.total:
                return False
            self._events[key] = mine + [now]
            return True


failed_joins = RateLimiter(limit=10, total=200)      # unknown codes tried, per browser / this process
failed_keys = RateLimiter(limit=5, total=50)         # wrong teacher keys
_stores: dict[tuple[str, int], RoomStore] = {}
_stores_lock = threading.Lock()


def shared_store(env=os.environ) -> RoomStore:
    """This process's RoomStore: in memory, or Redis when $LLM_INSPECTOR_ROOMS is a redis:// or unix:// URL.
    RoomError names a malformed setting."""
    url = env.get(STORE_ENV, "").strip()
    url = "" if url == "memory" else url
    try:
        ttl = int(env.get(TTL_ENV, DEFAULT_TTL_S))
    except ValueError:
        raise RoomError(f"{TTL_ENV} must be a whole number of seconds") from None
    with _stores_lock:
        if (url, ttl) not in _stores:
            if not url:
                backend: Backend = MemoryBackend()
            else:
                try:
                    backend = RedisBackend.from_url(url)
                except ValueError as e:
                    raise RoomError(f"{STORE_ENV}: {e}") from None
            _stores[(url, ttl)] = RoomStore(backend, ttl)
        return _stores[(url, ttl)]
