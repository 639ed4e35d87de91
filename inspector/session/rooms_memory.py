"""Where a room is kept: the Backend protocol (a handful of key-value operations) and MemoryBackend, the
in-process store (one app process, the default); RedisBackend (rooms_redis.py) is the other. RoomStore
(inspector.session.rooms) holds every rule; a backend only stores."""
from __future__ import annotations

import threading
import time
from typing import Callable, Protocol

from .rooms_redis import DEFAULT_LIMIT, Full

SWEEP_S = 60.0                   # the in-process store drops every expired key at most this often


Op = tuple    # ("set", key, value, ttl) | ("del", *keys) | ("expire", key, ttl)


class Backend(Protocol):
    """The storage a RoomStore needs: bytes under string keys, each key with a time to live (seconds). Every read
    is bounded by its caller (`limit` bytes, `max_items` values), and `update` is the one way to read and then
    write: atomic, whoever else writes at the same time."""

    def get(self, key: str, limit: int = DEFAULT_LIMIT) -> bytes | None: ...   # at most limit + 1 bytes
    def set(self, key: str, value: bytes, ttl: int, only_new: bool = False) -> bool: ...
    def delete(self, *keys: str) -> None: ...
    def expire(self, key: str, ttl: int) -> None: ...
    def incr(self, key: str, ttl: int) -> int: ...
    def hsetnx(self, key: str, name: str, value: bytes, ttl: int, max_len: int = 1 << 31) -> bool: ...  # Full
    def hvals(self, key: str, max_items: int, max_len: int) -> list[bytes]: ...
    def hlen(self, key: str) -> int: ...
    def hget(self, key: str, name: str, max_len: int) -> bytes | None: ...   # None when absent or longer
    def update(self, keys: tuple[str, ...], change: Callable[[dict], tuple[list[Op], object]],
               limit: int = DEFAULT_LIMIT, send: int = 0) -> object: ...
    def check_keeps_keys(self) -> None: ...


class MemoryBackend:
    """In this process (the default): a dict under a lock; expired keys are dropped as they are met, and all of
    them every sweep_s (a room nobody reads again, its run included, would otherwise stay until the process
    ends)."""

    def __init__(self, clock=time.monotonic, sweep_s: float = SWEEP_S) -> None:
        self._d: dict[str, tuple[float, object]] = {}
        self._lock = threading.Lock()
        self._clock = clock
        self.sweep_s = sweep_s
        self._next_sweep = clock() + sweep_s

    def _sweep(self, now: float) -> None:
        """Called under the lock: at most once per sweep_s, every expired key goes (one pass over the keys)."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.sweep_s
        for k in [k for k, (until, _) in self._d.items() if until <= now]:
            del self._d[k]

    def __len__(self) -> int:
        with self._lock:
            return len(self._d)

    def _live(self, key: str):
        self._sweep(self._clock())
        item = self._d.get(key)
        if item is not None and item[0] <= self._clock():
            del self._d[key]
            return None
        return None if item is None else item[1]

    def get(self, key, limit=DEFAULT_LIMIT):
        with self._lock:
            v = self._live(key)
            return v[:limit + 1] if isinstance(v, bytes) and v else None

    def set(self, key, value, ttl, only_new=False):
        with self._lock:
            self._sweep(self._clock())
            if only_new and self._live(key) is not None:
                return False
            self._d[key] = (self._clock() + ttl, bytes(value))
            return True

    def delete(self, *keys):
        with self._lock:
            self._sweep(self._clock())
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

    def hsetnx(self, key, name, value, ttl, max_len=1 << 31):
        with self._lock:
            h = self._live(key)
            h = dict(h) if isinstance(h, dict) else {}
            if name in h:
                return False
            if len(h) >= max_len:
                raise Full(f"{key} holds {max_len} fields")
            h[name] = bytes(value)
            self._d[key] = (self._clock() + ttl, h)
            return True

    def hvals(self, key, max_items, max_len):
        with self._lock:
            h = self._live(key)
            vals = list(h.values())[:max_items] if isinstance(h, dict) else []
        return [v for v in vals if len(v) <= max_len]

    def hget(self, key, name, max_len):
        with self._lock:
            h = self._live(key)
            v = h.get(name) if isinstance(h, dict) else None
        return v if v is not None and len(v) <= max_len else None

    def hlen(self, key):
        with self._lock:
            h = self._live(key)
            return len(h) if isinstance(h, dict) else 0

    def update(self, keys, change, limit=DEFAULT_LIMIT, send=0):
        """Read `keys`, let change() say what to write, write it: all under the store's lock."""
        with self._lock:
            values = {}
            for k in keys:
                v = self._live(k)
                values[k] = v[:limit + 1] if isinstance(v, bytes) and v else None
            ops, result = change(values)
            now = self._clock()
            for kind, *args in ops:
                if kind == "set":
                    self._d[args[0]] = (now + args[2], bytes(args[1]))
                elif kind == "del":
                    for k in args:
                        self._d.pop(k, None)
                elif kind == "expire":
                    if self._live(args[0]) is not None:
                        self._d[args[0]] = (now + args[1], self._d[args[0]][1])
                else:
                    raise ValueError(f"not a store operation: {kind!r}")
            return result

    def check_keeps_keys(self) -> None:
        """This process's dict evicts nothing: keys go when their time is up."""

