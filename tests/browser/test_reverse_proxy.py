"""The reverse-proxy recipe of docs/CLASSROOM.md, run as written: scripts/serve.sh started from another folder,
nginx (Debian's) in front with TLS, a password and the WebSocket upgrade, all on 127.0.0.1. Without the
password nothing is served; with it the page loads and Streamlit's WebSocket opens through the proxy; a
Host name the app was not told about is refused (DNS rebinding)."""
from __future__ import annotations

import base64
import http.client
import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parents[2]
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def upgrade(conn: http.client.HTTPConnection, host: str, auth: str | None, keep: bool = False) -> int:
    """Ask for Streamlit's WebSocket; the HTTP status of the answer (101 = switched). keep: leave the
    connection open (a tab that stays)."""
    headers = {"Host": host, "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode(), "Origin": f"https://{host}"}
    if auth:
        headers["Authorization"] = auth
    conn.request("GET", "/_stcore/stream", headers=headers)
    status = conn.getresponse().status
    if not keep:
        conn.close()
    return status


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """serve.sh and the documented nginx in front, started once for this module's three tests (none of them
    needs a fresh server: each opens and closes its own connections)."""
    tmp_path = tmp_path_factory.mktemp("proxy")
    if NGINX is None:
        pytest.skip("nginx is not installed (scripts/setup.sh --test installs Debian's nginx-light)")
    app_port, proxy_port = free_port(), free_port()
    env = dict(os.environ, LLM_INSPECTOR_PORT=str(app_port), LLM_INSPECTOR_HOSTS="localhost")
    log = open(tmp_path / "app.log", "w")
    app = subprocess.Popen(["bash", str(ROOT / "scripts" / "serve.sh")], cwd=tmp_path, env=env, stdout=log,
                           stderr=subprocess.STDOUT)          # started from another folder on purpose
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost"], check=True, capture_output=True)
    hashed = subprocess.run(["openssl", "passwd", "-apr1", "s3cret"], check=True, capture_output=True, text=True)
    (tmp_path / "htpasswd").write_text(f"class:{hashed.stdout.strip()}\n")
    conf = (ROOT / "docs" / "nginx-llm-inspector.conf").read_text()
    # test-only prelude: a foreground nginx whose workers may read the test's private temporary folder
    prelude = (f"daemon off; user root; pid {tmp_path}/nginx.pid; error_log {tmp_path}/nginx-error.log;\n"
               f"events {{}}\nhttp {{\naccess_log off; client_body_temp_path {tmp_path}; proxy_temp_path {tmp_path};")
    for k, v in {"LISTEN": f"127.0.0.1:{proxy_port}", "CERT": cert, "KEY": key, "HTPASSWD": tmp_path / "htpasswd",
                 "UPSTREAM": f"127.0.0.1:{app_port}", "PRELUDE": prelude, "POSTLUDE": "}"}.items():
        conf = conf.replace("{{" + k + "}}", str(v))
    (tmp_path / "nginx.conf").write_text(conf)
    proxy = subprocess.Popen([NGINX, "-c", str(tmp_path / "nginx.conf"), "-p", str(tmp_path)],
                             stdout=subprocess.DEVNULL, stderr=open(tmp_path / "nginx.out", "w"))
    try:
        end = time.monotonic() + 120
        while True:
            assert app.poll() is None, (tmp_path / "app.log").read_text()[-2000:]
            assert proxy.poll() is None, (tmp_path / "nginx.out").read_text()[-2000:]
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{app_port}/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            assert time.monotonic() < end, "the app did not come up"
            time.sleep(0.5)
        yield app_port, proxy_port
    finally:
        for p in (proxy, app):
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()


def test_the_documented_proxy_serves_only_with_the_password_and_upgrades_the_websocket(served):
    app_port, proxy_port = served
    tls = ssl.create_default_context()
    tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE         # the test's own self-signed certificate
    good = "Basic " + base64.b64encode(b"class:s3cret").decode()
    bad = "Basic " + base64.b64encode(b"class:guess").decode()

    def https():
        return http.client.HTTPSConnection("127.0.0.1", proxy_port, context=tls, timeout=30)

    for auth in (None, bad):
        c = https()
        c.request("GET", "/", headers={"Host": "localhost", **({"Authorization": auth} if auth else {})})
        assert c.getresponse().status == 401
        c.close()
    c = https()
    c.request("GET", "/", headers={"Host": "localhost", "Authorization": good})
    r = c.getresponse()
    assert r.status == 200 and b"<title>" in r.read()
    c.close()
    assert upgrade(https(), "localhost", None) == 401
    assert upgrade(https(), "localhost", good) == 101                  # Streamlit's socket through the proxy
    direct = http.client.HTTPConnection("127.0.0.1", app_port, timeout=30)
    assert upgrade(direct, "rebound.attacker.example", None) != 101     # a host the app was not told about


def test_serve_sh_applies_the_safe_settings_from_any_folder(served, tmp_path):
    app_port, _ = served
    with urllib.request.urlopen(f"http://127.0.0.1:{app_port}/_stcore/host-config", timeout=10) as r:
        config = r.read().decode()
    assert "allowedOrigins" in config
    listening = subprocess.run(["ss", "-ltnH", f"sport = :{app_port}"], capture_output=True, text=True).stdout
    local = [line.split()[3] for line in listening.splitlines() if line.strip()]
    if local:                                   # the app listens on the loopback interface only
        assert all(addr.startswith("127.0.0.1:") for addr in local), local


def test_the_proxy_caps_open_connections_per_address(served):
    """Every tab is a session with its own memory budget, and a script can invent a browser per connection:
    the recipe's limit_conn bounds what one address holds open (24 connections), then answers 429."""
    _, proxy_port = served
    tls = ssl.create_default_context()
    tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
    good = "Basic " + base64.b64encode(b"class:s3cret").decode()

    def hold_24() -> tuple[list, list[int]]:
        held, statuses = [], []
        for _ in range(24):
            held.append(http.client.HTTPSConnection("127.0.0.1", proxy_port, context=tls, timeout=30))
            statuses.append(upgrade(held[-1], "localhost", good, keep=True))
            if statuses[-1] != 101:
                break
        return held, statuses

    # the proxy is the module's: an earlier test's connections may still be closing, which nginx counts until it
    # has seen them close; try again for up to 10 s when a place is refused before the 24th
    end = time.monotonic() + 10
    while True:
        held, statuses = hold_24()
        if statuses[-1] == 101 or time.monotonic() > end:
            break
        for c in held:
            c.close()
        time.sleep(0.2)
    try:
        assert statuses == [101] * 24, f"fewer than 24 connections were let through for 10 s: {statuses}"
        one_more = http.client.HTTPSConnection("127.0.0.1", proxy_port, context=tls, timeout=30)
        assert upgrade(one_more, "localhost", good) == 429
    finally:
        for c in held:
            c.close()
    # closed tabs free their places (nginx sees each close a moment later: ask again until it has, up to 10 s)
    end, status = time.monotonic() + 10, None
    while status != 101 and time.monotonic() < end:
        status = upgrade(http.client.HTTPSConnection("127.0.0.1", proxy_port, context=tls, timeout=30), "localhost",
                         good)
        if status != 101:
            time.sleep(0.1)
    assert status == 101, f"10 s after the 24 connections closed, a new one was still answered {status}"


def test_serve_sh_bounds_uploads_by_the_session_budget(tmp_path):
    """Streamlit's upload limit is half of a session's data allowance (inspector.session.budget), whatever the
    budget; a malformed budget falls back to the default, as the app does."""
    from inspector.session.budget import trace_file_limit
    from inspector.session.limits import Limits
    for mb, want in (("64", 25), ("400", 160), ("1_000", 400), ("lots", 160)):
        env = dict(os.environ, PYTHON="echo", LLM_INSPECTOR_MAX_SESSION_MB=mb)
        out = subprocess.run(["bash", str(ROOT / "scripts" / "serve.sh")], cwd=tmp_path, env=env, text=True,
                             capture_output=True, check=True).stdout.split()
        got = int(out[out.index("--server.maxUploadSize") + 1])
        assert got == want, (mb, got)
        budget = Limits(max_session_mb=int(mb.replace("_", ""))) if mb != "lots" else Limits()
        assert got * 2**20 <= trace_file_limit(budget)
