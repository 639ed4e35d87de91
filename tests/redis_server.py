"""A private redis-server for tests (Debian's package): on a unix socket in a fresh temporary folder, no TCP
port, no disk writes; always stopped and its folder removed. Skips the test where the binary is missing.
Also a hung store: a TCP port that accepts connections and never answers."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from inspector.session.rooms_redis import RedisBackend, RedisError

REDIS = shutil.which("redis-server") or next((p for p in ("/usr/bin/redis-server",) if Path(p).exists()), None)


class RedisProcess:
    """One redis-server on `sock`; restart() stops it and starts a fresh, empty one on the same socket (what
    a Redis without persistence is after a restart)."""

    def __init__(self, tmp: str) -> None:
        self.tmp, self.sock = tmp, os.path.join(tmp, "redis.sock")
        self.url = f"unix://{self.sock}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([REDIS, "--port", "0", "--unixsocket", self.sock, "--unixsocketperm", "700",
                                      "--save", "", "--appendonly", "no", "--dir", self.tmp, "--daemonize", "no",
                                      "--loglevel", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 20
        while True:
            assert self.proc.poll() is None, "redis-server exited at start"
            try:
                if RedisBackend(self.sock, timeout=2).ping():
                    return
            except RedisError:
                pass
            assert time.monotonic() < end, "redis-server did not come up"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@contextmanager
def redis_process():
    """A RedisProcess, started; always stopped and its folder removed."""
    if REDIS is None:
        pytest.skip("redis-server is not installed (scripts/setup.sh --test installs Debian's redis-server)")
    r = RedisProcess(tempfile.mkdtemp(prefix="llmi-redis-"))
    try:
        r.start()
        yield r
    finally:
        r.stop()
        shutil.rmtree(r.tmp, ignore_errors=True)


@contextmanager
def redis_server():
    """A private redis-server on a unix socket in a fresh temporary folder (no TCP port, no disk writes);
    yields its URL; always stopped and its folder removed."""
    with redis_process() as r:
        yield r.url


@contextmanager
def hung_server():
    """A TCP port on 127.0.0.1 that accepts every connection and never answers (a store that hangs); yields
    its redis:// URL and the list of connections it accepted."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                pass
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        stop.set()
        t.join(5)
        for c in accepted:
            c.close()
        listener.close()
