"""Where a room is kept: the Backend protocol (a handful of key-value operations) and MemoryBackend, the
in-process store (one app process, the default); RedisBackend (rooms_redis.py) is the other. RoomStore
(inspector.session.rooms) holds every rule; a backend only stores."""
from __future__ import annotations

import threading
import time
from typing import Protocol

SWEEP_S = 60.0                   # the in-process store drops every expired key at most this often


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

    def get(self, key):
        with self._lock:
            v = self._live(key)
            return v if isinstance(v, bytes) else None

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
