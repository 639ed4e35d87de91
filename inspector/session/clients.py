"""Live sessions per client (a browser, all its tabs): every tab or scripted connection is a session with its own
memory budget, kept a while after it closes, so the server's memory is bounded only if the sessions of one
client are. A session registers a token here when its script runs; the token lives in the session's own state,
so when the session is dropped (closed and expired) the token is garbage and the session no longer counts.

    seat = sessions.admit(client, state_token, limit, total)   # None: admitted; else the message to show

A session without a browser cookie (a script, or a server without XSRF protection) is not a browser of its own:
all of them share one client, COOKIELESS, and so one browser's share. Whatever a script invents, the server
holds at most `total` sessions (LLM_INSPECTOR_MAX_SESSIONS), so its memory is bounded for any client.

Nothing here knows Streamlit; the app passes the client key (inspector.ui.common.client_key) and a token object it keeps
in st.session_state.
"""
from __future__ import annotations

import threading
import weakref

COOKIELESS = "no-cookie"     # every session without the browser cookie: one client


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

    def total(self) -> int:
        """Sessions alive on this server, every client together."""
        with self._lock:
            return sum(len(self._alive(c)) for c in list(self._by_client))

    def admit(self, client: str | None, token: SessionToken, limit: int, total: int | None = None) -> str | None:
        """Count this session for its client (None: outside a server, nothing counted); None if it may go on,
        else the message to show it. A session already counted is always admitted (its reruns); a new one past
        its client's limit, or past `total` sessions on the server, is not counted."""
        if client is None:
            return None
        with self._lock:
            refs = self._alive(client)
            if any(r() is token for r in refs):
                return None
            if total is not None and sum(len(self._alive(c)) for c in list(self._by_client)) >= total:
                return (f"This server already holds {total} sessions, the most it takes (LLM_INSPECTOR_MAX_SESSIONS). "
                        "Try again in a few minutes: a closed tab's session ends about two minutes later.")
            if len(refs) >= limit:
                who = ("Connections without a browser cookie (scripts) already hold" if client == COOKIELESS
                       else "This browser already has")
                return (f"{who} {len(refs)} sessions open on this server, the most one browser "
                        f"may have (LLM_INSPECTOR_MAX_SESSIONS_PER_CLIENT={limit}). Close another tab of this app; a "
                        "closed tab's session ends about two minutes later.")
            refs.append(weakref.ref(token))
            self._by_client[client] = refs
            return None


sessions = ClientSessions()
