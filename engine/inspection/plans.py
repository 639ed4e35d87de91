"""What a probe does with each stage (a Plan), from its specs: capture, statistics, replace.

A probe plans each of its ~500 stages on first use in every run. Probes made with the same specs (every run
of the app, every run of a bench) plan a stage alike, so those plans are shared (plans are never changed
once settled); a probe with replace hooks plans its own (its hook functions are its own).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase as _fnmatchcase
from typing import Callable

from engine.inspection.probe_views import FULL, NONE, ROWS, STATS
from engine.inspection.stages import ATTENTION_MAPS

_LAYER = re.compile(r"blocks\.(\d+)\.(.+)")
_SHARED: dict[tuple, "Plan"] = {}
SHARED_MAX = 1 << 14


@dataclass
class Plan:
    layer: int | None = None
    heads_first: bool = False      # attn.scores / attn.pattern: (heads, T, S)
    masked: bool = False           # -inf entries are masks (attention scores, sampler cuts), not faults
    capture: list[tuple[frozenset | None, frozenset | None]] = field(default_factory=list)
    stats: bool = False
    replace: list[Callable] = field(default_factory=list)
    need: int = NONE                # what the stage needs of its tensor: NONE, STATS, ROWS or FULL

    def __bool__(self) -> bool:
        return self.need != NONE

    def settle(self) -> "Plan":
        if self.replace or any(positions is None for _, positions in self.capture):
            self.need = FULL
        elif self.capture:
            self.need = ROWS
        else:
            self.need = STATS if self.stats else NONE
        return self


# remembered: each run plans the same ~500 stage names on the same few patterns
fnmatchcase = functools.lru_cache(maxsize=1 << 14)(_fnmatchcase)


@functools.lru_cache(maxsize=1 << 13)
def split_name(name: str) -> tuple[int | None, str]:
    """'blocks.3.attn.q' -> (3, 'attn.q'); 'embed' -> (None, 'embed')."""
    m = _LAYER.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def matches(name: str, pats: list[str]) -> bool:
    return any(name == pat or fnmatchcase(name, pat) for pat in pats)


def plan_stage(name: str, stats_specs: list[str], capture_specs: list[tuple], replace_specs: list[tuple]) -> Plan:
    """The plan of one stage; shared between probes of the same specs when there are no replace hooks."""
    if replace_specs:
        return _new(name, stats_specs, capture_specs, replace_specs)
    key = (name, tuple(stats_specs), tuple((tuple(pats), layers, positions) for pats, layers, positions
                                           in capture_specs))
    p = _SHARED.get(key)
    if p is None:
        if len(_SHARED) >= SHARED_MAX:
            _SHARED.clear()
        p = _SHARED[key] = _new(name, stats_specs, capture_specs, ())
    return p


def _new(name: str, stats_specs, capture_specs, replace_specs) -> Plan:
    layer, stage = split_name(name)
    p = Plan(layer=layer, heads_first=stage in ATTENTION_MAPS,
             masked=stage == "attn.scores" or name.startswith("sampler."))
    for pats, layers, positions in capture_specs:
        if matches(name, pats) and (layers is None or layer in layers):
            p.capture.append((layers, positions))
    p.stats = any(fnmatchcase(name, pat) for pat in stats_specs) and not name.startswith(("tokenizer", "detokenizer"))
    for pats, fn, layers in replace_specs:
        if matches(name, pats) and (layers is None or layer in layers):
            p.replace.append(fn)
    return p.settle()
