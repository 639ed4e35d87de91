"""Live sessions per client (a browser, all its tabs): every tab or scripted connection is a session with its own
memory budget, kept a while after it closes, so the server's memory is bounded only if the sessions of one
client are. A session registers a token here when its script runs; the token lives in the session's own state,
so when the session is dropped (closed and expired) the token is garbage and the session no longer counts.

    seat = sessions.admit(client, state_token, limit)   # None: admitted; else the message to show

Nothing here knows Streamlit; the app passes the client key (inspector.ui.common.client_key) and a token object it keeps
in st.session_state.
"""
from __future__ import annotations

import threading
import weakref


class SessionToken:
    """Kept in one session's state for as long as the session lives; the registry holds it weakly."""
    __slots__ = ("__weakref__",)


class ClientSessions:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_client: dict[str, list[weakref.ref]] = {}

    def live(self, client: str) -> int:
        """Sessions of this client still alive (tokens not yet collected)."""
        with self._lock:
            return len(self._alive(client))

    def _alive(self, client: str) -> list[weakref.ref]:
        refs = [r for r in self._by_client.get(client, []) if r() is not None]
        if refs:
            self._by_client[client] = refs
        else:
            self._by_client.pop(client, None)
        return refs

    def admit(self, client: str | None, token: SessionToken, limit: int) -> str | None:
        """Count this session for its client; None if it may go on, else the message to show it. A session
        already counted is always admitted (its reruns); a new one past the limit is not counted."""
        if client is None:
            return None
        with self._lock:
            refs = self._alive(client)
            if any(r() is token for r in refs):
                return None
            if len(refs) >= limit:
                return (f"This browser already has {len(refs)} sessions open on this server, the most one browser "
                        f"may have (LLM_INSPECTOR_MAX_SESSIONS_PER_CLIENT={limit}). Close another tab of this app; a "
                        "closed tab's session ends about two minutes later.")
            refs.append(weakref.ref(token))
            self._by_client[client] = refs
            return None


sessions = ClientSessions()
