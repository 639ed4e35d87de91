"""A private redis-server for tests (Debian's package): on a unix socket in a fresh temporary folder, no TCP
port, no disk writes; always stopped and its folder removed. Skips the test where the binary is missing."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from inspector.session.rooms_redis import RedisBackend, RedisError

REDIS = shutil.which("redis-server") or next((p for p in ("/usr/bin/redis-server",) if Path(p).exists()), None)


@contextmanager
def redis_server():
    """A private redis-server on a unix socket in a fresh temporary folder (no TCP port, no disk writes);
    yields its URL; always stopped and its folder removed."""
    if REDIS is None:
        pytest.skip("redis-server is not installed (scripts/setup.sh --test installs Debian's redis-server)")
    tmp = tempfile.mkdtemp(prefix="llmi-redis-")
    sock = os.path.join(tmp, "redis.sock")
    proc = subprocess.Popen([REDIS, "--port", "0", "--unixsocket", sock, "--unixsocketperm", "700", "--save", "",
                             "--appendonly", "no", "--dir", tmp, "--daemonize", "no", "--loglevel", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 20
        while True:
            assert proc.poll() is None, "redis-server exited at start"
            try:
                if RedisBackend(sock).ping():
                    break
            except RedisError:
                pass
            assert time.monotonic() < end, "redis-server did not come up"
            time.sleep(0.05)
        yield f"unix://{sock}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
