"""Rooms kept in Redis, so that several app processes (behind a load balancer) share them: a Backend for
inspector.session.rooms.RoomStore over a minimal client of Redis's protocol (RESP2) on a plain socket.

Only what a RoomStore needs: GET, SET (EX, NX), DEL, EXPIRE, INCR, HSETNX, HGETALL, HLEN, plus AUTH, SELECT and
PING. No extra package: the protocol is a few lines, and a small client is easy to bound — every reply is
size-checked before it is read (a bulk string of at most `max_bulk` bytes, arrays of at most 100,000 items), so
a wrong or hostile server cannot make the app allocate without limit. Connections are pooled (one per
concurrent caller, a few kept idle).

Every call is on a page's path (a student's rerun waits for it), so a store that does not answer fails fast:
`timeout` (0.5 s) bounds the connect and each wait for a reply, a timeout is never retried, and for
`cooldown_s` after one every call fails at once with the same message (a hung store costs a page one wait,
not one per call). A connection that broke (Redis restarted: every pooled connection is dead) empties the
pool and the command is tried once more on a fresh connection (every command used here is harmless to
repeat).

URLs: `redis://[[user]:password@]host[:port][/db]` and `unix:///path/to/redis.sock[?db=N][&password=…]`.
"""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from urllib.parse import parse_qs, unquote, urlsplit

MAX_ARRAY = 100_000
TIMEOUT_S = 0.5          # connect, and each wait for a reply: a local Redis answers in well under a millisecond
COOLDOWN_S = 2.0         # after a timeout, calls fail at once for this long
SEND_RATE = 20 << 20     # bytes a second a slow link still manages: a large run's send gets its time on top


class RedisError(Exception):
    """Redis answered with an error, or could not be reached (the message says which)."""


def encode(*args) -> bytes:
    """One command in RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def read_reply(f, max_bulk: int):
    """One reply from a binary file-like object: bytes, int, str (a status), None, list; RedisError for
    an error reply. Sizes are checked before anything is read."""
    line = f.readline(64 * 1024)
    if not line.endswith(b"\r\n"):
        raise ConnectionError("the connection closed in the middle of a reply")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest.decode("utf-8", "replace")
    if kind == b"-":
        raise RedisError(rest.decode("utf-8", "replace")[:200])
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        if n > max_bulk:
            raise ConnectionError(f"a reply of {n:,} bytes is more than this client accepts ({max_bulk:,})")
        data = f.read(n + 2)
        if len(data) != n + 2:
            raise ConnectionError("the connection closed in the middle of a reply")
        return data[:-2]
    if kind == b"*":
        n = int(rest)
        if n < 0:
            return None
        if n > MAX_ARRAY:
            raise ConnectionError(f"an array of {n:,} items is more than this client accepts")
        return [read_reply(f, max_bulk) for _ in range(n)]
    raise ConnectionError(f"not a Redis reply: {line[:40]!r}")


class Connection:
    def __init__(self, address, password: str | None, user: str | None, db: int, timeout: float) -> None:
        self.timeout = timeout
        family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
        if family == socket.AF_INET:
            self.sock = socket.create_connection(address, timeout=timeout)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(address)
        self.f = self.sock.makefile("rb")
        if password is not None:
            self.call(1024, *(["AUTH", user, password] if user else ["AUTH", password]))
        if db:
            self.call(1024, "SELECT", db)

    def call(self, max_bulk: int, *args):
        data = encode(*args)
        if len(data) > SEND_RATE // 10:          # sendall's timeout bounds the whole send, not each chunk
            self.sock.settimeout(self.timeout + len(data) / SEND_RATE)
        try:
            self.sock.sendall(data)
        finally:
            if len(data) > SEND_RATE // 10:
                self.sock.settimeout(self.timeout)
        return read_reply(self.f, max_bulk)

    def close(self) -> None:
        try:
            self.f.close()
            self.sock.close()
        except OSError:
            pass


class RedisBackend:
    """The RoomStore Backend in Redis (see inspector.session.rooms.Backend)."""

    def __init__(self, address, *, password: str | None = None, user: str | None = None, db: int = 0,
                 timeout: float = TIMEOUT_S, max_bulk: int = 160 << 20, max_idle: int = 8,
                 cooldown_s: float = COOLDOWN_S, clock=time.monotonic) -> None:
        self.address, self.password, self.user, self.db = address, password, user, db
        self.timeout, self.max_bulk, self.max_idle, self.cooldown_s = timeout, max_bulk, max_idle, cooldown_s
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._clock = clock
        self._silent_until = 0.0          # a timeout was met: until then, calls fail at once

    @classmethod
    def from_url(cls, url: str, **kw) -> "RedisBackend":
        """ValueError for a URL this client does not read (the message says what is expected)."""
        u = urlsplit(url)
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        try:
            if u.scheme in ("redis", "tcp"):
                db = int((u.path or "/0").strip("/") or 0)
                address = (u.hostname or "127.0.0.1", u.port or 6379)
                password = None if u.password is None else unquote(u.password)
                user = unquote(u.username) if u.username else None
            elif u.scheme in ("unix", "redis+unix") and u.path:
                db, address = int(q.get("db", 0)), u.path
                password, user = q.get("password"), q.get("user")
            else:
                raise ValueError
        except ValueError:
            raise ValueError("expected redis://[[user]:password@]host[:port][/db] or unix:///path/redis.sock"
                             "[?db=N]") from None
        return cls(address, password=password, user=user, db=db, **kw)

    @contextmanager
    def _conn(self, fresh: bool = False):
        conn = None
        if not fresh:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
        try:
            conn = conn or Connection(self.address, self.password, self.user, self.db, self.timeout)
        except TimeoutError:
            raise
        except OSError as e:
            raise RedisError(f"the room store (Redis) cannot be reached: {e.strerror or e}") from None
        ok = False
        try:
            yield conn
            ok = True
        finally:
            with self._lock:
                if ok and len(self._idle) < self.max_idle:
                    self._idle.append(conn)
                    conn = None
            if conn is not None:
                conn.close()

    def call(self, *args):
        """One command. A timeout fails at once (and the next calls, for cooldown_s); a broken connection
        empties the pool (its siblings broke with it) and the command is tried once more on a fresh one."""
        if self._clock() < self._silent_until:
            raise RedisError(self._silent_message())
        for attempt in (0, 1):
            try:
                with self._conn(fresh=attempt == 1) as conn:
                    return conn.call(self.max_bulk, *args)
            except TimeoutError:
                self._silent_until = self._clock() + self.cooldown_s
                self.close()
                raise RedisError(self._silent_message()) from None
            except (OSError, ValueError) as e:        # ConnectionError is an OSError; ValueError: a bad length
                self.close()
                if attempt:
                    raise RedisError(f"the room store (Redis) failed: {e}") from None

    def _silent_message(self) -> str:
        return (f"the room store (Redis) did not answer within {self.timeout:g} s; the room is not updated "
                f"(tried again in {self.cooldown_s:g} s)")

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    # ---- the Backend ------------------------------------------------------------------------------------
    def get(self, key):
        v = self.call("GET", key)
        return v if isinstance(v, bytes) else None

    def set(self, key, value, ttl, only_new=False):
        return self.call("SET", key, value, "EX", max(1, int(ttl)), *(["NX"] if only_new else [])) == "OK"

    def delete(self, *keys):
        if keys:
            self.call("DEL", *keys)

    def expire(self, key, ttl):
        self.call("EXPIRE", key, max(1, int(ttl)))

    def incr(self, key, ttl):
        n = self.call("INCR", key)
        self.call("EXPIRE", key, max(1, int(ttl)))
        return int(n)

    def hsetnx(self, key, name, value, ttl):
        added = self.call("HSETNX", key, name, value) == 1
        self.call("EXPIRE", key, max(1, int(ttl)))
        return added

    def hgetall(self, key):
        items = self.call("HGETALL", key) or []
        return {items[i].decode("utf-8", "replace"): items[i + 1] for i in range(0, len(items) - 1, 2)
                if isinstance(items[i], bytes) and isinstance(items[i + 1], bytes)}

    def hlen(self, key):
        return int(self.call("HLEN", key))

    def ping(self) -> bool:
        return self.call("PING") == "PONG"
