"""Strict loading of Hugging Face safetensors checkpoints into the engine's weight layout.

One explicit name map (HF name -> internal slot, expected shape). A missing, unexpected or mis-shaped
tensor is an error naming it. q/k/v and gate/up are fused after loading so that decode runs one matmul
where the checkpoint has three (or two); the hooks split them again by name. Matrices are stored
transposed, (in, out): on the CPU `x @ W` with that layout streams the weights about twice as fast as
`F.linear(x, W)` with HF's (out, in) layout at batch 1 (MKL's gemv path is single-threaded), and decode is
bound by reading the weights.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.family import part_shape
from engine.family.slots import BY_FIELD, FIELDS
from engine.quant_matrix import QuantMatrix

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class LayerWeights:
    """One block's weights, one field per slot of engine.family.slots (None where the family's block has no such
    weight). Matrices are stored (in, out)."""
    attn_norm: torch.Tensor | None = None       # (d,)
    attn_norm_bias: torch.Tensor | None = None  # (d,) LayerNorm's
    wqkv: torch.Tensor | None = None            # (d, (H + 2K) * hd)  columns: q heads, then k heads, then v heads
    bqkv: torch.Tensor | None = None            # ((H + 2K) * hd,)
    q_norm: torch.Tensor | None = None          # (hd,) per head, or (H * hd,) over the projection
    k_norm: torch.Tensor | None = None          # (hd,) or (K * hd,)
    wo: torch.Tensor | None = None              # (H * hd, d)
    bo: torch.Tensor | None = None              # (d,)
    attn_post_norm: torch.Tensor | None = None  # (d,)
    mlp_norm: torch.Tensor | None = None        # (d,)
    mlp_norm_bias: torch.Tensor | None = None   # (d,) LayerNorm's
    w_gate_up: torch.Tensor | None = None       # (d, 2F)  columns: gate, then up
    w_up: torch.Tensor | None = None            # (d, F)  a plain MLP's
    b_up: torch.Tensor | None = None            # (F,)
    w_down: torch.Tensor | None = None          # (F, d)
    b_down: torch.Tensor | None = None          # (d,)
    router: torch.Tensor | None = None          # (d, E)
    experts_gate_up: torch.Tensor | None = None  # (E, d, 2Fe)
    experts_down: torch.Tensor | None = None    # (E, Fe, d)
    mlp_post_norm: torch.Tensor | None = None   # (d,)

    def present(self) -> dict[str, torch.Tensor]:
        return {f: t for f in FIELDS if (t := getattr(self, f)) is not None}


@dataclass
class Weights:
    embed: torch.Tensor          # (V, d)  rows looked up by token id
    layers: list[LayerWeights]
    norm: torch.Tensor           # (d,)
    lm_head: torch.Tensor        # (d, V)  when tied, embed is this matrix's transpose (one copy: tied())
    norm_bias: torch.Tensor | None = None    # (d,) the final LayerNorm's bias
    pos_embed: torch.Tensor | None = None    # (n_positions, d) learned absolute positions (GPT-2)
    head_bias: torch.Tensor | None = None    # (V,) the lm_head's bias (Phi)
    notes: list[str] = field(default_factory=list)    # what a load "as stored" dequantised (engine.gguf_stored)

    def tied(self) -> bool:
        """Whether embed is a view of lm_head (a tied checkpoint's one matrix, read both ways; kept quantised, the
        one QuantMatrix is both: its rows looked up, and its product)."""
        if isinstance(self.embed, QuantMatrix) or isinstance(self.lm_head, QuantMatrix):
            return self.embed is self.lm_head
        return self.embed.data_ptr() == self.lm_head.data_ptr() and self.embed.shape == self.lm_head.t().shape

    def embed_rows(self, ids) -> torch.Tensor:
        """The embedding rows of these token ids as float (a QuantMatrix decodes just those rows)."""
        if isinstance(self.embed, QuantMatrix):
            return self.embed.rows(torch.as_tensor(ids))
        return self.embed[ids]

    def floats(self) -> Weights:
        """These weights with every matrix kept quantised replaced by its dequantised float32 value (QuantMatrix.
        dequantize; a tied matrix stays one): what a tool that needs the float matrices reads. Self when none is."""
        if not self.quantized():
            return self
        layers = [LayerWeights(**{f: as_float(t) for f, t in lw.present().items()}) for lw in self.layers]
        head = as_float(self.lm_head)
        embed = head.t() if self.tied() else (self.embed.dequantize().t().contiguous()
                                              if isinstance(self.embed, QuantMatrix) else self.embed)
        return dataclasses.replace(self, embed=embed, layers=layers, lm_head=head, notes=[*self.notes, FLOAT_NOTE])

    def nbytes(self) -> int:
        return sum(self.nbytes_by_dtype().values())

    def values(self) -> int:
        """The number of weight values, each tensor once (a tied matrix once; a matrix kept quantised by its shape)."""
        return sum(math.prod(t.shape) for t in {id(t): t for t in self.all()}.values())

    def dequantized_nbytes(self) -> int:
        """The float32 bytes floats() allocates: each matrix kept quantised, dequantised, once."""
        kept = {id(t): t for t in self.all() if isinstance(t, QuantMatrix)}
        return sum(4 * math.prod(t.shape) for t in kept.values())

    def quantized(self) -> list[str]:
        """The names of the matrices kept in a GGUF file's quantised blocks (engine.gguf_stored), none for float."""
        return [t.name for t in self.all() if isinstance(t, QuantMatrix)]

    def kept_arithmetics(self) -> set[str]:
        """How the matrices kept in GGUF blocks are multiplied (QuantMatrix.arithmetic: "float", "int8"); empty for
        float weights."""
        return {t.arithmetic for t in self.all() if isinstance(t, QuantMatrix)}

    def all(self) -> list:
        extra = [t for t in (self.norm_bias, self.pos_embed, self.head_bias) if t is not None]
        return [self.embed, self.norm, self.lm_head, *extra] + [x for lw in self.layers for x in lw.present().values()]

    def nbytes_by_dtype(self) -> dict[torch.dtype | str, int]:
        """Bytes of the weights per dtype, largest first: each tensor's memory once (a tied model's embedding and
        lm_head are one matrix, engine.weights.tied; a variant's shared tensors are the model's). A matrix kept
        quantised counts its block bytes under its format's name ("Q4_1")."""
        seen, out = set(), {}
        for t in self.all():
            quant = isinstance(t, QuantMatrix)
            ptr = t.blocks.data_ptr() if quant else t.data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                key, n = (t.format, t.nbytes) if quant else (t.dtype, t.numel() * t.element_size())
                out[key] = out.get(key, 0) + n
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


FLOAT_NOTE = "weights kept quantized: this uses their dequantised float32 values (QuantMatrix.dequantize)"


def as_float(t):
    """A weight as a float tensor in the engine's layout: a QuantMatrix dequantised ((in, out)), a tensor as it is."""
    return t.dequantize() if isinstance(t, QuantMatrix) else t


def layer_parts(cfg: ModelConfig, i: int) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Layer i's slots -> the Hugging Face tensors they are made of (full names, shapes), from the family's
    declaration. An experts part ("{e}") stands for one tensor per expert, in expert order."""
    out, ck = {}, cfg.family.checkpoint
    prefix = ck.layer.format(i=i)
    for slot, parts in cfg.family.slots(cfg.layer_moe[i], cfg.attention_bias).items():
        names = []
        flip = ck.transposed and BY_FIELD[slot].kind == "matrix"     # Conv1D: stored (in, out)
        for hf, key, _ in parts:
            experts = range(cfg.num_experts) if "{e}" in hf else [None]
            shape = part_shape(key, cfg)
            names += [(prefix + hf.format(e=e), shape[::-1] if flip else shape) for e in experts]
        out[slot] = names
    return out


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must hold, by its Hugging Face name, with its shape."""
    d, ck = cfg.hidden_size, cfg.family.checkpoint
    names = {ck.embed: (cfg.vocab_size, d), ck.norm: (d,)}
    if ck.norm_bias:
        names[ck.norm_bias] = (d,)
    if ck.pos_embed:
        names[ck.pos_embed] = (cfg.max_position_embeddings, d)
    if not cfg.tie_word_embeddings:
        names[ck.lm_head] = (cfg.vocab_size, d)
    if ck.lm_head_bias:
        names[ck.lm_head_bias] = (cfg.vocab_size,)
    for i in range(cfg.num_layers):
        names |= {n: shape for parts in layer_parts(cfg, i).values() for n, shape in parts}
    return names


def _shard_files(model_dir: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, RecursionError) as e:
            raise ModelLoadError(f"{index.name}: not a valid safetensors index ({type(e).__name__})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in weight_map.items()):
            raise ModelLoadError(f"{index.name}: weight_map must map tensor names to file names")
        root = model_dir.resolve()
        files = {}
        for name, fname in weight_map.items():
            path = (model_dir / fname).resolve()
            if path.parent != root or path.suffix != ".safetensors":
                raise ModelLoadError(f"{index.name}: {name!r} points at {fname!r}; shards must be .safetensors "
                                     "files in the model's own folder")
            files[name] = path
        return files
    if single.is_file():
        return {name: single for name in _keys(single)}
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")) or any(model_dir.glob("*.pth")):
        raise ModelLoadError(f"{model_dir}: only pickle checkpoints (.bin/.pt) found; this engine never unpickles. "
                             "Convert to model.safetensors first.")
    raise ModelLoadError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def _keys(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own error type for truncated/corrupt headers
        raise ModelLoadError(f"{path}: cannot read safetensors file (truncated or corrupt?): {e}") from None


def load_weights(model_dir: str | Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 progress=None, span: tuple[float, float] = (0.95, 0.99)) -> Weights:
    """Every expected tensor, checked (shape, dtype, finite) and converted. progress(fraction, message): the
    load's callback (engine.loader), told per tensor across `span`."""
    model_dir = Path(model_dir)
    expected = expected_tensors(cfg)
    ck = cfg.family.checkpoint
    where = _shard_files(model_dir)
    stored = {n: n for n in where}       # the engine's name of a tensor -> its name in the file
    if ck.optional_prefix and not any(n.startswith(ck.optional_prefix) for n in where):
        stored = {ck.optional_prefix + n: n for n in where}
        where = {ck.optional_prefix + n: f for n, f in where.items()}
    ignore = re.compile(ck.ignored)
    ignored = {n for n in where if ignore.fullmatch(n)}
    if cfg.tie_word_embeddings and ck.lm_head in where:
        ignored.add(ck.lm_head)  # tied models sometimes save a copy; the embedding is used, as in HF
    missing = sorted(set(expected) - set(where))
    unexpected = sorted(set(where) - set(expected) - ignored)
    if missing:
        raise ModelLoadError(f"{model_dir}: missing tensor(s): {', '.join(missing[:5])}"
                             + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
    if unexpected:
        raise ModelLoadError(f"{model_dir}: unexpected tensor(s): {', '.join(unexpected[:5])}"
                             + (f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else ""))

    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(where[name], []).append(name)
    raw: dict[str, torch.Tensor] = {}
    lo, hi = span
    for path, names in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    if progress:
                        progress(lo + (hi - lo) * len(raw) / len(expected),
                                 f"loading and checking weights: tensor {len(raw) + 1} of {len(expected)} ({name})")
                    t = _checked(name, f.get_tensor(stored[name]), expected[name], path)
                    raw[name] = t.to(device=device, dtype=dtype)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read tensors (truncated or corrupt?): {e}") from None
    return _assemble(raw, cfg)


def _checked(name: str, t: torch.Tensor, shape: tuple[int, ...], path: Path) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise ModelLoadError(f"{path}: tensor {name} has shape {tuple(t.shape)}, expected {shape}")
    if t.dtype not in FLOAT_DTYPES:
        raise ModelLoadError(f"{path}: tensor {name} has dtype {t.dtype}; expected float32, float16 or bfloat16")
    if not bool(torch.isfinite(t).all()):
        raise ModelLoadError(f"{path}: tensor {name} contains NaN or Inf values")
    return t


def _assemble(raw: dict[str, torch.Tensor], cfg: ModelConfig) -> Weights:
    """The checkpoint's tensors in the engine's slots: parts concatenated along the output dimension, matrices
    transposed to (in, out), experts stacked, and the family's norm offset folded in (Gemma's (1 + w), computed in
    float32 as transformers does)."""
    off, ck = cfg.family.norm_offset, cfg.family.checkpoint
    layers = []
    for i in range(cfg.num_layers):
        slots = {}
        for slot, parts in layer_parts(cfg, i).items():
            kind = BY_FIELD[slot].kind
            ts = [raw.pop(n) for n, _ in parts]
            if kind == "experts":       # per expert: its parts (gate, up / down) side by side, (in, out)
                per = len(ts) // cfg.num_experts
                slots[slot] = torch.stack([_t(torch.cat(ts[e::cfg.num_experts])) if per > 1 else _t(ts[e])
                                           for e in range(cfg.num_experts)])
            elif kind in ("matrix", "router"):
                slots[slot] = _own(torch.cat(ts, dim=1)) if ck.transposed and kind == "matrix" else _t(torch.cat(ts))
            elif kind == "norm":
                slots[slot] = _offset(ts[0], off)
            else:
                slots[slot] = torch.cat(ts)
        if ck.qkv_per_head:
            slots["wqkv"] = _heads_first(slots["wqkv"], cfg, 1)
            if "bqkv" in slots:
                slots["bqkv"] = _heads_first(slots["bqkv"], cfg, 0)
        layers.append(LayerWeights(**slots))
    embed = raw.pop(ck.embed)
    if cfg.tie_word_embeddings:     # one matrix: the lm_head (d, V), and the embedding its transposed view (V, d)
        lm_head = _t(embed)
        embed = lm_head.t()
    else:
        embed, lm_head = _own(embed), _t(raw.pop(ck.lm_head))
    return Weights(embed=embed, layers=layers, norm=_offset(raw.pop(ck.norm), off), lm_head=lm_head,
                   norm_bias=_own(raw.pop(ck.norm_bias)) if ck.norm_bias else None,
                   pos_embed=_own(raw.pop(ck.pos_embed)) if ck.pos_embed else None,
                   head_bias=_own(raw.pop(ck.lm_head_bias)) if ck.lm_head_bias else None)


def _heads_first(t: torch.Tensor, cfg: ModelConfig, dim: int) -> torch.Tensor:
    """A fused qkv laid out per head (GPT-NeoX: head h's q, k, v side by side along dim) -> the engine's q heads,
    then k heads, then v heads."""
    H, hd = cfg.num_heads, cfg.head_dim
    if dim == 0:
        return t.view(H, 3, hd).transpose(0, 1).reshape(-1).contiguous()
    d = t.shape[0]
    return t.view(d, H, 3, hd).transpose(1, 2).reshape(d, -1).contiguous()


def _own(t: torch.Tensor) -> torch.Tensor:
    """t in memory of its own: safetensors hands out views of the file's memory map, which would keep the whole file
    mapped (and the pages read counted in the process's resident memory) for as long as one such view lives."""
    return t if t.untyped_storage().resizable() else t.clone()


def _offset(w: torch.Tensor, off: float) -> torch.Tensor:
    return _own(w) if not off else (w.float() + off).to(w.dtype)


def _t(w: torch.Tensor) -> torch.Tensor:
    """(out, in) checkpoint layout -> contiguous (in, out)."""
    return w.t().contiguous()
