"""The report's tool sections: what the session's tools computed beside the run (issue 47: "appears in the offline
report where it applies"): a QK score split, a steering run, a determinism check, a quantization scoreboard, a GGUF
file as stored against its dequantised self, a tuned lens, a head atlas. Each comes as the tool's own JSON (`as_dict()`, the
`--json` of its CLI twin: `python -m engine qk|steer|quant-scoreboard|quant-stored|doctor --determinism|lens|atlas`; the
tuned lens also as the Activations page computed it at one position of the run) and is turned here into a
titled table of plain values for engine.report.html to draw.

A tool's JSON may come from a file a user hands the CLI (`report --tool-json FILE`), so it is input like any other:
each kind is recognised by its keys, every value is checked for its type (text cut to MAX_TEXT characters, numbers
finite or shown as missing), rows are bounded (MAX_ROWS), and anything that is not what it should be is an
InputError naming the file's kind and the field."""
from __future__ import annotations

import json
import math
from pathlib import Path

from engine.errors import InputError

MAX_FILE_BYTES = 8 << 20     # a tool's JSON file (a scoreboard keeps its per-position lists: a few MB at most)
MAX_ROWS = 40
MAX_TEXT = 200
KINDS = ("qk", "steering", "determinism", "scoreboard", "stored", "tuned-lens", "atlas")
MAX_HEADS = 1 << 16          # an atlas's heads_scored (layers x heads)


def kind_of(d: dict) -> str:
    """Which tool made this JSON (by its keys); InputError when none did."""
    if not isinstance(d, dict):
        raise InputError("a tool's JSON must be an object")
    if "determinism" in d and isinstance(d["determinism"], dict):
        return "determinism"                  # the doctor's report with its --determinism section
    for kind, keys in (("qk", {"top_pairs", "score", "remainder"}), ("steering", {"steered_text", "plain_text"}),
                       ("determinism", {"trials", "headline"}), ("scoreboard", {"formats", "reference"}),
                       ("stored", {"stored", "dequantized", "per_stage", "tolerance"}),
                       ("tuned-lens", {"kl", "weights_checksum", "recipe"}),
                       ("atlas", {"heads_scored", "top", "scores"})):
        if keys <= set(d):
            return kind
    raise InputError(f"not the JSON of a tool the report shows ({', '.join(KINDS)}); its keys: "
                     f"{', '.join(sorted(map(str, d))[:8])}")


def read_tool_json(path: str) -> dict:
    """One --tool-json file, parsed (bounded in size), its kind recognised."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"--tool-json {path!r}: no such file")
    if p.stat().st_size > MAX_FILE_BYTES:
        raise InputError(f"--tool-json {path!r}: over {MAX_FILE_BYTES >> 20} MB")
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise InputError(f"--tool-json {path!r}: not valid JSON ({str(e)[:80]})") from None
    kind_of(d)
    return d


def _text(v, what: str) -> str:
    if v is None:
        return ""
    if not isinstance(v, (str, int, float)) or isinstance(v, bool):
        raise InputError(f"the tool's {what} must be text")
    return str(v)[:MAX_TEXT]


def _num(v, what: str) -> float | None:
    """A finite number, or None (shown as missing) for null, NaN or an infinity."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InputError(f"the tool's {what} must be a number")
    return float(v) if math.isfinite(v) else None


def _list(v, what: str) -> list:
    if not isinstance(v, list):
        raise InputError(f"the tool's {what} must be a list")
    return v[:MAX_ROWS]


def _count(v, what: str) -> int:
    if not isinstance(v, list):
        raise InputError(f"the tool's {what} must be a list")
    return len(v)


def _obj(v, what: str) -> dict:
    if not isinstance(v, dict):
        raise InputError(f"the tool's {what} must be an object")
    return v


def _qk(d: dict) -> dict:
    exact = d.get("exact") is True
    caption = (f"Layer {int(_num(d.get('layer'), 'layer') or 0)} head {int(_num(d.get('head'), 'head') or 0)}: the "
               f"pre-softmax score of query position {_text(d.get('query'), 'query')} at key position "
               f"{_text(d.get('key'), 'key')} is {_num(d.get('score'), 'score')}; the terms sum to "
               f"{_num(d.get('total'), 'total')} (remainder {_num(d.get('remainder'), 'remainder')}"
               + ("" if exact else f"; inexact: {_text(d.get('why_inexact'), 'reason')}") + ").")
    rows = [[_text(p.get("query side"), "query side"), _text(p.get("key side"), "key side"),
             _num(p.get("term"), "term")] for p in map(lambda x: _obj(x, "pair"), _list(d["top_pairs"], "pairs"))]
    return {"id": "tool-qk", "title": "Why this head attends there (QK attribution)", "caption": caption,
            "header": ["query side", "key side", "term"], "rows": rows, "numeric": [2]}


def _steering(d: dict) -> dict:
    caption = (f"{_text(d.get('stage'), 'stage') or 'layer ' + _text(d.get('layer'), 'layer')}, coefficient "
               f"{_num(d.get('coefficient'), 'coefficient')}. Plain: {_text(d.get('plain_text'), 'plain text')!r}. "
               f"Steered: {_text(d.get('steered_text'), 'steered text')!r}.")
    rows = [[_num(s.get("step"), "step"), repr(_text(s.get("text"), "token")),
             _num(s.get("kl_steered_plain"), "KL"), _num(s.get("p_steered"), "p"), _num(s.get("p_plain"), "p"),
             repr(_text(s.get("plain_top_text"), "token"))]
            for s in map(lambda x: _obj(x, "step"), _list(d.get("steps", []), "steps"))]
    return {"id": "tool-steering", "title": "Steering", "caption": caption,
            "header": ["step", "steered token", "KL(steered || plain)", "p steered", "p plain", "plain's top"],
            "rows": rows, "numeric": [2, 3, 4]}


def _determinism(d: dict) -> dict:
    d = _obj(d.get("determinism", d), "determinism report")
    caption = f"{_text(d.get('headline'), 'headline')}. Reference: {_text(d.get('reference'), 'reference')}."
    rows = []
    for t in map(lambda x: _obj(x, "trial"), _list(d.get("trials", []), "trials")):
        where = t.get("first_stage")
        stage = "" if not isinstance(where, dict) else _text(where.get("stage"), "stage")
        rows.append([_text(t.get("label"), "label"), _text(t.get("why"), "why"), "yes" if t.get("same_tokens") is True
                     else "no", "yes" if t.get("bit_identical") is True else "no",
                     _text(t.get("first_step"), "first step"), stage, _num(t.get("logits_max_abs"), "difference")])
    return {"id": "tool-determinism", "title": "Determinism", "caption": caption,
            "header": ["run", "why", "same tokens", "bit-identical", "first step", "first stage", "max |Δ logit|"],
            "rows": rows, "numeric": [6]}


def _stat(f: dict, key: str) -> float | None:
    v = f.get(key)
    return _num(v.get("value"), key) if isinstance(v, dict) else None


def _scoreboard(d: dict) -> dict:
    caption = (f"Against {_text(d.get('reference'), 'reference')}: {_text(d.get('texts'), 'texts')} texts, "
               f"{_text(d.get('count'), 'count')} scored positions (llama.cpp's --kl-divergence figures).")
    rows = [[_text(name, "format"), _stat(f, "mean_kld"), _stat(f, "same_top"), _stat(f, "rms_p_diff"),
             _stat(f, "ppl_ratio")]
            for name, f in list(_obj(d["formats"], "formats").items())[:MAX_ROWS] if isinstance(f, dict)]
    return {"id": "tool-scoreboard", "title": "Quantization scoreboard", "caption": caption,
            "header": ["format", "mean KLD", "same top p", "RMS Δp", "PPL(Q)/PPL(base)"], "rows": rows,
            "numeric": [1, 2, 3, 4]}


def _stored(d: dict) -> dict:
    tol = _num(d.get("tolerance"), "tolerance")
    caption = (f"{_text(d.get('stored'), 'stored')} against {_text(d.get('dequantized'), 'dequantized')} (the same "
               f"file dequantised to float32), token-aligned over {_text(d.get('positions'), 'positions')} positions: "
               f"logits max |Δ| {_num(d.get('logits_max_abs'), 'logits max |Δ|')}, KL mean "
               f"{_num(d.get('kl_mean'), 'KL mean')} nats, same top token {_num(d.get('same_top'), 'same top')}; "
               f"first stage over the tolerance {tol}: {_text(d.get('first_stage_over'), 'stage') or 'none'}. The "
               "stages with the largest relative L2 difference:")
    stages = [_obj(x, "stage") for x in d["per_stage"][:4096]] if isinstance(d["per_stage"], list) else []
    worst = sorted(stages, key=lambda r: -(_num(r.get("rel_l2"), "relative L2") or 0.0))
    rows = [[_text(r.get("stage"), "stage"), _num(r.get("max_abs"), "max |Δ|"), _num(r.get("rel_l2"), "relative L2"),
             "yes" if r.get("over") is True else "no"] for r in _list(worst, "stages")]
    return {"id": "tool-stored", "title": "GGUF as stored vs dequantised", "caption": caption,
            "header": ["stage", "max |Δ|", "relative L2", "over the tolerance"], "rows": rows, "numeric": [1, 2]}


def _tuned_lens(d: dict) -> dict:
    r = _obj(d.get("recipe"), "recipe")
    caption = (f"Each layer's mean KL (nats) to the model's final distribution over {_text(d.get('tokens'), 'tokens')} "
               f"held-out tokens: the logit lens reads the residual stream as it is, the tuned lens through its "
               f"layer's affine map (rank {_text(d.get('rank'), 'rank')}, fitted on {_text(r.get('tokens'), 'tokens')}"
               f" tokens of {_text(r.get('corpus'), 'corpus')} by {_text(r.get('script'), 'script')}) for weights "
               f"{_text(d.get('weights_checksum'), 'weights checksum')}.")
    if d.get("position") is not None:      # the Activations page's: one position of the run, not held-out text
        caption = (f"Each layer's KL (nats) to the model's final distribution at position "
                   f"{_text(d.get('position'), 'position')} of the run: the logit lens reads the residual stream as "
                   f"it is, the tuned lens through its layer's affine map (rank {_text(d.get('rank'), 'rank')}, "
                   f"fitted on {_text(r.get('tokens'), 'tokens')} tokens of {_text(r.get('corpus'), 'corpus')} by "
                   f"{_text(r.get('script'), 'script')}) for weights {_text(d.get('weights_checksum'), 'checksum')}.")
    rows = [[_num(k.get("layer"), "layer"), _num(k.get("logit_lens"), "KL"), _num(k.get("tuned_lens"), "KL")]
            for k in map(lambda x: _obj(x, "layer's KL"), _list(d["kl"], "kl"))]
    return {"id": "tool-tuned-lens", "title": "Logit lens and tuned lens", "caption": caption,
            "header": ["layer", "KL logit lens", "KL tuned lens"], "rows": rows, "numeric": [0, 1, 2]}


def _atlas(d: dict) -> dict:
    """The top heads by each score (the atlas's own ranking, `top`), each with its score from heads_scored."""
    heads = d["heads_scored"]
    if not isinstance(heads, list) or len(heads) > MAX_HEADS:
        raise InputError(f"the atlas's heads_scored must be a list of at most {MAX_HEADS} heads")
    names = [_text(n, "score name") for n in _list(d["scores"], "scores")]
    by = {}
    for h in heads:
        h = _obj(h, "head")
        by[(_num(h.get("layer"), "layer"), _num(h.get("head"), "head"))] = h
    top, rows = _obj(d["top"], "top"), []
    for name in names:
        for rank, pair in enumerate(_list(top.get(name, []), f"top heads by {name}")[:5]):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:     # JSON: a list; as_dict: a tuple
                raise InputError(f"the atlas's top heads by {name} must be [layer, head] pairs")
            layer, head = _num(pair[0], "layer"), _num(pair[1], "head")
            rows.append([name, rank + 1, layer, head, _num(by.get((layer, head), {}).get(name), name)])
    caption = (f"Every head of {_text(d.get('layers'), 'layers')} layers x {_text(d.get('heads'), 'heads')} heads "
               f"scored over {_count(d.get('texts', []), 'texts')} texts ({_text(d.get('tokens'), 'tokens')} "
               f"tokens) and {_text(d.get('repeats'), 'repeats')} x 2 x {_text(d.get('length'), 'length')} repeated "
               f"random tokens (seed {_text(d.get('seed'), 'seed')}); the five highest heads by each score "
               "(entropy: the five lowest, the sharpest).")
    return {"id": "tool-atlas", "title": "Head atlas", "caption": caption,
            "header": ["score", "rank", "layer", "head", "value"], "rows": rows[:MAX_ROWS], "numeric": [4]}


SECTIONS = {"qk": _qk, "steering": _steering, "determinism": _determinism, "scoreboard": _scoreboard,
            "stored": _stored, "tuned-lens": _tuned_lens, "atlas": _atlas}


def tool_sections(tools) -> list[dict]:
    """Each tool JSON (a list, in the order given) as a section: id, title, caption, header, rows (bounded), and
    which columns are numbers."""
    return [SECTIONS[kind_of(d)](d) for d in list(tools or [])[:len(KINDS) * 4]]
