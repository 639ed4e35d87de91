"""A head atlas: every attention head of a model scored on the classic TransformerLens-style patterns, so a user
can find the previous-token, sink, self, duplicate-token and induction heads at a glance.

    atlas = head_atlas(model, texts)           # texts: None reads the project's own docs (default_corpus)
    atlas.scores["induction"][layer, head]     # (layers, heads) float64 arrays, one per SCORE_NAMES

The scores, each a mean over query positions (position 0 is left out: it can attend only to itself):
- previous-token  attention from i to i-1;
- first-token     attention from i to position 0 (the "sink");
- self            attention from i to i (the diagonal);
- duplicate-token the attention from i to earlier positions holding the same token as i, over the positions
                  that have such an earlier copy;
- entropy         the pattern row's entropy in nats;
- induction       on `repeats` sequences of `length` random tokens repeated twice: from position i of the second
                  copy, attention to the position right after the earlier copy of i's token (i - length + 1).

The text scores are measured on a small corpus (paragraphs of real text, bounded in tokens), the induction score on
the repeated random tokens (seeded: two atlases with one seed are identical). Patterns are read from the forward's
own `blocks.{i}.attn.pattern` stage through a Probe (the exact softmax the model ran); each layer's pattern is
scored inside its hook, so memory stays at one layer's (heads, T, T) at a time. The same hook keeps each head's
TOP_K best windows per score (engine.tools.atlas_windows): atlas.top_windows(score, layer, head) says where a head
does what its score says, with no second forward. engine.tools.atlas_store keeps an atlas on disk per model.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.errors import InputError
from engine.inspection.probe import Probe
from engine.progress import tell_units
from engine.tools.atlas_windows import TOP_K, TopWindows, induction_positions, position_scores

TEXT_SCORES = ("previous-token", "first-token", "self", "duplicate-token", "entropy")
SCORE_NAMES = TEXT_SCORES + ("induction",)
MAX_TEXT_TOKENS = 256          # one text's forward: its (heads, T, T) pattern is scored and dropped per layer
MAX_LENGTH, MAX_REPEATS = 512, 64   # the random sequences: 2 x length positions a forward
CORPUS_TOKENS = 2048           # the default corpus, in tokens over all texts
DOC_FILES = ("README.md", "docs/ENGINE_API.md", "docs/CLASSROOM.md")


def pattern_scores(pattern: torch.Tensor, ids: list[int]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each TEXT_SCORES score of one (heads, T, T) causal pattern over tokens ids: {name: (sums, counts)}, both
    (heads,) arrays, so texts can be pooled by position. Query positions 1 .. T-1; duplicate-token only over those
    with an earlier copy of their token. The sums of engine.tools.atlas_windows.position_scores."""
    H = pattern.shape[0]
    return {name: (v.sum(1), np.full(H, float(q.size))) for name, (v, q, _) in position_scores(pattern, ids).items()}


def induction_score(pattern: torch.Tensor, length: int, start: int = 0) -> np.ndarray:
    """(heads,) induction score of one (heads, T, T) pattern over a sequence whose positions start .. start+length-1
    and start+length .. start+2*length-1 hold the same `length` tokens: the mean, over i in the second copy, of the
    attention from i to i - length + 1 (the token after i's earlier copy)."""
    return induction_positions(pattern, length, start)[0].mean(1)


def default_corpus(root: Path | None = None, max_tokens: int = CORPUS_TOKENS, tokenizer=None) -> list[str]:
    """Prose paragraphs of the project's own docs (DOC_FILES), read now: no code blocks, tables, lists or headings;
    at least 200 characters each; as many as fit max_tokens (counted with tokenizer, else ~4 characters a token)."""
    root = root or Path(__file__).resolve().parents[2]
    texts, used = [], 0
    for name in DOC_FILES:
        path = root / name
        if not path.is_file():
            continue
        body = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
        for para in re.split(r"\n\s*\n", body):
            para = " ".join(para.split())
            if len(para) < 200 or para[0] in "#|-*>0123456789<!":
                continue
            n = len(tokenizer.encode(para)) if tokenizer is not None else len(para) // 4
            n = min(n, MAX_TEXT_TOKENS)
            if used + n > max_tokens:
                return texts
            texts.append(para)
            used += n
    if not texts:
        raise InputError(f"no prose paragraph of 200+ characters found in {', '.join(DOC_FILES)} under {root}")
    return texts


@dataclass
class HeadAtlas:
    layers: int
    heads: int
    scores: dict[str, np.ndarray]            # SCORE_NAMES -> (layers, heads)
    texts: list[str]
    top_text: dict[str, np.ndarray]          # "previous-token" / "duplicate-token" -> (layers, heads) text index
    tokens: int                              # corpus tokens scored
    repeats: int
    length: int
    seed: int
    random_ids: list[list[int]] = field(repr=False, default_factory=list)
    text_ids: list[list[int]] = field(repr=False, default_factory=list)      # each text's tokens, as scored
    # each head's TOP_K windows per score (engine.tools.atlas_windows.TopWindows): SCORE_NAMES ->
    # value (layers, heads, TOP_K), at (layers, heads, TOP_K, 3) of (sequence, query, key); sequence indexes
    # sequences(): the texts' tokens, then the repeated random sequences (induction's windows)
    window_value: dict[str, np.ndarray] = field(repr=False, default_factory=dict)
    window_at: dict[str, np.ndarray] = field(repr=False, default_factory=dict)

    def sequences(self) -> list[list[int]]:
        return [*self.text_ids, *self.random_ids]

    def top_windows(self, name: str, layer: int, head: int) -> list[dict]:
        """One head's best windows by one score, best first: {rank, sequence, query, key, score, ids} (ids: the
        whole sequence's tokens; query the position scored, key the position it attends for this score)."""
        if name not in SCORE_NAMES:
            raise InputError(f"unknown score {name!r}; the scores are {', '.join(SCORE_NAMES)}")
        if not (0 <= layer < self.layers and 0 <= head < self.heads):
            raise InputError(f"no head L{layer}H{head}: layers are [0, {self.layers}), heads [0, {self.heads})")
        seqs, out = self.sequences(), []
        for rank, ((seq, q, k), v) in enumerate(zip(self.window_at[name][layer, head].tolist(),
                                                    self.window_value[name][layer, head].tolist())):
            if seq >= 0:
                out.append({"rank": rank + 1, "sequence": seq, "query": q, "key": k, "score": v, "ids": seqs[seq]})
        return out

    def rows(self) -> list[dict]:
        """One dict per head: layer, head, every score, and its top texts' indices."""
        out = []
        for layer in range(self.layers):
            for head in range(self.heads):
                r = {"layer": layer, "head": head}
                r |= {name: float(self.scores[name][layer, head]) for name in SCORE_NAMES}
                r |= {f"top text ({name})": int(self.top_text[name][layer, head]) for name in self.top_text}
                out.append(r)
        return out

    def ranked(self, name: str, top: int | None = None) -> list[dict]:
        """rows() ordered by one score, highest first (entropy: lowest first, the sharpest heads)."""
        if name not in SCORE_NAMES:
            raise InputError(f"unknown score {name!r}; the scores are {', '.join(SCORE_NAMES)}")
        rows = sorted(self.rows(), key=lambda r: r[name], reverse=name != "entropy")
        return rows[:top] if top else rows

    def as_dict(self) -> dict:
        return {"layers": self.layers, "heads": self.heads, "tokens": self.tokens, "repeats": self.repeats,
                "length": self.length, "seed": self.seed, "texts": self.texts, "scores": list(SCORE_NAMES),
                "heads_scored": self.rows(),
                "top": {name: [(r["layer"], r["head"]) for r in self.ranked(name, 5)] for name in SCORE_NAMES},
                "windows": {name: [{"layer": r["layer"], "head": r["head"],
                                    "windows": [{k: w[k] for k in ("sequence", "query", "key", "score")}
                                                for w in self.top_windows(name, r["layer"], r["head"])]}
                                   for r in self.ranked(name, 5)] for name in SCORE_NAMES}}


def random_repeats(model, repeats: int, length: int, seed: int) -> list[list[int]]:
    """`repeats` sequences of `length` tokens drawn uniformly (seeded) from the non-special vocabulary, each
    written twice in a row."""
    g = torch.Generator().manual_seed(seed)
    V, tok = model.config.vocab_size, model.tokenizer
    out = []
    for _ in range(repeats):
        seq: list[int] = []
        while len(seq) < length:
            t = int(torch.randint(V, (1,), generator=g))
            if not tok.is_special(t):
                seq.append(t)
        out.append(seq + seq)
    return out


def _patterns_scored(model, ids: list[int], score) -> None:
    """One forward over ids; score(layer, pattern (heads, T, T)) hears every layer's softmax pattern in turn."""
    probe = Probe()

    def keep(x: torch.Tensor, ctx) -> None:
        if ctx.pos0 != 0 or x.shape[1] != x.shape[2]:
            raise InputError(f"head atlas expects one whole-sequence forward; got a pattern {tuple(x.shape)} "
                             f"from position {ctx.pos0}")
        score(ctx.layer, x)

    probe.replace([f"blocks.{i}.attn.pattern" for i in range(model.config.num_layers)], keep)
    model.forward(torch.tensor(ids, dtype=torch.long), model.new_cache(len(ids)), probe)


def head_atlas(model, texts: list[str] | None = None, *, repeats: int = 4, length: int = 64, seed: int = 0,
               max_text_tokens: int = MAX_TEXT_TOKENS, on_progress=None) -> HeadAtlas:
    """Every head of model scored (SCORE_NAMES) on texts (None: default_corpus) and on `repeats` repeated random
    sequences of `length` tokens. One forward per text and per random sequence; on_progress hears each as a unit
    (engine.progress.tell_units) and a STOP between two raises Stopped (no half atlas)."""
    if not (1 <= repeats <= MAX_REPEATS and 2 <= length <= MAX_LENGTH):
        raise InputError(f"head atlas wants 1 <= repeats <= {MAX_REPEATS} and 2 <= length <= {MAX_LENGTH}; got "
                         f"repeats={repeats}, length={length}")
    L, H = model.config.num_layers, model.config.num_heads
    texts = list(texts) if texts is not None else default_corpus(tokenizer=model.tokenizer)
    encoded = [model.tokenizer.encode(t)[:max_text_tokens] for t in texts]
    if not texts or not any(len(ids) >= 2 for ids in encoded):
        raise InputError("head atlas needs at least one text of two or more tokens")
    sums = {n: np.zeros((L, H)) for n in TEXT_SCORES}
    counts = {n: np.zeros((L, H)) for n in TEXT_SCORES}
    best = {n: np.full((L, H), -np.inf) for n in ("previous-token", "duplicate-token")}
    top = {n: np.zeros((L, H), dtype=int) for n in best}
    randoms = random_repeats(model, repeats, length, seed)
    induction = np.zeros((L, H))
    windows = TopWindows(SCORE_NAMES, L, H, TOP_K)
    total = len(texts) + repeats
    for k, ids in enumerate(encoded):
        tell_units(on_progress, k, total, f"text {k + 1} of {len(texts)}")
        if len(ids) < 2:
            continue

        def score_text(layer: int, x: torch.Tensor, ids=ids, k=k) -> None:
            for name, (v, q, key) in position_scores(x, ids).items():
                s, c = v.sum(1), np.full(H, float(q.size))        # pattern_scores, with the positions kept
                windows.offer(name, layer, k, v, q, key)
                sums[name][layer] += s
                counts[name][layer] += c
                if name in best:
                    here = np.where(c > 0, s / np.maximum(c, 1), -np.inf)
                    better = here > best[name][layer]
                    best[name][layer][better], top[name][layer][better] = here[better], k

        _patterns_scored(model, ids, score_text)
    for r, ids in enumerate(randoms):
        tell_units(on_progress, len(texts) + r, total, f"repeated random tokens {r + 1} of {repeats}")

        def score_random(layer: int, x: torch.Tensor, r=r) -> None:
            v, q, key = induction_positions(x, length)
            windows.offer("induction", layer, len(texts) + r, v, q, key)
            induction[layer] += v.mean(1) / repeats

        _patterns_scored(model, ids, score_random)
    tell_units(on_progress, total, total, "done")
    scores = {n: sums[n] / np.maximum(counts[n], 1) for n in TEXT_SCORES}
    if not counts["duplicate-token"].any():
        scores["duplicate-token"][:] = np.nan         # no token repeats in the corpus: no duplicate score at all
    scores["induction"] = induction
    return HeadAtlas(L, H, scores, texts, top, sum(len(i) for i in encoded if len(i) >= 2), repeats, length, seed,
                     randoms, encoded, windows.value, windows.at)
