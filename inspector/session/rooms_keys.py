"""The teacher key and the rate limits on guesses (inspector.session.rooms uses them): rooms are on only with a
key of at least MIN_KEY_CHARS characters in $LLM_INSPECTOR_TEACHER_KEY; the right key is always accepted; only
wrong keys are counted, per client, with no total a student can fill. Nothing here knows Streamlit."""
from __future__ import annotations

import hmac
import os
import secrets
import sys
import threading
import time

KEY_ENV = "LLM_INSPECTOR_TEACHER_KEY"
MIN_KEY_CHARS = 16               # a key a class cannot guess at any rate: no limit on tries has to protect it
GENERATE_KEY = 'python3 -c "import secrets; print(secrets.token_urlsafe(18))"'


def suggest_key() -> str:
    """A fresh teacher key: 24 characters, 144 random bits."""
    return secrets.token_urlsafe(18)


def teacher_key_state(env=os.environ) -> str | None:
    """None when the room feature is on; otherwise why not (said to the user, naming the variable). Shown in
    any browser, so it never holds a key: the server's log has the suggested one (warn_short_key)."""
    key = env.get(KEY_ENV, "")
    if not key:
        return f"Rooms are off on this server. To turn them on, start the app with {KEY_ENV} set to a secret."
    if len(key) < MIN_KEY_CHARS:
        return (f"Rooms are off: {KEY_ENV} is too short; a teacher key has at least {MIN_KEY_CHARS} characters. "
                f"The server's log suggests one, or make one with {GENERATE_KEY}.")
    return None


_warned: set[str] = set()


def warn_short_key(env=os.environ) -> str | None:
    """Once per process, when the key is set but too short: print why and a generated key to the server's
    console (where the teacher started it, which no student reads). The line printed, or None."""
    key = env.get(KEY_ENV, "")
    if not key or len(key) >= MIN_KEY_CHARS or "short" in _warned:
        return None
    _warned.add("short")
    line = (f"llm-inspector: rooms are off: {KEY_ENV} has {len(key)} characters, a teacher key needs at least "
            f"{MIN_KEY_CHARS}. For example, restart with {KEY_ENV}='{suggest_key()}'")
    print(line, file=sys.stderr, flush=True)
    return line


def teacher_key_ok(entered, env=os.environ) -> bool:
    key = env.get(KEY_ENV, "")
    if teacher_key_state(env) is not None or not isinstance(entered, str) or len(entered) > 1024:
        return False
    return hmac.compare_digest(entered.encode("utf-8", "surrogatepass"), key.encode("utf-8", "surrogatepass"))


class RateLimiter:
    """At most `limit` events per `window_s` for each key (and, if `total` is set, for all keys together).
    At most `max_keys` keys are remembered: past that, the one whose last event is oldest is forgotten (a
    script inventing a client per try grows nothing)."""

    def __init__(self, limit: int, total: int | None = None, window_s: float = 60.0, clock=time.monotonic,
                 max_keys: int = 10_000) -> None:
        self.limit, self.total, self.window, self.clock, self.max_keys = limit, total, window_s, clock, max_keys
        self._events: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def _prune(self, now: float) -> None:
        for k in list(self._events):
            self._events[k] = [t for t in self._events[k] if now - t < self.window]
            if not self._events[k]:
                del self._events[k]

    def over(self, key: str) -> bool:
        """Whether key (or everyone, with a total) is at the limit now; records nothing."""
        now = self.clock()
        with self._lock:
            self._prune(now)
            return len(self._events.get(key, [])) >= self.limit or (
                self.total is not None and sum(map(len, self._events.values())) >= self.total)

    def allow(self, key: str) -> bool:
        """Record one event for key; False (not recorded) when key or everyone is over the limit."""
        now = self.clock()
        with self._lock:
            self._prune(now)
            mine = self._events.pop(key, [])
            if len(mine) >= self.limit or (self.total is not None
                                           and sum(map(len, self._events.values())) + len(mine) >= self.total):
                if mine:
                    self._events[key] = mine
                return False
            self._events[key] = mine + [now]            # re-inserted: dict order is the order of last events
            while len(self._events) > self.max_keys:
                del self._events[next(iter(self._events))]
            return True


failed_joins = RateLimiter(limit=10, total=200)      # unknown codes tried, per browser / this process
failed_keys = RateLimiter(limit=5)                   # wrong teacher keys, per browser: no total a student can fill


def teacher_login(entered, who: str, env=os.environ, wrong: RateLimiter = failed_keys) -> str | None:
    """A session asks to be the teacher with key `entered`, from client `who`. None: accepted. Otherwise the
    refusal to show. The right key is always accepted, whoever else tried what; only wrong keys are counted,
    per client (five a minute), so nobody can use up the teacher's tries."""
    if teacher_key_ok(entered, env):
        return None
    if not wrong.allow(who):
        return "Too many wrong keys from this browser: wait a minute."
    return "That is not the teacher key: refused."
