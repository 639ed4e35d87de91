"""Rooms kept in Redis, so that several app processes (behind a load balancer) share them: a Backend for
inspector.session.rooms.RoomStore over redis-py (its connection pool, timeouts, `unix://` URLs, pipelines and
WATCH/MULTI transactions).

Every read is bounded by the caller, never by what the store holds: a value is read with
`GETRANGE key 0 limit` (at most limit + 1 bytes come back, so a value over its limit is seen as such without
reading it), and a poll's answers are read by a server-side script that returns at most `max_items` values
of at most `max_len` bytes each. A wrong or hostile store cannot make the app allocate without limit.

Updates that read before they write (a room's state document, and its version) are one WATCH/MULTI
transaction (`update`): two publishes at once (two tabs, two processes) both land, the second retried on the
first's result. A poll's answer is one script (the count checked and the answer added at once).

Every call is on a page's path (a student's rerun waits for it), so a store that does not answer fails fast:
`timeout` (0.5 s) bounds the connect and each wait for a reply, a timeout is never retried, and for
`cooldown_s` after one every call fails at once with the same message (a hung store costs a page one wait,
not one per call). A connection that broke (Redis restarted: every pooled connection is dead) empties the
pool of its idle connections and the call is tried once more on a fresh one (every call used here is harmless
to repeat). A failure never closes a connection another thread is using: that thread meets its own failure
(closing it under a reader made its call fail with "I/O operation on closed file", crashing a page). Failures
that a later call may not meet (no answer in time, no connection) are `Unreachable`: a page says the store
does not answer and tries again when it does.

Rooms need a store that never evicts keys: with `maxmemory` and an eviction policy, Redis may drop a live
room's keys, its teacher's authorisation included. `check_keeps_keys` refuses such a store (RoomStore calls
it before it starts or re-opens a room).

URLs: `redis://[[user]:password@]host[:port][/db]` and `unix:///path/to/redis.sock[?db=N][&password=…]`.
"""
from __future__ import annotations

import logging
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

TIMEOUT_S = 0.5          # connect, and each wait for a reply: a local Redis answers in well under a millisecond
COOLDOWN_S = 2.0         # after a timeout, calls fail at once for this long
SEND_RATE = 20 << 20     # bytes a second a slow link still manages: a large run's write gets its time on top
DEFAULT_LIMIT = 1 << 20  # a value read without a limit of its own (state documents are a few KiB)
MAX_BULK = 128 << 20    # the largest value written (a room's run: rooms_state.MAX_RUN_BYTES)
log = logging.getLogger("llm_inspector")
MAX_RETRIES = 200        # an update that meets a concurrent writer is tried again, at most this often

# A poll's answers: at most ARGV[1] values of at most ARGV[2] bytes (the rest skipped), read on the server.
_HVALS_BOUNDED = """
local out, vals = {}, redis.call('HVALS', KEYS[1])
for i = 1, math.min(#vals, tonumber(ARGV[1])) do
  if string.len(vals[i]) <= tonumber(ARGV[2]) then out[#out + 1] = vals[i] end
end
return out"""
# One field's value if it is at most ARGV[2] bytes long (else nothing), read on the server.
_HGET_BOUNDED = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if v and string.len(v) <= tonumber(ARGV[2]) then return v end
return false"""
# One answer: refused (-1) when the poll holds ARGV[4] answers already; else HSETNX, and the key lives on.
_HSETNX_BOUNDED = """
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[4]) and redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then
  return -1
end
local added = redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return added"""


class RedisError(Exception):
    """Redis answered with an error, or could not be reached (the message says which)."""


class Unreachable(RedisError):
    """The store did not answer in time or could not be reached: a later call may succeed."""


class Full(RedisError):
    """A bounded hash (a poll) holds as many fields as it may."""


def _ttl(ttl) -> int:
    return max(1, int(ttl))


class RedisBackend:
    """The RoomStore Backend in Redis (see inspector.session.rooms_memory.Backend)."""

    def __init__(self, address, *, password: str | None = None, user: str | None = None, db: int = 0,
                 timeout: float = TIMEOUT_S, cooldown_s: float = COOLDOWN_S, clock=time.monotonic,
                 max_connections: int = 256) -> None:
        where = {"unix_socket_path": address} if isinstance(address, str) else {"host": address[0],
                                                                                "port": address[1]}
        self.address, self.timeout, self.cooldown_s = address, timeout, cooldown_s
        self.client = redis.Redis(**where, db=db, password=password, username=user, socket_timeout=timeout,
                                  socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0),
                                  max_connections=max_connections, lib_name=None, lib_version=None,
                                  health_check_interval=0)
        self._clock = clock
        self._silent_until = 0.0          # a timeout was met: until then, calls fail at once
        self._bulk: redis.Redis | None = None
        self._hvals = self.client.register_script(_HVALS_BOUNDED)
        self._hsetnx = self.client.register_script(_HSETNX_BOUNDED)
        self._hget = self.client.register_script(_HGET_BOUNDED)

    @classmethod
    def from_url(cls, url: str, **kw) -> "RedisBackend":
        """ValueError for a URL this client does not read (the message says what is expected)."""
        try:
            u = redis.connection.parse_url(url)
            kind = u.get("connection_class")
            if kind is redis.connection.UnixDomainSocketConnection:
                if not u.get("path"):
                    raise ValueError
                address = u["path"]
            elif kind is not None:          # rediss:// (TLS): not offered
                raise ValueError
            else:
                address = (u.get("host") or "127.0.0.1", int(u.get("port") or 6379))
            db = int(u.get("db") or 0)
        except (ValueError, TypeError):
            raise ValueError("expected redis://[[user]:password@]host[:port][/db] or unix:///path/redis.sock"
                             "[?db=N]") from None
        return cls(address, password=u.get("password"), user=u.get("username"), db=db, **kw)

    @property
    def pool(self) -> redis.ConnectionPool:
        return self.client.connection_pool

    def call(self, f, *, send: int = 0):
        """Run f(client). A timeout fails at once (and the next calls, for cooldown_s); a broken connection
        closes the pool's idle connections (its siblings broke with it) and f is tried once more on a fresh
        one. `send`: bytes f writes (a large run gets time to travel on top of the timeout)."""
        if self._clock() < self._silent_until:
            raise Unreachable(self._silent_message())
        for attempt in (0, 1):
            try:
                if send > SEND_RATE // 10:
                    return f(self._slow_client(send))
                return f(self.client)
            except redis.TimeoutError:
                self._silent_until = self._clock() + self.cooldown_s
                self._drop_idle()            # redis-py closed the connection that timed out
                raise Unreachable(self._silent_message()) from None
            except redis.ConnectionError as e:
                self._drop_idle()
                if attempt:
                    raise Unreachable(f"the room store (Redis) cannot be reached: {e}") from None
            except redis.WatchError:
                raise
            except redis.RedisError as e:        # an error reply (WRONGTYPE, NOAUTH, NOSCRIPT, OOM ...)
                raise RedisError(f"the room store (Redis) failed: {str(e)[:200]}") from None

    def _slow_client(self, nbytes: int) -> redis.Redis:
        """A client for large writes (a run's trace bytes): its own small pool, whose connections wait as long as
        the largest run allowed (MAX_BULK) takes to travel."""
        if self._bulk is None:
            kw = dict(self.pool.connection_kwargs, socket_timeout=self.timeout + MAX_BULK / SEND_RATE)
            self._bulk = redis.Redis(connection_pool=redis.ConnectionPool(
                connection_class=self.pool.connection_class, max_connections=8, **kw))
        return self._bulk

    def _silent_message(self) -> str:
        return (f"the room store (Redis) did not answer within {self.timeout:g} s; the room is not updated "
                f"(tried again in {self.cooldown_s:g} s)")

    def _drop_idle(self) -> None:
        """Close the pooled connections no thread is using (after a failure they are likely dead too)."""
        self.pool.disconnect(inuse_connections=False)
        if self._bulk is not None:
            self._bulk.connection_pool.disconnect(inuse_connections=False)

    def close(self) -> None:
        self.pool.disconnect()
        if self._bulk is not None:
            self._bulk.connection_pool.disconnect()

    # ---- the Backend ------------------------------------------------------------------------------------
    def get(self, key, limit: int = DEFAULT_LIMIT):
        """The value (None when there is none); at most limit + 1 bytes are read, so a longer value comes back
        longer than `limit`, cut: the caller refuses it."""
        v = self.call(lambda r: r.getrange(key, 0, limit))
        return v if isinstance(v, bytes) and v else None

    def set(self, key, value, ttl, only_new=False):
        return bool(self.call(lambda r: r.set(key, value, ex=_ttl(ttl), nx=only_new), send=len(value)))

    def delete(self, *keys):
        if keys:
            self.call(lambda r: r.delete(*keys))

    def expire(self, key, ttl):
        self.call(lambda r: r.expire(key, _ttl(ttl)))

    def incr(self, key, ttl):
        def f(r):
            p = r.pipeline(transaction=True)
            p.incr(key).expire(key, _ttl(ttl))
            return int(p.execute()[0])
        return self.call(f)

    def hsetnx(self, key, name, value, ttl, max_len: int = 1 << 31):
        """Add name: value unless name is there; Full when the hash holds max_len fields already."""
        n = self.call(lambda r: self._hsetnx(keys=[key], args=[name, value, _ttl(ttl), max_len], client=r))
        if n == -1:
            raise Full(f"{key} holds {max_len} fields")
        return n == 1

    def hvals(self, key, max_items: int, max_len: int) -> list[bytes]:
        return [v for v in self.call(lambda r: self._hvals(keys=[key], args=[max_items, max_len], client=r)) or []
                if isinstance(v, bytes)]

    def hget(self, key, name, max_len: int):
        v = self.call(lambda r: self._hget(keys=[key], args=[name, max_len], client=r))
        return v if isinstance(v, bytes) else None

    def hlen(self, key):
        return int(self.call(lambda r: r.hlen(key)))

    def update(self, keys, change, limit: int = DEFAULT_LIMIT, send: int = 0):
        """Atomically: read `keys` (bounded as get), ops, result = change({key: value}), apply ops (("set", key,
        value, ttl), ("del", *keys), ("expire", key, ttl)); retried when another writer changed a key first.
        `send`: about how many bytes the ops write (a run's)."""
        def f(r):
            with r.pipeline(transaction=True) as p:
                for _ in range(MAX_RETRIES):
                    try:
                        p.watch(*keys)
                        values = {k: (p.getrange(k, 0, limit) or None) for k in keys}
                        ops, result = change(values)
                        p.multi()
                        for op in ops:
                            _queue(p, op)
                        p.execute()
                        return result
                    except redis.WatchError:
                        continue
                    finally:
                        p.reset()
                raise RedisError(f"the room store (Redis) was changed {MAX_RETRIES} times during one update")
        return self.call(f, send=send)

    def check_keeps_keys(self) -> None:
        """RedisError unless this Redis keeps every key until it expires (maxmemory-policy noeviction, or no
        memory limit at all)."""
        try:
            info = self.call(lambda r: r.info("memory"))
        except RedisError as e:       # a user whose ACL forbids INFO: said loudly, not a reason to refuse
            if "NOPERM" not in str(e) and "unknown command" not in str(e):
                raise
            log.warning("rooms: cannot read this Redis's eviction policy (%s); make sure it runs with "
                        "maxmemory-policy noeviction, or a live room's keys may vanish", e)
            return
        policy, limit = str(info.get("maxmemory_policy", "noeviction")), int(info.get("maxmemory", 0) or 0)
        if policy != "noeviction":
            raise RedisError(
                f"the room store (Redis) may evict keys (maxmemory-policy {policy}"
                + (f", maxmemory {limit:,} bytes" if limit else ", with no maxmemory yet") + "): a live room's keys, "
                "its teacher's authorisation included, could vanish. Rooms are off until Redis runs with "
                "maxmemory-policy noeviction (docs/CLASSROOM.md)")

    def ping(self) -> bool:
        return bool(self.call(lambda r: r.ping()))


def _queue(p, op) -> None:
    kind, *args = op
    if kind == "set":
        key, value, ttl = args
        p.set(key, value, ex=_ttl(ttl))
    elif kind == "del":
        if args:
            p.delete(*args)
    elif kind == "expire":
        p.expire(args[0], _ttl(args[1]))
    else:
        raise ValueError(f"not a store operation: {kind!r}")
