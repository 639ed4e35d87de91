"""A room on one server: 30 sessions (each a browser of its own, with its own cookie) run a 1,024-token prompt and
then open Attention at 3 layers, Compare, the NaN doctor and Repetition, a step at a time in every session together,
as a class follows its teacher. The server's memory stays under weights + sessions × budget, no session sees
another's text, each session's tokens equal its single-user run, and one browser with 10 tabs delays the other
students by at most one run's time.

Of the thirty, TABS are Chromium tabs (each its own Playwright context) and the rest speak Streamlit's WebSocket
protocol without painting (tests/st_client.py): the server does the same work for each and sends each the same
page; in a class each laptop paints its own page, where here thirty tabs painting on the server's two cores took
six of the test's eight minutes (README, Tests). The Chromium tabs keep the browser's own path in the class. The
server is started as scripts/serve.sh starts it for a class (inspector.ui.serve).
A 4-layer random model keeps this inside CI's time on 2 cores; the paths are the ones the bundled model takes."""
from __future__ import annotations

import os
import re
import secrets
import time

import psutil
import pytest

from engine import RunSettings
from inspector.session.run import inspect_run
from tests.browser.test_load_server import TIMEOUT_S, _open, _ready, _set_max_new
from tests.helpers import RUNNING, streamlit_server, tiny_config, write_model_dir
from tests.st_client import AppClient

pytestmark = [pytest.mark.browser, pytest.mark.alone]      # its delays, schedule or memory: by itself (tests/alone.py)
SESSIONS = int(os.environ.get("LLM_INSPECTOR_ROOM_SESSIONS", "30"))
TABS = min(SESSIONS, int(os.environ.get("LLM_INSPECTOR_ROOM_TABS", "3")))     # of SESSIONS: Chromium tabs
BUSY = re.compile("Running|Computing")
BUDGET_MB, NEW = 64, 4
PAGES = ["Attention", "Compare runs", "NaN doctor", "Repetition"]


@pytest.fixture(scope="module")
def room(tmp_path_factory, tokenizer_files):
    d = write_model_dir(tmp_path_factory.mktemp("room") / "room-llama", tokenizer_files,
                        tiny_config(num_hidden_layers=4))
    log = tmp_path_factory.mktemp("room-log") / "streamlit.log"
    env = dict(os.environ, LLM_INSPECTOR_MODEL=str(d), LLM_INSPECTOR_MAX_CONCURRENT_RUNS="2",
               LLM_INSPECTOR_MAX_QUEUE="64", LLM_INSPECTOR_MAX_NEW_TOKENS="16", LLM_INSPECTOR_MAX_PROMPT_TOKENS="2048",
               LLM_INSPECTOR_MAX_RUNS_KEPT="1", LLM_INSPECTOR_MAX_SESSION_MB=str(BUDGET_MB),
               LLM_INSPECTOR_MODEL_ROOTS="", LLM_INSPECTOR_HUB_CACHE="off",
               # the ten-tab test opens ten sessions in one browser (its fair turns), past the default cap of 8
               LLM_INSPECTOR_MAX_SESSIONS_PER_CLIENT="12")
    # the shipped disconnectedSessionTTL (120 s): a tab whose connection drops under load gets its session back
    with streamlit_server(env, log, "--server.fileWatcherType", "none", classroom=True) as (url, proc):
        yield url, proc, log, d


def prompt_of(k: int, tok) -> str:
    """A prompt of exactly 1,024 tokens (the model's own tokenizer), different for every student."""
    words = [f"Student {k} asks:"] + [f"token{(k * 7919 + i) % 9973}" for i in range(2000)]
    text = " ".join(words)
    ids = tok.encode(text)[:1024]
    return tok.decode(ids)


def idle(page) -> None:
    """Wait until the app has processed what this tab sent (Streamlit's running indicator is gone)."""
    page.wait_for_timeout(300)
    end = time.monotonic() + TIMEOUT_S
    while page.locator(RUNNING).count() and time.monotonic() < end:
        page.wait_for_timeout(200)


def run_in(page, prompt: str) -> None:
    _set_max_new(page, NEW)
    idle(page)
    box = page.get_by_role("textbox", name="Prompt", exact=True)
    box.fill(prompt)
    box.press("Control+Enter")
    idle(page)
    assert box.input_value() == prompt


def seen(page) -> str:
    """What the tab shows, for a failure's message: its main area's text and how often it connected."""
    main = page.locator("[data-testid=stMain]").inner_text()[:600]
    return f"{len(getattr(page, 'sockets', []))} connection(s); main area: {main!r}"


def shown_texts(page) -> list[str]:
    """Every code block on the tab's main area once its run is shown and the page has settled (the prompt, the
    generated text, …): the heading alone may be on screen a moment before its code blocks, or during a rerun."""
    page.get_by_text("Generated text", exact=True).wait_for(timeout=TIMEOUT_S * 1000)
    codes = page.locator('[data-testid="stMain"] [data-testid="stCode"] code')
    end = time.monotonic() + 60
    while True:
        idle(page)
        if (codes.count() >= 2 and page.get_by_text("Generated text", exact=True).count()) \
                or time.monotonic() > end:
            break
    return [codes.nth(i).text_content().strip("\n") for i in range(codes.count())]


def visit(page, title: str) -> None:
    page.get_by_role("link", name=title, exact=True).first.click()
    page.get_by_role("heading").first.wait_for(timeout=TIMEOUT_S * 1000)
    page.wait_for_timeout(500)
    while page.get_by_text(re.compile("Running|Computing")).count():
        page.wait_for_timeout(250)


def exceptions(page) -> int:
    return page.locator('[data-testid="stException"]').count()


def press_run_in(tabs, pressed: bool = False) -> dict[int, float]:
    """Press Run in every tab at once (pressed: it was); the time each one's text appears."""
    t0, done = time.monotonic(), {}
    for _, page in tabs if not pressed else ():
        page.get_by_role("button", name="Run", exact=True).click()
    end = t0 + TIMEOUT_S
    while len(done) < len(tabs):
        assert time.monotonic() < end, f"only {sorted(done)} finished"
        for k, (_, page) in enumerate(tabs):
            if k not in done and (page.get_by_text("Generated text", exact=True).count()
                                  or page.get_by_text(re.compile("You already have")).count()):
                done[k] = time.monotonic() - t0
        time.sleep(0.05)
    return done


def tour(page) -> None:
    """Attention at three layers, Compare, the NaN doctor and Repetition, as a student would open them."""
    for title in PAGES:
        visit(page, title)
        assert not exceptions(page), title
        if title == "Attention":
            for layer in (1, 2, 3):
                page.get_by_label("Layer", exact=True).first.click()
                page.get_by_role("option", name=f"Layer {layer}", exact=True).click()
                page.wait_for_timeout(300)
                assert not exceptions(page), layer
        if title == "Compare runs":
            page.get_by_role("button", name="Compare", exact=True).click()
            page.get_by_text("First divergence", exact=True).wait_for(timeout=TIMEOUT_S * 1000)


def settle(page, what: str) -> None:
    """Wait until the tab shows a page heading and neither Streamlit's running state nor the app's 'Running' /
    'Computing' notes (a deadline that names what the tab was doing)."""
    page.get_by_role("heading").first.wait_for(timeout=TIMEOUT_S * 1000)
    end = time.monotonic() + TIMEOUT_S
    idle(page)
    while page.get_by_text(re.compile("Running|Computing")).count():
        assert time.monotonic() < end, f"{what}: still running or computing after {TIMEOUT_S} s; {seen(page)}"
        page.wait_for_timeout(250)


def settle_client(client, what: str) -> None:
    """settle() for a protocol student: its script runs have ended and the page shows no 'Running' / 'Computing'."""
    end = time.monotonic() + TIMEOUT_S
    client.wait_idle(what)
    while client.shows(BUSY):
        assert time.monotonic() < end, \
            f"{what}: still running or computing after {TIMEOUT_S} s; {client.text()[-400:]!r}"
        client.wait_idle(what)


def tour_all(pages, clients, on_settled) -> None:
    """The tour of tour(), a step at a time in every session at once (a class follows the teacher together): each
    step is started in every tab and client, then awaited in each; on_settled() after each one's step (the memory
    peak)."""
    def await_all(what: str) -> None:
        for k, page in enumerate(pages):
            settle(page, f"tab {k}, {what}")
            assert not exceptions(page), (k, what)
            on_settled()
        for k, client in enumerate(clients):
            settle_client(client, f"student {k}, {what}")
            assert not client.exceptions(), (k, what, client.exceptions())
            on_settled()

    for title in PAGES:
        for page in pages:
            page.get_by_role("link", name=title, exact=True).first.click()
        for client in clients:
            client.goto(title)
        if pages:
            pages[-1].wait_for_timeout(500)           # the last tab's script has started
        await_all(title)
        if title == "Attention":
            for layer in (1, 2, 3):
                for page in pages:
                    page.get_by_label("Layer", exact=True).first.click()
                    page.get_by_role("option", name=f"Layer {layer}", exact=True).click()
                for client in clients:
                    client.set("Layer", f"Layer {layer}")
                if pages:
                    pages[-1].wait_for_timeout(300)
                await_all(f"Attention layer {layer}")
        if title == "Compare runs":
            for page in pages:
                page.get_by_role("button", name="Compare", exact=True).click()
            for client in clients:
                client.click("Compare")
            for page in pages:
                page.get_by_text("First divergence", exact=True).wait_for(timeout=TIMEOUT_S * 1000)
                on_settled()
            for k, client in enumerate(clients):
                client.wait_for("First divergence", f"student {k}, Compare")
                on_settled()


def run_in_all(pages, clients, prompts) -> None:
    """run_in() in every session, a step at a time across them: each one's setting and prompt are sent before the
    previous one's rerun has ended (the server answers them together; the clients' through type_prompts while the
    tabs' settings are applied), and each is checked as in run_in (the tabs' boxes hold their prompts; the clients'
    prompts are checked on the run's page)."""
    for page in pages:
        _set_max_new(page, NEW)
    type_prompts(clients, prompts[len(pages):])
    for page in pages:
        idle(page)
    boxes = [page.get_by_role("textbox", name="Prompt", exact=True) for page in pages]
    for box, prompt in zip(boxes, prompts):
        box.fill(prompt)
        box.press("Control+Enter")
    for page, box, prompt in zip(pages, boxes, prompts):
        idle(page)
        assert box.input_value() == prompt


def press_run_all(tabs, clients) -> None:
    """press_run_in() for the tabs and the clients together: every Run pressed, then every text awaited."""
    for _, page in tabs:
        page.get_by_role("button", name="Run", exact=True).click()
    for client in clients:
        client.click("Run")
    press_run_in(tabs, pressed=True)
    for k, client in enumerate(clients):
        client.wait_for(re.compile("Generated text|You already have"), f"student {k}'s run", TIMEOUT_S)


def client_texts(client) -> list[str]:
    """shown_texts() of a protocol student: the main area's code blocks once its run's page has settled."""
    client.wait_for("Generated text")
    client.wait_idle("the run's page")
    return client.codes()


@pytest.fixture
def seated(room, browser):
    """What the test does not measure, done in its setup (beside the other workers' tests): each student's
    single-user text (the references), the teacher's check before class (the memory bound's base: the server with
    the model loaded and every page used once, on a short prompt: the modules a page imports on first use, torch's
    kernels and thread pools), and the thirty sessions opened with their prompts typed."""
    url, proc, log, model_dir = room
    from engine import load_model
    model = load_model(model_dir, device="cpu", dtype="float32")
    prompts = [prompt_of(k, model.tokenizer) for k in range(SESSIONS)]
    want = [inspect_run(model, RunSettings(prompt=p, max_new_tokens=NEW)).result.text.strip("\n") for p in prompts]
    teacher = _open(browser, url)
    run_in(teacher[1], "Hello, class.")
    press_run_in([teacher])
    tour(teacher[1])
    idle(teacher[1])
    rss0 = psutil.Process(proc.pid).memory_info().rss
    t0 = time.monotonic()
    tabs = [_open(browser, url, wait=False) for _ in range(TABS)]
    clients = [AppClient(url, timeout_s=TIMEOUT_S) for _ in range(SESSIONS - TABS)]
    for _, page in tabs:
        _ready(page)
    for k, client in enumerate(clients):
        client.wait_for("Run", f"student {k}'s first page")
        client.wait_idle(f"student {k}'s first page")
    t_open = time.monotonic()
    run_in_all([page for _, page in tabs], clients, prompts)
    print(f"room of {SESSIONS} ({TABS} Chromium tabs): {t_open - t0:.0f} s to open the sessions, "
          f"{time.monotonic() - t_open:.0f} s to type the prompts")
    yield prompts, want, rss0, tabs, clients
    for client in clients:
        client.close()
    for ctx, _ in tabs + [teacher]:
        ctx.close()


def test_a_room_of_thirty(room, seated):
    url, proc, log, model_dir = room
    prompts, want, rss0, tabs, clients = seated
    pages = [page for _, page in tabs]
    t_typed = time.monotonic()
    press_run_all(tabs, clients)
    t_runs = time.monotonic()
    shown_all = [shown_texts(page) for page in pages] + [client_texts(client) for client in clients]
    for k, shown in enumerate(shown_all):
        where = seen(pages[k]) if k < TABS else clients[k - TABS].text()[-400:]
        assert want[k] in shown, (k, want[k], shown, where)                   # its own single-user tokens
        assert prompts[k] in "".join(shown).replace("\u23ce", ""), k         # its own prompt (\u23ce marks a newline)
        assert not any(w in shown for j, w in enumerate(want) if j != k and w != want[k]), k   # nobody else's
    t_checked = time.monotonic()
    peaks = [psutil.Process(proc.pid).memory_info().rss]
    tour_all(pages, clients, lambda: peaks.append(psutil.Process(proc.pid).memory_info().rss))
    peak = max(peaks)
    t_end = time.monotonic()
    bound = rss0 + SESSIONS * BUDGET_MB * 2**20
    print(f"room of {SESSIONS}: server RSS {rss0 / 2**20:.0f} MiB before, peak {peak / 2**20:.0f} MiB (bound "
          f"{bound / 2**20:.0f} MiB); {t_runs - t_typed:.0f} s to run, {t_checked - t_runs:.0f} s to check the texts, "
          f"{t_end - t_checked:.0f} s to tour")
    assert peak < bound
    assert proc.poll() is None and "Traceback" not in log.read_text()


ARRIVED = re.compile(r"This run waited [\d.]+ s in the queue \(it arrived as number (\d+)\)")


def arrivals(tabs) -> list[int]:
    """Each tab's place in the queue when its run arrived, as the server reports it under the finished run
    (0: it started at once, no queue)."""
    out = []
    for _, page in tabs:
        caption = page.get_by_text(ARRIVED)
        out.append(int(ARRIVED.search(caption.first.text_content()).group(1)) if caption.count() else 0)
    return out


def client_arrivals(clients) -> list[int]:
    """arrivals() of protocol sessions."""
    return [int(m.group(1)) if (m := ARRIVED.search(c.text())) else 0 for c in clients]


def type_prompts(clients, prompts) -> None:
    """Each protocol student sets NEW tokens and types its prompt (all sent, then all awaited)."""
    for client, prompt in zip(clients, prompts):
        client.wait_for("Run", "the first page")
        client.set("Max new tokens", NEW)
        client.set("Prompt", prompt)
    for k, client in enumerate(clients):
        client.wait_idle(f"session {k}'s prompt")


def press_run_clients(clients, also=()) -> float:
    """Press Run in `also` (without waiting for them) and then in every client; seconds until every client shows
    its text."""
    t0 = time.monotonic()
    for client in [*also, *clients]:
        client.click("Run")
    for k, client in enumerate(clients):
        client.wait_for("Generated text", f"student {k}'s run")
    took = time.monotonic() - t0
    for k, client in enumerate(clients):
        client.wait_idle(f"student {k}'s run")
    return took


def test_ten_tabs_of_one_browser_delay_the_others_by_at_most_one_run(room):
    """Four students and one browser whose ten tabs share its cookie press Run within milliseconds, all of them
    protocol sessions (tests/st_client.py: the server's schedule is the point, not the painting). Measured by the
    server's schedule, not by the clock (with Chromium tabs on the same two cores, the browsers' own rendering
    swung the wall times by several seconds): ahead of another student's run in the
    queue are at most the other students who came first and the ten-tab browser's one waiting run (its one
    generating run holds a slot), so no place is past len(others) + 1. Without the per-browser limits the
    browser's eight or nine waiting runs would be ahead: places of 9 and more."""
    url, proc, log, model_dir = room
    from engine import load_model
    tok = load_model(model_dir, device="cpu", dtype="float32").tokenizer
    others = [AppClient(url, timeout_s=TIMEOUT_S) for _ in range(4)]
    type_prompts(others, [prompt_of(100 + k, tok) for k in range(4)])
    alone = press_run_clients(others)
    places_alone = client_arrivals(others)
    cookie = secrets.token_hex(16)     # one browser: ten tabs share its cookie
    greedy = [AppClient(url, cookie=cookie, timeout_s=TIMEOUT_S) for _ in range(10)]
    type_prompts(greedy, [prompt_of(200 + k, tok) for k in range(10)])
    for client in others:
        client.close()
    others = [AppClient(url, timeout_s=TIMEOUT_S) for _ in range(4)]      # fresh sessions: no earlier text
    type_prompts(others, [prompt_of(300 + k, tok) for k in range(4)])
    # the ten tabs' Runs within a few milliseconds (a run takes seconds): one message each, then the students'
    with_greedy = press_run_clients(others, also=greedy)
    places = client_arrivals(others)
    refused = sum(tab.shows("You already have") for tab in greedy)
    print(f"four students alone: {alone:.1f} s, arrived at places {places_alone}; with a ten-tab "
          f"browser: {with_greedy:.1f} s, places {places}; tabs refused {refused}")
    assert refused >= 8
    assert max(places) <= len(others) + 1, (places_alone, places)
    for client in greedy + others:
        client.close()
