"""What the model registry (inspector.session.models) says about its room for models: who it reads as a session
(ModelUser), a refused load (NoRoomError, its message naming how many sessions hold each model), a model unloaded to
make room (Unloaded, the notice its last users get) and a model held (Held, its weights' bytes by dtype)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine import ModelLoadError

from .limits import env_name


class ModelUser(Protocol):
    """What the registry reads of a session (inspector.session.state.SessionState): the model its sidebar chose
    (what its pages, runs and room views use), when it last had each model, and the models its own objects hold
    (its debugger's, its generating run's)."""
    model_key: tuple | None
    models_used: dict

    def held_models(self) -> list: ...


class NoRoomError(ModelLoadError):
    """Every model this server holds is in use (or loading): the load is refused, and tried again at the next ask."""


@dataclass(frozen=True)
class Unloaded:
    """A model the registry unloaded to make room: when (monotonic, and as a clock time) and for which model."""
    at: float
    clock: str
    for_label: str
    limit: int

    def notice(self, name: str, loaded: bool) -> str:
        again = "It has been loaded again." if loaded else "It is loading again; Run starts once it is ready."
        return (f"{name} was unloaded at {self.clock} to make room for {self.for_label}: this server keeps at most "
                f"{self.limit} model(s) loaded ({env_name('max_models')}) and no session had it open. {again}")


@dataclass(frozen=True)
class Held:
    """One model the registry holds, as a page may show it: its name, device and dtype, and its weights' bytes
    per dtype (None while it loads)."""
    name: str
    device: str
    dtype: str
    weight_bytes: dict | None          # dtype name -> bytes (engine Weights.nbytes_by_dtype), largest first


def refusal(limit: int, rows: list[tuple[str, bool, int]], sessions: int) -> str:
    """Every model held is in use; rows: (model, loading, sessions that need it) for each, and how many sessions
    need any. Says which, and by how many sessions (what a teacher can act on): a model no session needs is held by
    a computation running on it."""
    parts = []
    for name, loading, users in rows:
        parts.append(f"{name}: " + ("loading" if loading else f"in use by {count(users, 'session')}" if users
                                    else "a computation is running on it"))
    who = f"{count(sessions, 'session')} {'holds' if sessions == 1 else 'hold'} them" if sessions else "they are busy"
    return (f"this server keeps at most {limit} model(s) loaded ({env_name('max_models')}), and every one is in "
            f"use ({who}): {'; '.join(parts)}. A model is unloaded to make room as soon as no session has it "
            "chosen in its sidebar, debugger or a running run (a closed tab stops counting after about two "
            "minutes). Choose one of those, or try again then.")


def count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")
