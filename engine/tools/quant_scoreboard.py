"""A quantization scoreboard in llama.cpp's terms: per GGUF format, over a set of texts, the figures
`llama-perplexity --kl-divergence` prints (ggml-org/llama.cpp, tools/perplexity/perplexity.cpp, kl_divergence()),
so a user can hold this model's numbers beside llama.cpp's.

What is scored, as llama.cpp scores a text: each text is tokenized as a prompt is (engine.generate.prompt_ids)
and read teacher-forced, in one forward, by the float32 model (the base) and by each format's quantized copy
(engine.tools.quant.quantized_model, built once per format and freed before the next). Every position t but the
last is scored: the two next-token distributions there, and the text's own token t+1 (the "actual next token").
llama.cpp scores only the second half of each n_ctx chunk (at least n_ctx/2 tokens of context); the texts here are
short, so every position is scored, the first ones with little context: a short text's figures run higher.

Per scored position (the page's per-step figures are the same numbers: engine.tools.quant.step_figures):
    KLD        KL(p_base || p_q) = sum_v p_base(v) (ln p_base(v) - ln p_q(v)), nats (clamped at 0)
    same top   argmax p_q == argmax p_base
    Δp         p_q(next) - p_base(next), the change in probability of the actual next token
    NLL        -ln p_q(next) and -ln p_base(next)

Over all positions (n of them; formulas as perplexity.cpp's):
    mean ± uncertainty      x̄ ± sqrt((mean(x²) - x̄²) / (n - 1))  (its mean_and_uncertainty: the sample standard
                            deviation over sqrt(n)); computed as numpy's population variance over n - 1, in float64
    Mean KLD, Mean Δp       that, of KLD and of Δp
    RMS Δp                  sqrt(mean(Δp²)) ± 0.5 / RMS × (the uncertainty of mean(Δp²))
    Same top p              k / n ± sqrt(p (1 - p) / (n - 1))
    Mean PPL(Q), PPL(base)  exp(mean NLL) ± PPL × (the uncertainty of mean NLL)
    ln(PPL(Q)/PPL(base))    mean NLL_q - mean NLL_base ± sqrt(u_q² + u_base² - 2 cov), cov = (mean(ab) - ā b̄) /
                            (n - 1): the uncertainty of the mean of NLL_q - NLL_base, computed as that
    PPL(Q)/PPL(base)        exp(ln ratio) ± ratio × (its uncertainty)
    Cor(ln PPL(Q), ln PPL(base))   cov / (u_q u_base)
    percentiles             llama.cpp's: sorted values, linear interpolation at fraction × (n - 1) (numpy's default)

Where this differs from llama.cpp: an uncertainty is given from 2 values up (llama.cpp prints 0 below 11) and
None for a single value; llama.cpp prints its final statistics only from 100 scored tokens (FEW_TOKENS): with
fewer they are given here, and the CLI and page say they are few. llama.cpp's base log-probabilities are stored in
16 bits (its .kld file); here both sides are float32 logits taken to float64 log-probabilities. No BOS token is
put before a text (the app's tokenization of a prompt); llama.cpp puts one at each chunk's start where the
vocabulary asks for it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.errors import InputError
from engine.generate import prompt_ids
from engine.model import Model
from engine.progress import OnProgress, tell_units
from engine.tools.quant import check_formats, log_probs, quantized_model, step_figures

DEFAULT_FORMATS = ("Q8_0", "Q4_0")
MAX_TOKENS = 2048        # tokens over all texts: the base's logits are kept, tokens x vocab x 4 bytes (400 MB here)
FEW_TOKENS = 100         # llama.cpp prints no final statistics below this many scored tokens
PERCENTILES = (0.1, 1.0, 5.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.9)   # llama.cpp's, KLD's and Δp's

# The project's own texts (written for it, free to redistribute): prose, instructions, dialogue, code, numbers and a
# list, so the score is not one register's. About 450 tokens with the bundled tokenizer.
PROMPTS = (
    "The river rose slowly through the night. By morning the lower fields were under water, and the farmers "
    "who had stayed up to watch it stood on the bridge and counted the fence posts that were still showing.",
    "To make bread, mix flour, water, salt and a little yeast. Knead the dough for ten minutes, let it rise "
    "until it has doubled in size, shape it, let it rise again, and bake it in a hot oven for about forty minutes.",
    "\"Are you coming tomorrow?\" she asked. \"I think so,\" he said, \"but the train leaves early, and if I "
    "miss it there is not another one until the afternoon.\" She laughed and told him to set two alarms.",
    "def mean(values):\n    \"\"\"The arithmetic mean of a non-empty list.\"\"\"\n    total = 0.0\n    for v in "
    "values:\n        total += v\n    return total / len(values)",
    "In 1969 the first people walked on the Moon. The flight took about three days each way, and the two "
    "astronauts who landed spent roughly twenty-one hours on the surface before they rejoined the third in orbit.",
    "A good experiment changes one thing at a time. If the result moves, you know what moved it; if you change "
    "two things together and the result moves, you only know that one of them, or both, did something.",
    "Shopping list: six eggs, a loaf of brown bread, two lemons, a bag of rice, olive oil, tomatoes, an onion, "
    "garlic, fresh basil, and something for dessert that does not need an oven.",
    "Light travels about three hundred thousand kilometres every second. Sunlight takes a little over eight "
    "minutes to reach the Earth, so when you look at the Sun you see it as it was eight minutes ago.",
)


@dataclass
class Stat:
    value: float
    unc: float | None               # the uncertainty of the value (None: from a single value)


@dataclass
class FormatScore:
    format: str
    count: int                       # scored positions, all texts
    kld: list[float]                 # per position, text after text (nats)
    top_match: list[bool]            # per position: the same top token
    p_diff: list[float]              # per position: p_q(next) - p_base(next)
    nll: list[float]                 # per position: -ln p_q(next)
    mean_kld: Stat
    kld_percentiles: dict[str, float]       # "min", "p0.1", ..., "p99.9", "max"
    mean_p_diff: Stat
    rms_p_diff: Stat
    p_diff_percentiles: dict[str, float]
    same_top: Stat
    ppl: Stat                    # PPL(Q)
    ppl_base: Stat               # PPL(base)
    cor_ln_ppl: float | None         # Cor(ln(PPL(Q)), ln(PPL(base)))
    ln_ppl_ratio: Stat           # Mean ln(PPL(Q)/PPL(base))
    ppl_ratio: Stat              # Mean PPL(Q)/PPL(base)
    ppl_diff: Stat               # Mean PPL(Q)-PPL(base)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def llama_rows(self) -> list[tuple[str, float, float | None, str]]:
        """(llama.cpp's name, value, uncertainty, unit) in the order perplexity.cpp prints them; unit "%" means
        the value and uncertainty are already multiplied by 100, as llama.cpp prints Δp and Same top p."""
        rows = [("Mean PPL(Q)", self.ppl.value, self.ppl.unc, ""),
                ("Mean PPL(base)", self.ppl_base.value, self.ppl_base.unc, ""),
                ("Cor(ln(PPL(Q)), ln(PPL(base)))", None if self.cor_ln_ppl is None else 100 * self.cor_ln_ppl,
                 None, "%"),
                ("Mean ln(PPL(Q)/PPL(base))", self.ln_ppl_ratio.value, self.ln_ppl_ratio.unc, ""),
                ("Mean PPL(Q)/PPL(base)", self.ppl_ratio.value, self.ppl_ratio.unc, ""),
                ("Mean PPL(Q)-PPL(base)", self.ppl_diff.value, self.ppl_diff.unc, ""),
                ("Mean    KLD", self.mean_kld.value, self.mean_kld.unc, "")]
        rows += [(_label(k, "KLD"), v, None, "") for k, v in reversed(self.kld_percentiles.items())]
        rows += [("Mean    Δp", *_percent(self.mean_p_diff), "%")]
        rows += [(_label(k, "Δp"), 100 * v, None, "%") for k, v in reversed(self.p_diff_percentiles.items())]
        rows += [("RMS Δp", *_percent(self.rms_p_diff), "%"), ("Same top p", *_percent(self.same_top), "%")]
        return rows


@dataclass
class Scoreboard:
    reference: str                   # the base model
    embed: bool
    texts: int
    tokens: int                      # tokens over all texts
    count: int                       # scored positions (tokens - texts)
    nll_base: list[float]            # per position: -ln p_base(next)
    formats: list[FormatScore] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "formats"}
        d["few"] = self.count < FEW_TOKENS
        d["formats"] = {r.format: r.as_dict() for r in self.formats}
        return d

    def result(self, fmt: str) -> FormatScore:
        return next(r for r in self.formats if r.format == fmt.upper())


def _percent(e: Stat) -> tuple[float, float | None]:
    return 100 * e.value, None if e.unc is None else 100 * e.unc


def _label(key: str, what: str) -> str:
    """A percentile key as perplexity.cpp labels it: "Maximum KLD", "99.9%   KLD", "Median  KLD", " 1.0%   KLD"."""
    if key in ("min", "max"):
        return f"{'Minimum' if key == 'min' else 'Maximum'} {what}"
    p = float(key[1:])
    return f"Median  {what}" if p == 50 else f"{p:4.1f}%   {what}"


# ---- statistics: pure functions of the per-position figures ---------------------------------------------------
def mean_and_uncertainty(x) -> Stat:
    """perplexity.cpp's mean_and_uncertainty: the mean and sqrt(population variance / (n - 1)), i.e. the sample
    standard deviation over sqrt(n); None for one value."""
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        raise InputError("no scored positions")
    return Stat(float(x.mean()), float(math.sqrt(x.var() / (x.size - 1))) if x.size > 1 else None)


def percentiles(x) -> dict[str, float]:
    """perplexity.cpp's percentile(): over the sorted values, linear interpolation at fraction × (n - 1)."""
    v = np.sort(np.asarray(x, dtype=np.float64))
    out = {"min": float(v[0])}
    for p in PERCENTILES:
        at = p / 100 * (v.size - 1)
        i = int(at)
        j = min(i + 1, v.size - 1)
        out[f"p{p:g}"] = float((1 - (at - i)) * v[i] + (at - i) * v[j])
    out["max"] = float(v[-1])
    return out


def _times(scale: float, e: Stat) -> float | None:
    return None if e.unc is None else scale * e.unc


def summarize(fmt: str, kld, top_match, nll, nll_base) -> FormatScore:
    """One format's figures from its per-position KLD, top-token agreement and NLL, and the base's NLL."""
    kld, match = np.asarray(kld, np.float64), np.asarray(top_match, bool)
    nll, nll_base = np.asarray(nll, np.float64), np.asarray(nll_base, np.float64)
    n = kld.size
    p_diff = np.exp(-nll) - np.exp(-nll_base)
    ln_q, ln_base = mean_and_uncertainty(nll), mean_and_uncertainty(nll_base)
    ln_ratio = mean_and_uncertainty(nll - nll_base)          # sqrt(u_q² + u_base² - 2 cov), as one variance
    mse = mean_and_uncertainty(p_diff ** 2)
    rms = math.sqrt(mse.value)
    k = int(match.sum())
    same = k / n
    cov = float(((nll - nll.mean()) * (nll_base - nll_base.mean())).mean() / (n - 1)) if n > 1 else None
    cor = cov / (ln_q.unc * ln_base.unc) if cov is not None and ln_q.unc and ln_base.unc else None
    ppl, ppl_base = math.exp(ln_q.value), math.exp(ln_base.value)
    ratio = math.exp(ln_ratio.value)
    ppl_e, base_e = Stat(ppl, _times(ppl, ln_q)), Stat(ppl_base, _times(ppl_base, ln_base))
    diff_unc = None if cov is None else math.sqrt(max(
        ppl_e.unc ** 2 + base_e.unc ** 2 - 2 * ppl * ppl_base * cov, 0.0))
    return FormatScore(
        format=fmt, count=n, kld=kld.tolist(), top_match=match.tolist(), p_diff=p_diff.tolist(), nll=nll.tolist(),
        mean_kld=mean_and_uncertainty(kld), kld_percentiles=percentiles(kld),
        mean_p_diff=mean_and_uncertainty(p_diff),
        rms_p_diff=Stat(rms, None if mse.unc is None else (0.5 / rms * mse.unc if rms > 0 else 0.0)),
        p_diff_percentiles=percentiles(p_diff),
        same_top=Stat(same, math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else None),
        ppl=ppl_e, ppl_base=base_e, cor_ln_ppl=cor, ln_ppl_ratio=ln_ratio,
        ppl_ratio=Stat(ratio, _times(ratio, ln_ratio)), ppl_diff=Stat(ppl - ppl_base, diff_unc))


def split_texts(text: str) -> list[str]:
    """Texts written one after another, a blank line between two (a file's, the page's box): each paragraph, with
    its own line breaks kept (code stays code)."""
    parts: list[list[str]] = [[]]
    for line in text.splitlines():
        if line.strip():
            parts[-1].append(line)
        elif parts[-1]:
            parts.append([])
    return ["\n".join(p) for p in parts if p]


# ---- the model work -------------------------------------------------------------------------------------------
def text_ids(model: Model, prompts, *, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Each text's tokens (engine.generate.prompt_ids: the app's tokenization of a prompt; a list of ids is taken
    as it is), checked before any model work: at least one text, each of two tokens or more, and at most
    max_tokens over all of them."""
    prompts = list(prompts)
    if not prompts:
        raise InputError("no texts to score: give at least one (or leave them out for the built-in set)")
    out = []
    for i, p in enumerate(prompts):
        try:
            ids = prompt_ids(model, p)
        except InputError as e:
            raise InputError(f"text {i + 1}: {e}") from None
        if len(ids) < 2:
            raise InputError(f"text {i + 1} is {len(ids)} token long: a score needs a next token to predict")
        out.append(ids)
    total = sum(len(x) for x in out)
    if total > max_tokens:
        raise InputError(f"the texts hold {total:,} tokens ({len(out)} text{'' if len(out) == 1 else 's'}); at most "
                         f"{max_tokens:,} are scored here (drop texts or shorten them)")
    return out


def _nll(lp: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """-ln p(next) per scored row of lp (T-1, V): the text's own next tokens."""
    return -lp.gather(1, torch.as_tensor(ids[1:], dtype=torch.long)[:, None])[:, 0]


def scoreboard(model: Model, prompts=PROMPTS, formats=DEFAULT_FORMATS, *, embed: bool = False,
               max_tokens: int = MAX_TOKENS, on_progress: OnProgress | None = None) -> Scoreboard:
    """Every format scored against model (float32) over the texts (module docstring). Bad input (no text, a text
    of one token, more than max_tokens tokens, an unknown format, a model not in float32) is an InputError before
    any model work. on_progress (engine.progress) hears each base forward, each format's quantization and each of
    its forwards before they start, and the end; a STOP raises engine.progress.Stopped before the next one."""
    if model.dtype != torch.float32:
        raise InputError(f"quantization is compared against float32 weights; this model is {model.dtype}")
    fmts = check_formats(formats)
    texts = text_ids(model, prompts, max_tokens=max_tokens)
    total = len(texts) + len(fmts) * (1 + len(texts))
    done = 0
    base: list[torch.Tensor] = []                      # each text's float32 logits (T-1, V): what KL reads
    nll_base = []
    for i, ids in enumerate(texts):
        tell_units(on_progress, done, total, f"the float32 base over text {i + 1} of {len(texts)}")
        base.append(model.logits(ids)[:-1])
        nll_base.append(_nll(log_probs(base[-1]), ids))
        done += 1
    nll_base_all = torch.cat(nll_base)
    board = Scoreboard(f"{model.name} ({str(model.dtype).removeprefix('torch.')})", embed, len(texts),
                       sum(len(x) for x in texts), int(nll_base_all.numel()), nll_base_all.tolist())
    for fmt in fmts:
        tell_units(on_progress, done, total, f"quantizing to {fmt}")
        quant = quantized_model(model, fmt, embed=embed)
        done += 1
        kld, match, nll = [], [], []
        for i, ids in enumerate(texts):
            tell_units(on_progress, done, total, f"{fmt} over text {i + 1} of {len(texts)}")
            q_lp = log_probs(quant.logits(ids)[:-1])
            k, m = step_figures(log_probs(base[i]), q_lp)
            kld.append(k), match.append(m), nll.append(_nll(q_lp, ids))
            done += 1
        del quant                                      # one extra model at a time
        board.formats.append(summarize(fmt, torch.cat(kld).numpy(), torch.cat(match).numpy(),
                                       torch.cat(nll).numpy(), nll_base_all.numpy()))
    tell_units(on_progress, total, total, "done")
    return board
