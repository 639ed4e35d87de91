"""Rooms: a teacher's run and view that students' sessions follow, and the polls asked in them.

A teacher (a session that entered $LLM_INSPECTOR_TEACHER_KEY) creates a room: a short code and a publish
token. Only the token opens publishing; it is random (secrets.token_urlsafe), held in the teacher's server-side
session, and the store keeps only its SHA-256. Students follow by reading the room's state, a small JSON
document with a version number, and load the run (trace bytes, inspection.trace's format) only when its id changes.

All the rules live in `RoomStore`, once; where the state is kept is a `Backend` of a handful of key-value
operations (bounded get, set, delete, incr, hsetnx, hvals, hlen, and `update`, the one read-then-write, atomic):
`MemoryBackend` (rooms_memory.py: one process, the default) and `RedisBackend` (rooms_redis.py, over redis-py:
several app processes behind a load balancer share one Redis). This is the shape of Django's cache backends:
one API, small storage drivers, the same tests run against each. Every change of a room's state goes through
`_change` (one transaction: the token checked, the state read and written under a new version), so two
publishes at once never lose one.

What a room holds, and the checks on it, are in rooms_state.py. Everything read from a backend or a browser
is validated (code format, page names from a fixed list, integers in range, sampling settings through
SamplingParams, bounded strings): a store someone else can write to is input like any other. Nothing here
knows Streamlit; nothing here unpickles.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
from dataclasses import replace

from .rooms_live import MAX_LIVE_BYTES, Live
from .rooms_memory import Backend, MemoryBackend
from .rooms_redis import DEFAULT_LIMIT, Full, RedisBackend, RedisError
from .rooms_steer import SteeringStore
from .rooms_state import (CODE_ALPHABET, CODE_LEN, HASH_RE, MAX_CHOICES, MAX_PAST_POLLS, MAX_RUN_BYTES, MAX_TOKEN_ID,
                          MAX_VOTERS, ROOM_ANSWERS, Forbidden, NoRoom, Poll, RoomError, RoomState, View, check_code,
                          check_int, check_run_id)

STORE_ENV, TTL_ENV = "LLM_INSPECTOR_ROOMS", "LLM_INSPECTOR_ROOM_TTL_S"
ANSWERS_ENV = "LLM_INSPECTOR_ROOM_ANSWERS"
DEFAULT_TTL_S = 12 * 3600        # a room nobody touches for this long ends by itself
log = logging.getLogger("llm_inspector")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest().encode()


def run_id_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def _check_token(code: str, stored: bytes | None, token) -> None:
    if stored is None:
        raise NoRoom(f"room {code} has ended")
    if not isinstance(token, str) or not hmac.compare_digest(_digest(token), stored):
        raise Forbidden(f"only the teacher who opened room {code} can change what it shows")


def _parse(code: str, data: bytes | None) -> RoomState:
    if data is None:
        raise NoRoom(f"there is no room {code} (ended, expired, or mistyped)")
    if len(data) > DEFAULT_LIMIT:
        raise RoomError(f"the room's state is over {DEFAULT_LIMIT >> 10} KiB")
    return RoomState.from_json(data, code)


def _count(v: bytes | None) -> int:
    """A counter read from the store (0 when there is none, or it is not one)."""
    return int(v) if v is not None and v.isdigit() and len(v) < 19 else 0


class RoomStore(SteeringStore):
    """Rooms over a Backend. Publishing (run, view, polls, ending) needs the token from `create`; reading does not."""

    def __init__(self, backend: Backend, ttl_s: int = DEFAULT_TTL_S, prefix: str = "llmi:room:",
                 max_answers: int = ROOM_ANSWERS) -> None:
        self.b, self.ttl, self.prefix = backend, int(ttl_s), prefix
        self.max_answers = check_int(max_answers, 1, MAX_VOTERS, "answers a poll accepts")

    def _k(self, code: str, *parts) -> str:
        return self.prefix + ":".join([code, *map(str, parts)])

    def create(self) -> tuple[str, str]:
        """A new room: (code, publish token)."""
        self.b.check_keeps_keys()          # a store that may evict would drop a live room's keys: refused
        token = secrets.token_urlsafe(32)
        for _ in range(20):
            code = "".join(secrets.choice(CODE_ALPHABET) for _ in range(CODE_LEN))
            if self.b.set(self._k(code, "auth"), _digest(token), self.ttl, only_new=True):
                self.b.delete(self._k(code, "ended"))      # a code ended long ago, drawn again
                self._write(RoomState(code, self.b.incr(self._k(code, "ver"), self.ttl)))
                return code, token
        raise RoomError("could not find a free room code; try again")

    def take_over(self, code: str) -> str:
        """A new token for an existing room (the old one stops working). Call only for a session that
        proved it holds the teacher key: the store itself knows no key."""
        code = check_code(code)
        self.b.check_keeps_keys()
        self._state(code)
        token = secrets.token_urlsafe(32)
        self.b.set(self._k(code, "auth"), _digest(token), self.ttl)
        return token

    def _authorize(self, code: str, token) -> str:
        code = check_code(code)
        _check_token(code, self.b.get(self._k(code, "auth"), 64), token)
        return code

    def _state(self, code: str) -> RoomState:
        return _parse(code, self.b.get(self._k(code, "state")))

    def _write(self, s: RoomState) -> None:
        self.b.set(self._k(s.code, "state"), s.as_json(), self.ttl)

    def _change(self, code: str, token, f, send: int = 0) -> RoomState:
        """One atomic update of room `code` (whoever else publishes at the same time): the token checked, the
        state read, f(state) -> (changes, ops); with changes, the state under a new version and every key of
        the room living on. Two publishes at once both land (the store retries the later on the earlier's
        result)."""
        code = check_code(code)
        ka, ks, kv = self._k(code, "auth"), self._k(code, "state"), self._k(code, "ver")

        def tx(values: dict):
            _check_token(code, values[ka], token)
            s = _parse(code, values[ks])
            changes, ops = f(s)
            if not changes:
                return list(ops), s
            n = max(_count(values[kv]), s.version) + 1
            new = replace(s, **changes, version=n)
            keep = [ka, self._k(code, "polls"), self._k(code, "steer")] + [self._k(code, "run", r) for r in (new.run_id, new.prev_run_id)
                                                   if r] + ([self._k(code, "poll", new.poll.id)] if new.poll else [])
            return [*ops, ("set", ks, new.as_json(), self.ttl), ("set", kv, str(n).encode(), self.ttl),
                    *[("expire", k, self.ttl) for k in keep]], new
        return self.b.update((ka, ks, kv), tx, send=send)

    def state(self, code: str) -> RoomState | None:
        """The room's state (one small read: what a following screen polls), None if there is none."""
        try:
            return self._state(check_code(code))
        except NoRoom:
            return None

    def publish(self, code: str, token: str, *, view: View | None = None, run: bytes | None = None) -> RoomState:
        """Show a view and/or a run (trace bytes) in the room; Forbidden without the room's token. Atomic: a
        view published at the same time as a run (two tabs, two processes) loses neither."""
        if view is not None:
            view = View.from_dict(view.as_dict())      # the same checks as on reading
        rid = None
        if run is not None:
            if not isinstance(run, bytes) or not 8 <= len(run) <= MAX_RUN_BYTES:
                raise RoomError(f"a run shown in a room is at most {MAX_RUN_BYTES >> 20} MiB")
            rid = run_id_of(run)

        def f(s: RoomState):
            changes: dict = {}
            ops: list = []
            if view is not None and view != s.view:
                changes["view"] = view
            if rid is not None:
                if rid != s.run_id:
                    ops.append(("set", self._k(s.code, "run", rid), run, self.ttl))
                    if s.prev_run_id not in (None, rid):
                        ops.append(("del", self._k(s.code, "run", s.prev_run_id)))
                    changes |= {"run_id": rid, "prev_run_id": s.run_id}
                ops.append(("del", self._k(s.code, "live")))    # the full run replaces the live one
            return changes, ops
        return self._change(code, token, f, send=len(run) if run else 0)

    # ---- the teacher's run while it generates (rooms_live) ------------------------------------------------
    def start_live(self, code: str, token: str, prompt: str, max_new: int) -> Live:
        """A run of the teacher's starts: the room says it is live (students' screens show its panel)."""
        code = self._authorize(code, token)
        live = Live(self.b.incr(self._k(code, "liveseq"), self.ttl), prompt[:1_000], max_new)
        self._put_live(code, token, live, start=True)
        return live

    def publish_live(self, code: str, token: str, live: Live) -> int:
        """The live run's newest state; returns the live counter (what the watcher compares). An update of a run
        the room no longer shows live (its full run published, or ended) is dropped."""
        return self._put_live(code, token, live)

    def _put_live(self, code: str, token: str, live: Live | None, start: bool = False, seq: int = 0) -> int:
        """One transaction on the live document and its counter: written (start: whatever was there; else only
        over the same run's document), or deleted (live None: only when run `seq` is the one shown)."""
        code = check_code(code)
        data = None if live is None else live.as_json()
        if data is not None:
            Live.from_json(data)                       # the same checks as on reading: nothing oversized stored
        ka, kl, kn = self._k(code, "auth"), self._k(code, "live"), self._k(code, "livever")

        def tx(v: dict):
            _check_token(code, v[ka], token)
            n = _count(v[kn])
            try:
                shown = None if v[kl] is None else Live.from_json(v[kl]).seq
            except RoomError:
                shown = None
            if not start and shown != (seq if live is None else live.seq):
                return [], n
            write = ("del", kl) if live is None else ("set", kl, data, self.ttl)
            return [write, ("set", kn, str(n + 1).encode(), self.ttl)], n + 1
        return self.b.update((ka, kl, kn), tx, limit=MAX_LIVE_BYTES)

    def end_live(self, code: str, token: str, seq: int) -> None:
        """The live run ended with nothing to show (failed, stopped before a token): the room shows its run."""
        self._put_live(code, token, None, seq=seq)

    def live(self, code: str) -> tuple[int, Live | None]:
        """(the live counter, the live run's document or None: no run of the teacher's is generating): what a
        student's live panel draws, and the watcher reads."""
        code = check_code(code)
        n = self.live_version(code)
        data = self.b.get(self._k(code, "live"), MAX_LIVE_BYTES)
        return n, None if data is None else Live.from_json(data)

    def live_seq(self, code: str) -> int | None:
        """The number of the teacher's run generating now; None when none is (or its document cannot be read)."""
        try:
            doc = self.live(code)[1]
        except (RoomError, RedisError):
            return None
        return None if doc is None else doc.seq

    def live_version(self, code: str) -> int:
        return _count(self.b.get(self._k(check_code(code), "livever"), 32))

    def run_bytes(self, code: str, run_id: str) -> bytes | None:
        data = self.b.get(self._k(check_code(code), "run", check_run_id(run_id)), MAX_RUN_BYTES)
        return data if data is not None and len(data) <= MAX_RUN_BYTES else None

    # ---- polls ------------------------------------------------------------------------------------------
    def ask(self, code: str, token: str, step: int, choices=()) -> Poll:
        """Open a poll at a step of the current run (the open one, if any, is closed and kept)."""
        code = self._authorize(code, token)
        n = self.b.incr(self._k(code, "polls"), self.ttl)
        choices = list(choices)[:MAX_CHOICES]

        def f(s: RoomState):
            poll = Poll.from_dict({"id": n, "step": step, "choices": choices, "run_id": s.run_id})
            return {"poll": poll, "past_polls": (s.past_polls + ((s.poll,) if s.poll else ()))[-MAX_PAST_POLLS:]}, []
        return self._change(code, token, f).poll

    def reveal(self, code: str, token: str) -> Poll:
        def f(s: RoomState):
            if s.poll is None:
                raise RoomError("no poll is open")
            return {"poll": replace(s.poll, revealed=True)}, []
        return self._change(code, token, f).poll

    def close_poll(self, code: str, token: str) -> None:
        self._change(code, token, lambda s: ({} if s.poll is None else {
            "poll": None, "past_polls": (s.past_polls + (s.poll,))[-MAX_PAST_POLLS:]}, []))

    def answer(self, code: str, poll_id: int, voter: str, token_id: int) -> bool:
        """One student's answer (a token id) to the open poll; False if this voter already answered.
        voter: voter_of(code, the browser) (one answer per browser and poll). RoomError when the poll has
        closed or holds max_answers answers already (a class's worth: a script inventing browsers fills one
        poll, not the store)."""
        code = check_code(code)
        s = self._state(code)
        if s.poll is None or s.poll.id != poll_id:
            raise RoomError("this poll has closed")
        if not isinstance(voter, str) or not HASH_RE.fullmatch(voter):
            raise RoomError("bad voter id")
        token_id = check_int(token_id, 0, MAX_TOKEN_ID, "token id")
        try:         # the count checked and the answer added at once: a poll never holds more than max_answers
            return self.b.hsetnx(self._k(code, "poll", poll_id), voter, str(token_id).encode(), self.ttl,
                                 max_len=self.max_answers)
        except Full:
            raise RoomError(f"this poll already has {self.max_answers} answers, as many as this server takes "
                            f"({ANSWERS_ENV})") from None

    def tally(self, code: str, poll_id: int) -> dict[int, int]:
        """token id -> number of students who answered it (values that are not token ids are skipped)."""
        counts: dict[int, int] = {}
        key = self._k(check_code(code), "poll", check_int(poll_id, 1, 1 << 31, "poll id"))
        for v in self.b.hvals(key, MAX_VOTERS, 9):
            if isinstance(v, bytes) and v.isdigit() and len(v) <= 9 and int(v) <= MAX_TOKEN_ID:
                counts[int(v)] = counts.get(int(v), 0) + 1
        return counts

    def my_answer(self, code: str, poll_id: int, voter: str) -> int | None:
        """The token id this voter answered to poll_id (the answer that counts), or None."""
        key = self._k(check_code(code), "poll", check_int(poll_id, 1, 1 << 31, "poll id"))
        v = self.b.hget(key, voter, 9) if isinstance(voter, str) and HASH_RE.fullmatch(voter) else None
        return int(v) if isinstance(v, bytes) and v.isdigit() and int(v) <= MAX_TOKEN_ID else None

    def answer_count(self, code: str, poll_id: int) -> int:
        """How many answers a poll has (one small read: what the teacher's screen watches)."""
        return self.b.hlen(self._k(check_code(code), "poll", check_int(poll_id, 1, 1 << 31, "poll id")))

    def end_or_leave(self, code: str, token: str) -> str | None:
        """What a teacher's End does: end the room in the store; when the store cannot (the room is gone
        already: expired, or Redis restarted empty; another teacher took it over; the store fails) the
        teacher's screen leaves the room anyway. None when ended; otherwise what happened, to be said."""
        try:
            self.end(code, token)
            return None
        except NoRoom:
            return "The room was no longer in the store (it expired, or the store restarted): you have left it."
        except Forbidden:
            return "Another session took this room over: you have left it; the room goes on there."
        except (RoomError, RedisError) as e:
            left = f"{self.ttl // 3600} h" if self.ttl >= 3600 else f"{max(1, self.ttl // 60)} min"
            return (f"The room could not be ended in the store ({e}); you have left it here, and it ends by itself "
                    f"after {left} without a change.")

    def end(self, code: str, token: str) -> None:
        """End the room: its runs, state and every poll's answers are deleted."""
        code = check_code(code)

        def tx(values: dict):
            _check_token(code, values[self._k(code, "auth")], token)
            s = _parse(code, values[self._k(code, "state")])
            polls = [p.id for p in s.past_polls] + ([s.poll.id] if s.poll else [])
            runs = [r for r in (s.run_id, s.prev_run_id) if r]
            gone = [*[self._k(code, "poll", i) for i in polls], *[self._k(code, "run", r) for r in runs],
                    *[self._k(code, k) for k in ("state", "ver", "polls", "auth", "live", "livever", "liveseq",
                                                   "steer")]]
            ended = ("set", self._k(code, "ended"), b"1", self.ttl)      # students told "ended", not "reconnecting"
            return [("del", *gone), ended], None
        self.b.update((self._k(code, "auth"), self._k(code, "state")), tx)

    def was_ended(self, code: str) -> bool:
        """Whether the teacher ended room `code` (a room the store lost, when Redis restarted empty, was not)."""
        return self.b.get(self._k(check_code(code), "ended"), 8) is not None

    def restore(self, code: str, token: str, *, view: View | None = None, run: bytes | None = None) -> RoomState:
        """Re-open a room the store lost (Redis restarted without its data) under the same code, from what
        the teacher's session holds: its publish token, view and run. Forbidden when the code now belongs to
        another room; NoRoom when the teacher ended it. A room still there is only published to."""
        code = check_code(code)
        if self.was_ended(code):
            raise NoRoom(f"room {code} has ended")
        self.b.check_keeps_keys()
        if not self.b.set(self._k(code, "auth"), _digest(token), self.ttl, only_new=True):
            self._authorize(code, token)
        ks, kv = self._k(code, "state"), self._k(code, "ver")
        self.b.update((ks, kv), lambda v: ([] if v[ks] is not None else [
            ("set", ks, RoomState(code, _count(v[kv]) + 1).as_json(), self.ttl),
            ("set", kv, str(_count(v[kv]) + 1).encode(), self.ttl)], None))
        log.info("room %s re-opened from its teacher's session", code)
        return self.publish(code, token, view=view, run=run)


# ---- the process's store ----------------------------------------------------------------------------
def voter_of(code: str, client: str) -> str:
    """The name a poll's answer is kept under: one per browser (inspector.ui.common.client_key) and room, never the
    browser's own token."""
    return hashlib.sha256(f"llmi-voter:{check_code(code)}:{client}".encode("utf-8", "surrogatepass")).hexdigest()[:32]


_stores: dict[tuple[str, int, int], RoomStore] = {}
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
    try:
        answers = int(env.get(ANSWERS_ENV, ROOM_ANSWERS))
        if not 1 <= answers <= MAX_VOTERS:
            raise ValueError
    except ValueError:
        raise RoomError(f"{ANSWERS_ENV} must be a whole number from 1 to {MAX_VOTERS}") from None
    with _stores_lock:
        if (url, ttl, answers) not in _stores:
            if not url:
                backend: Backend = MemoryBackend()
            else:
                try:
                    backend = RedisBackend.from_url(url)
                except ValueError as e:
                    raise RoomError(f"{STORE_ENV}: {e}") from None
            _stores[(url, ttl, answers)] = RoomStore(backend, ttl, max_answers=answers)
        return _stores[(url, ttl, answers)]
