"""A poll after a reload (issue 33, item 9): one answer per browser, and a student who answered and then reloads
the page (a new Streamlit session, the same browser) is shown the answer that counts, not the form again (before,
the form came back and a second answer was quietly dropped). A second tab of the same browser sees the same.
The teacher's count stays at one. One server (rooms in process), the tiny model, Chromium. The form's absence is
read from the poll's own radio group: the Sampling page under the poll draws one of its own (counting every radio
group on the page failed the merged suite whenever that page had been drawn in time)."""
from __future__ import annotations

import re

import pytest

from tests.browser.room_tabs import go, idle, open_tab, run_prompt, set_number, start_room, wait_text
from tests.browser.test_rooms import SERVER_ARGS, room_server, server_env

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    log = tmp_path_factory.mktemp("poll-reload") / "streamlit.log"
    with room_server(server_env(tiny_model_dir), log, *SERVER_ARGS) as (url, proc):
        yield url, proc, log


def poll_radio(page):
    """The poll's candidates (the page under the poll, Sampling, has a radio group of its own)."""
    return page.locator('[data-testid="stRadio"]').filter(has_text="The model's top candidates")


def test_a_student_who_answered_sees_the_answer_after_a_reload(server, browser):
    url, proc, log = server
    tctx, teacher = open_tab(browser, url, viewport=(1280, 860))
    code = start_room(teacher)
    run_prompt(teacher, "What is the capital of France?")
    go(teacher, "Sampling")
    idle(teacher)
    set_number(teacher, "Step (0 = after the prefill", 1)
    idle(teacher)
    teacher.get_by_role("button", name="Ask the class: what comes next?").click()
    wait_text(teacher, "at step 1")
    sctx, student = open_tab(browser, f"{url}/?room={code}")
    wait_text(student, "What comes next?")
    idle(student)
    group = poll_radio(student).get_by_role("radiogroup")
    first = [lab.strip() for lab in group.inner_text().split("\n") if lab.strip() and lab.strip() != "(none)"][0]
    group.get_by_text(first, exact=True).click()
    student.get_by_role("button", name="Answer", exact=True).click()
    wait_text(student, "Your answer:")
    teacher.get_by_text("1 answers so far").first.wait_for(timeout=60_000)

    for page in (student, sctx.new_page()):           # the same tab reloaded, and a second tab of this browser
        if page is student:
            page.reload()
        else:
            page.goto(f"{url}/?room={code}")
        wait_text(page, "What comes next?")
        idle(page)
        wait_text(page, "Your answer:", 60)
        wait_text(page, "Stage by stage, and the draws", 60)  # the page under the poll: a radio group of its own
        main = page.locator('[data-testid="stMain"]')
        assert re.search(r"Your answer: " + re.escape(first), main.inner_text()), main.inner_text()[:600]
        assert page.get_by_role("button", name="Answer", exact=True).count() == 0      # the form is not offered
        assert poll_radio(page).count() == 0
    teacher.wait_for_timeout(1500)
    assert teacher.get_by_text("1 answers so far").count() >= 1                         # one browser, one answer
    assert proc.poll() is None and "Traceback" not in log.read_text()
    sctx.close()
    tctx.close()
