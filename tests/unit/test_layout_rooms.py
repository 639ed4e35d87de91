"""Layout promises of issue 31 that can be checked statically: one module (inspector.ui.st_internals) touches
Streamlit's internals; the room store reads through redis-py, never a socket of its own."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
ADAPTER = "inspector/ui/st_internals.py"
PRIVATE = re.compile(r"\._session_mgr\b|\._client_state\b|\._call_soon_on_event_loop\b|\._scriptrunner\b|"
                     r"\bThreadState\b|Runtime\.instance\(|streamlit\.runtime\.app_session|"
                     r"streamlit\.runtime\.runtime\b|\bfrom streamlit\.runtime import Runtime\b")


def _app_files():
    for p in [ROOT / "app.py", *sorted((ROOT / "pages").glob("*.py")), *sorted((ROOT / "inspector").rglob("*.py"))]:
        yield str(p.relative_to(ROOT)), p.read_text()


def test_only_the_adapter_uses_streamlits_internals():
    found = [f"{path}:{text[:m.start()].count(chr(10)) + 1} {m.group(0)}" for path, text in _app_files()
             if path != ADAPTER for m in PRIVATE.finditer(text)]
    assert found == [], found
    assert PRIVATE.search((ROOT / ADAPTER).read_text())


def test_the_room_store_speaks_to_redis_through_redis_py():
    text = (ROOT / "inspector/session/rooms_redis.py").read_text()
    assert "import redis" in text and "import socket" not in text and "readline(" not in text
