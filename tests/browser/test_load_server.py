"""Safe serving, and a load test of the real server: `streamlit run app.py` on 127.0.0.1 with a tiny model, and
several headless Chromium tabs typing a prompt and pressing Run at once. Every tab's output equals its
single-user output; tabs that find the run slots busy see their place in the queue; when the tabs close,
their sessions' runs are released and the server's memory stays bounded over a second round."""
from __future__ import annotations

import os
import re
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from streamlit.testing.v1 import AppTest

from engine import RunSettings
from inspector.session.run import inspect_run
from tests.helpers import open_generation_settings, streamlit_server
from tests.st_client import AppClient

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--disable-quic", "--disable-sync"]
TABS = int(os.environ.get("LLM_INSPECTOR_LOAD_TABS", "6"))      # browser sessions per round
LONG, SHORT = 128, 8                                            # new tokens: two long runs hold the slots
TIMEOUT_S = 240                                                 # for one round, however slow the machine


# ---- configuration and code: localhost, XSRF, models only from the list, nothing unpickled ---------------------

def test_config_serves_localhost_with_xsrf_on():
    cfg = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    server = cfg["server"]
    assert server["address"] == "127.0.0.1"
    assert server["enableXsrfProtection"] is True and server["enableCORS"] is True
    assert server.get("enableAgentApi", False) is False
    assert server["fileWatcherType"] == "none"          # no source watching after every script run
    assert cfg["client"]["showErrorDetails"] in ("type", "none")
    doc = (ROOT / "docs" / "CLASSROOM.md").read_text()
    assert "--server.address 0.0.0.0" in doc and "--server.port" in doc and "LLM_INSPECTOR_MODEL_ROOTS" in doc


def test_nothing_in_the_app_unpickles():
    pattern = re.compile(r"\bimport (c?pickle|dill|joblib|shelve|marshal)\b|\bfrom (c?pickle|dill|joblib|shelve)\b"
                         r"|torch\.load\(|pickle\.loads?\(|allow_pickle\s*=\s*True|weights_only\s*=\s*False")
    files = [ROOT / "app.py", *sorted((ROOT / "engine").rglob("*.py")), *sorted((ROOT / "inspector").rglob("*.py")),
             *sorted((ROOT / "pages").rglob("*.py"))]
    hits = [f"{f.relative_to(ROOT)}:{n}" for f in files for n, line in enumerate(f.read_text().splitlines(), 1)
            if pattern.search(line)]
    assert hits == []


def _choose_and_load(injected: str):
    """An app page that puts a browser-chosen value into the model selectbox's state and loads the model."""
    import streamlit as st  # AppTest.from_function runs this body alone

    from inspector.ui.common import get_model
    st.session_state["sb_model"] = injected
    model = get_model()
    st.write(f"loaded: {model.path}")


def test_browser_cannot_make_the_server_load_a_path(monkeypatch, tmp_path, tiny_model_dir):
    """The sidebar offers labels from model_choices only; a forged value, even the path of a real model
    outside the roots, falls back to the server default and is never loaded."""
    import shutil

    from inspector.session import models as common
    outside = tmp_path / "outside"
    shutil.copytree(tiny_model_dir, outside)
    root = tmp_path / "root"
    shutil.copytree(tiny_model_dir, root / "allowed")
    (root / "not-a-model").mkdir()
    monkeypatch.setenv("LLM_INSPECTOR_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("LLM_INSPECTOR_MODEL_ROOTS", str(root))
    common.model_choices.clear()
    labels = list(common.model_choices())
    assert labels[:2] == [f"{tiny_model_dir.name} (server default)", common.BUNDLED]
    assert "allowed (server models)" in labels and not any(str(root) in x for x in labels)
    assert not any("not-a-model" in x or "outside" in x for x in labels)
    loaded = []
    real = common.load_model
    monkeypatch.setattr(common, "load_model", lambda source, **kw: loaded.append(str(source)) or real(source, **kw))
    common.shared_model.clear()
    for injected in [str(outside), str(outside / "config.json"), "../../../etc", "/etc/passwd", "org/name"]:
        at = AppTest.from_function(_choose_and_load, args=(injected,), default_timeout=120)
        at.run()
        assert not at.exception, at.exception
        assert at.markdown[0].value == f"loaded: {tiny_model_dir}"
    assert loaded == [str(tiny_model_dir)]                        # loaded once, shared, nothing else


# ---- the live server --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    log = tmp_path_factory.mktemp("server") / "streamlit.log"
    env = dict(os.environ, LLM_INSPECTOR_MODEL=str(tiny_model_dir), LLM_INSPECTOR_MAX_CONCURRENT_RUNS="2",
               LLM_INSPECTOR_MAX_QUEUE="16", LLM_INSPECTOR_MAX_NEW_TOKENS="128", LLM_INSPECTOR_MAX_RUNS_KEPT="1",
               LLM_INSPECTOR_MODEL_ROOTS="")
    with streamlit_server(env, log, "--server.disconnectedSessionTTL", "2", "--server.fileWatcherType", "none") as (
            url, proc):
        yield url, proc, log


def test_server_listens_on_localhost_only_with_xsrf(server):
    url, proc, _ = server
    listening = {c.laddr.ip for c in psutil.Process(proc.pid).net_connections("inet") if c.status == "LISTEN"}
    assert listening == {"127.0.0.1"}
    req = urllib.request.Request(url + "/_stcore/upload_file/session/file", data=b"x", method="PUT")
    with pytest.raises(urllib.error.HTTPError) as err:            # a forged upload without the XSRF token
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 403 and b"XSRF" in err.value.read()


def _open(browser, url: str, wait: bool = True):
    ctx = browser.new_context()                   # one context per tab: its own cookies, its own session
    page = ctx.new_page()
    page.sockets = []                             # its WebSocket connections (a second one: it reconnected)
    page.on("websocket", lambda ws: page.sockets.append(ws.url))
    page.route(re.compile(r"^(?!https?://127\.0\.0\.1[:/]).*"), lambda route: route.abort())   # nothing else
    page.goto(url, timeout=TIMEOUT_S * 1000, wait_until="commit")
    if wait:
        _ready(page)
    return ctx, page


def _ready(page) -> None:
    page.get_by_role("textbox", name="Prompt", exact=True).wait_for(timeout=TIMEOUT_S * 1000)


WATCH_QUEUE = """() => { window.__places = [];
  new MutationObserver(() => {
    const m = document.body.innerText.match(/You are number (\\d+) in the queue/);
    if (m) window.__places.push(Number(m[1]));
  }).observe(document.body, {subtree: true, childList: true, characterData: true}); }"""


def _set_max_new(page, n: int) -> None:
    open_generation_settings(page)
    box = page.get_by_label("Max new tokens", exact=True)
    box.fill(str(n))
    box.press("Enter")


def _runs_in_memory(url: str) -> int:
    """The server's footer count of runs in memory, as an observer's new session reads it (a protocol session,
    tests/st_client.py: a Chromium tab per look took 2-3 s)."""
    observer = AppClient(url, timeout_s=TIMEOUT_S)
    try:
        observer.wait_for(re.compile(r"\d+ runs in memory"), "the server's footer")
        return int(re.search(r"(\d+) runs in memory", observer.text()).group(1))
    finally:
        observer.close()


def _open_round(browser, url: str, tiny_model, tag: str) -> dict:
    """A round's tabs opened (side by side) and its single-user references computed: what a round prepares."""
    prompts = [f"Student {k} of round {tag}: explain attention in one line." for k in range(TABS)]
    n_new = [LONG, LONG] + [SHORT] * (TABS - 2)
    want = [inspect_run(tiny_model, RunSettings(prompt=p, max_new_tokens=n)).result.text for p, n in zip(prompts,
                                                                                                         n_new)]
    t0 = time.monotonic()
    tabs = [_open(browser, url, wait=False) for _ in range(TABS)]      # they load side by side
    for _, page in tabs:
        _ready(page)
    return {"tag": tag, "prompts": prompts, "n_new": n_new, "want": want, "tabs": tabs,
            "open_s": time.monotonic() - t0}


def _round(url: str, opened: dict) -> dict:
    """The round's tabs type their prompts and press Run one after the other; what each shows, then closed."""
    tag, prompts, n_new, tabs = opened["tag"], opened["prompts"], opened["n_new"], opened["tabs"]
    t0 = time.monotonic()
    end = time.monotonic() + TIMEOUT_S
    for (_ctx, page), prompt, n in zip(tabs, prompts, n_new):
        _set_max_new(page, n)
        box = page.get_by_role("textbox", name="Prompt", exact=True)
        box.fill(prompt)
        box.press("Control+Enter")
        page.evaluate(WATCH_QUEUE)                # every place in the queue this tab is shown
    # pressed one after the other: the two long runs take both slots, the short ones behind them queue
    for _ctx, page in tabs:
        page.get_by_role("button", name="Run", exact=True).click()
    done = set()
    while len(done) < TABS:
        assert time.monotonic() < end, f"round {tag}: only {sorted(done)} finished in {TIMEOUT_S} s"
        for k, (_ctx, page) in enumerate(tabs):
            if k in done:
                continue
            if page.get_by_text("Generated text", exact=True).count():
                done.add(k)
        time.sleep(0.05)
    t_run = time.monotonic() - t0
    places = {k: page.evaluate("() => window.__places") for k, (_, page) in enumerate(tabs)}
    waited = {k for k, (_, page) in enumerate(tabs)
              if page.get_by_text(re.compile(r"This run waited [0-9.]+ s in the queue")).count()}
    queued = {k: sorted(set(places[k]), reverse=True) for k in sorted(waited | {k for k in places if places[k]})}
    got = []
    for _ctx, page in tabs:
        assert not page.get_by_text(re.compile(r"Traceback|Error:|failed unexpectedly")).count()
        codes = page.locator('[data-testid="stMain"] [data-testid="stCode"] code')
        got.append(codes.nth(1).text_content())
    held = _runs_in_memory(url)                  # the observer's own session has no run
    for ctx, _ in tabs:
        ctx.close()
    return {"want": opened["want"], "got": got, "queued": queued, "held": held, "open_s": opened["open_s"],
            "run_s": t_run}


def _released(url: str) -> int:
    """Open and close observer sessions until the ended sessions' runs are gone (Streamlit keeps a closed tab's
    session for disconnectedSessionTTL = 2 s here, and drops expired ones on its next write)."""
    end = time.monotonic() + 60
    while (n := _runs_in_memory(url)) and time.monotonic() < end:
        time.sleep(1)
    return n


@pytest.fixture
def round_a(server, browser, tiny_model):
    """Round A's tabs opened before the test's turn alone (tests/alone.py): what it measures starts at the runs."""
    opened = _open_round(browser, server[0], tiny_model, "A")
    yield opened
    for ctx, _ in opened["tabs"]:
        ctx.close()                               # a no-op for the contexts the round closed


@pytest.mark.browser
@pytest.mark.alone          # its memory and delays: by itself (tests/alone.py)
def test_browser_sessions_at_once(server, browser, tiny_model, round_a):
    url, proc, log = server
    rss = []
    for tag in ("A", "B"):
        r = _round(url, round_a if tag == "A" else _open_round(browser, url, tiny_model, tag))
        bad = [(k, w[:80], g[:80]) for k, (g, w) in enumerate(zip(r["got"], r["want"]))
               if g.strip("\n") != w.strip("\n")]
        assert not bad, f"round {tag}: (tab, single-user text, the tab's text): {bad}"
        assert r["held"] == TABS                                # one run kept per open session
        assert r["queued"], "no tab saw its place in the queue"
        assert all(1 <= p <= TABS - 2 for places in r["queued"].values() for p in places)
        t0 = time.monotonic()
        assert _released(url) == 0                     # ended sessions' runs are gone
        rss.append(psutil.Process(proc.pid).memory_info().rss)
        print(f"round {tag}: {TABS} tabs opened in {r['open_s']:.0f} s, ran in {r['run_s']:.0f} s, queued "
              f"(tab: places shown) {r['queued']}, released in {time.monotonic() - t0:.0f} s, "
              f"rss {rss[-1] / 2**20:.0f} MiB")
    assert rss[1] - rss[0] < 150 * 2**20, f"server memory grew {(rss[1] - rss[0]) / 2**20:.0f} MiB in round B"
    assert proc.poll() is None
    assert "Traceback" not in log.read_text()
