"""The app tier's fixtures beside tests/conftest.py's."""
from __future__ import annotations

import pytest

from inspector.ui.state import session_of


@pytest.fixture
def page(page):
    """tests/conftest.py's page(name, run, model, source), with `run` the session's current run in its typed
    state (SessionState.run: the pages read nothing else)."""
    def make(name: str, run, model, source: str | None):
        at = page(name, None, model, source)
        if run is not None:
            session_of(at.session_state).run = run
        return at
    return make
