"""The shared opening of chat prompts, computed once per model: a prefix cache as serving engines keep one.

Every chat prompt of a model's template starts with the same tokens (the template's opening: for a template with a
default system prompt, that whole system turn and the user turn's header; about half of a short chat prompt). The
prefill's rule, for every run (engine.generate.GenerationRun): a prompt that starts with its model's opening and
goes on past it is prefilled in two parts, the opening first (a chunk of its own) and then the rest, so that a
run's arithmetic is the same whether the opening's keys and values were computed by it or copied from here (the
rest attends to the same cached rows, and the opening's own rows come from the same chunk's forward).

    P = shared_prefix_len(model, prompt_ids)            # 0: no shared opening (then nothing is cached)
    shared_prefix_cache().fill(key, cache, recording, compute)

An entry holds the opening's keys and values (layers, kv_heads, P, head_dim) and what a watching probe recorded
over the opening (its statistics blocks, captures and timing marks), so that a run whose opening was copied reports
the record the run that computed it reported. Its key: the model object, the exact token ids, the cache's dtype and
device, and what the probe watched (Watched: data); a probe that changes the forward (a replace hook, a weight
override, a run-only epsilon) never shares an opening. The cache's memory is bounded (max_bytes, least recently used
entry out first); an entry larger than the bound is computed and not kept. Runs that miss the same key at once wait
for the first one's computation (at most WAIT_S) instead of each computing it: the count of computations of one
opening is one."""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch

MAX_BYTES = 64 * 2 ** 20      # the shared cache's bound: an opening of ~60 tokens of the bundled model with full
                              # inspection statistics is a few hundred KiB, so dozens of templates fit
WAIT_S = 30.0                 # the longest a run waits for another's computation of the same opening
_PROBE_A, _PROBE_B = "a", "Zq 9?"      # two user messages that share no first character: the opening is what the
                                       # two renderings share before them


@dataclass
class PrefixEntry:
    """One opening's keys and values (layers, kv_heads, P, head_dim) and what a probe recorded over it."""
    k: torch.Tensor
    v: torch.Tensor
    stats: list = field(default_factory=list)
    captures: list = field(default_factory=list)
    marks: list = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        held = [self.k, self.v] + [b.values for b in self.stats] + [
            c.value for c in self.captures if isinstance(c.value, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in held)


_openings: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_openings_lock = threading.Lock()


def template_opening(tokenizer) -> tuple[int, ...]:
    """The ids every chat prompt of this tokenizer's template starts with (no system prompt given), () when it has no
    chat template; found once per tokenizer as the common start of two renderings of different user messages."""
    with _openings_lock:
        got = _openings.get(tokenizer)
    if got is not None:
        return got
    try:
        a = tokenizer.encode_chat([{"role": "user", "content": _PROBE_A}], add_generation_prompt=True)
        b = tokenizer.encode_chat([{"role": "user", "content": _PROBE_B}], add_generation_prompt=True)
    except Exception:          # no chat template (or one that cannot render a user turn): no shared opening
        a = b = []
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    got = tuple(a[:n])
    with _openings_lock:
        _openings[tokenizer] = got
    return got


def shared_prefix_len(model, ids: list[int]) -> int:
    """How many of ids' first positions are the model's template opening: its length when ids start with the whole
    opening and go on past it, else 0 (a prompt shorter than the opening, another template, a plain prompt)."""
    opening = template_opening(model.tokenizer)
    n = len(opening)
    if n == 0 or len(ids) <= n or tuple(ids[:n]) != opening:
        return 0
    if any(w is not None and w < n for w in model.config.layer_window):
        return 0               # a window layer shorter than the opening keeps no rows 0..n-1 as positions
    return n


def prefix_key(model, ids: list[int], cache, probe) -> tuple | None:
    """The key of an opening's entry (None: this run may not share one: its probe changes the forward)."""
    watched = None
    if probe is not None:
        if probe.interventions() or probe.norm_eps is not None:
            return None
        watched = probe.watched()
    return (id(model), tuple(ids), cache.dtype, str(cache_device(cache)), watched)


def cache_device(cache) -> torch.device:
    return (cache.k if cache.k is not None else cache.layer_k[0]).device


def _rows(cache, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's first n rows of every layer, copied: (layers, kv_heads, n, head_dim) keys and values."""
    if cache.k is not None:
        return cache.k[:, :, :n].clone(), cache.v[:, :, :n].clone()
    return (torch.stack([k[:, :n] for k in cache.layer_k]).clone(),
            torch.stack([v[:, :n] for v in cache.layer_v]).clone())


def _write(cache, entry: PrefixEntry) -> None:
    """The entry's rows into the cache's first positions (it stands at 0), then the cache advanced over them."""
    n = entry.k.shape[2]
    cache.check_room(n)
    if cache.k is not None:
        cache.k[:, :, :n] = entry.k
        cache.v[:, :, :n] = entry.v
    else:
        for i, (k, v) in enumerate(zip(cache.layer_k, cache.layer_v)):
            k[:, :n] = entry.k[i]
            v[:, :n] = entry.v[i]
    cache.advance(n)


class PrefixCache:
    """Openings by key, least recently used first out past max_bytes. computed: openings computed here (a hit
    computes nothing); hits: openings copied."""

    def __init__(self, max_bytes: int = MAX_BYTES, wait_s: float = WAIT_S) -> None:
        if max_bytes < 0:
            raise ValueError(f"a prefix cache's bound must be >= 0 bytes, got {max_bytes}")
        self.max_bytes, self.wait_s = max_bytes, wait_s
        self._entries: OrderedDict[tuple, tuple[PrefixEntry, weakref.ref]] = OrderedDict()
        self._inflight: dict[tuple, threading.Event] = {}
        self._lock = threading.Lock()
        self.computed = self.hits = 0

    @property
    def bytes_held(self) -> int:
        with self._lock:
            return sum(e.nbytes for e, _ in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def fill(self, model, key: tuple | None, n: int, cache, recording, compute: Callable[[], None]) -> bool:
        """The opening (its n first positions) into `cache` (at position 0): copied from the entry under `key`, with
        what its probe recorded appended to `recording` (None: no probe); or computed by compute() (the run's own
        forward over those positions, into its cache and its probe) and kept. key None: computed, not kept.
        Whether it was copied."""
        if key is None:
            compute()
            return False
        while True:
            with self._lock:
                got = self._entries.get(key)
                if got is not None and got[1]() is model:
                    self._entries.move_to_end(key)
                    self.hits += 1
                    entry = got[0]
                    break
                wait = self._inflight.get(key)
                if wait is None:
                    mine = self._inflight[key] = threading.Event()
                    entry = None
                    break
            if not wait.wait(self.wait_s):       # the other run is slow (its on_progress): compute beside it
                compute()
                return False
        if entry is not None:
            _write(cache, entry)
            if recording is not None:
                recording.stats.extend(entry.stats)
                recording.captures.extend(entry.captures)
                recording.marks.extend(entry.marks)
            return True
        try:
            marks = [len(recording.stats), len(recording.captures), len(recording.marks)] if recording else None
            compute()
            made = PrefixEntry(*_rows(cache, n))
            if recording is not None:
                made.stats, made.captures, made.marks = (list(recording.stats[marks[0]:]),
                                                         list(recording.captures[marks[1]:]),
                                                         list(recording.marks[marks[2]:]))
            self._keep(key, made, model)
        finally:
            with self._lock:
                self._inflight.pop(key, None)
            mine.set()
        return False

    def _keep(self, key: tuple, entry: PrefixEntry, model) -> None:
        with self._lock:
            self.computed += 1
            if entry.nbytes > self.max_bytes:
                return
            self._entries[key] = (entry, weakref.ref(model))
            held = sum(e.nbytes for e, _ in self._entries.values())
            while held > self.max_bytes:
                _, (old, _) = self._entries.popitem(last=False)
                held -= old.nbytes


_shared = PrefixCache()


def shared_prefix_cache() -> PrefixCache:
    """The process's prefix cache (every run of every model in this process shares it, as they share models)."""
    return _shared
