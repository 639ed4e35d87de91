"""The native decode step (decode.c) behind engine.model: which calls may take it, and the call itself; and its
batched form (decode_rows.c: NativeDecoder.rows / serve_rows), which Model.forward_rows takes for engine.batch's
rows when every row's probe is served by it, under the same allow-list.

A model takes it only when everything it computes is on the allow-list of what decode.c implements (`refusal`): a
family in NATIVE_FAMILIES whose config has every variation at Llama's value (no q/k norms, post-norms, multipliers,
soft caps, windows, rotary fraction, layers without RoPE, experts), no biases, no precision plan, every weight a
contiguous matrix in the model's dtype, on the CPU in float32, bfloat16 or float16 (the kernels round each stage to
that dtype where the PyTorch forward holds a tensor of it and sum in float32: llama_ops.h), or, in a float32 model,
a GGUF matrix kept in its blocks (engine.quant_matrix.QuantMatrix, any format engine.native.quant.TYPES names):
decode.c multiplies the file's bytes by quant_ops.h's row dot product, the one the PyTorch forward's product of one
token sums with. The batched step (decode_rows.c) reads float matrices only: for a model with quantised weights
`rows_refusal` says so and serve_rows leaves the batch to the PyTorch forward. A call then takes it when it is one token and its probe is none
or asks only for what one pass of decode.c gives (Probe.served_by): statistics of any stages, per-layer timing marks,
and a capture of the logits (the app's inspected run asks for exactly these) -- no capture of any other stage, no
replacement, weight override or run-only epsilon. Anything else, or a library that could not be built, runs the
PyTorch forward, which stays the reference: tests hold the two to each other (in each dtype) and to transformers.

The native step reads the model's own weight matrices, row-major (in, out) as engine/weights.py stores them and the
PyTorch forward multiplies them: there is one copy of every weight in memory (an earlier version kept a second copy
laid out as panels of eight rows, the matrices' size again: 545 MB for the bundled model in fp32). With statistics,
a step that meets a NaN or an Inf is redone by the PyTorch forward (it rewrites the same cache position),
whose accounting of non-finite values is the reference.
"""
from __future__ import annotations

import ctypes
import dataclasses
import threading
import time

import torch

from engine.family.slots import MATRICES as SLOT_MATRICES
from engine.inspection.stages import PLAIN_STAGES, forward_stages
from engine.native import build
from engine.native.quant import TYPES as QUANT_TYPES

_P = ctypes.c_void_p
_FIELDS = [(n, ctypes.c_int) for n in ("L", "d", "H", "K", "hd", "F", "V", "max_len", "pos", "nth", "wtype",
                                        "ctype")] + [
    ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("x_in", _P)] + [
    (n, _P) for n in ("attn_norm", "wqkv", "wo", "mlp_norm", "wgu", "wdown", "kc", "vc", "cos", "sin",
                      "final_norm", "lm_head", "logits", "work", "stats", "marks")] + [
    (n, _P) for n in ("qwqkv", "qwo", "qwgu", "qwdown")] + [("qlm", ctypes.c_int)]


# What decode.c computes, named: a family whose block is Llama's, the slots it reads, and each config variation at the
# one value it implements. Anything else decodes on the PyTorch forward (a debugger never computes another model).
NATIVE_FAMILIES = ("llama", "mistral", "qwen2")
# The element types decode.c reads and writes (llama_ops.h's T_F32, T_BF16, T_F16): the weights' and activations'
# (the model's dtype), and the KV cache's.
TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
LAYER_SLOTS = ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down")
MATRICES = tuple(f for f in SLOT_MATRICES if f in LAYER_SLOTS)      # the products it streams
VARIATIONS = {"activation": "silu", "embed_scale": 1.0, "residual_scale": 1.0, "logits_divisor": 1.0,
              "attn_softcap": None, "final_softcap": None, "num_experts": 0, "rope_local_theta": None}


def refusal(model) -> str | None:
    """Why this model cannot take the native step (None: it can): the first thing off the allow-list."""
    cfg, w = model.config, model.weights
    kept = [t for t in w.all() if _kept(t)]
    other = sorted({t.format for t in kept} - set(QUANT_TYPES))
    if other:
        return f"weights kept quantized in {', '.join(other)} (decode.c decodes {', '.join(QUANT_TYPES)})"
    if kept and model.dtype != torch.float32:
        # QuantMatrix.matmul sums in float32 and returns x's dtype: decode.c's quantised products are float32's
        return f"weights kept quantized in a {model.dtype} model (decode.c multiplies GGUF blocks in float32 only)"
    if cfg.model_type not in NATIVE_FAMILIES:
        return f"family {cfg.model_type} is not in the native step's list ({', '.join(NATIVE_FAMILIES)})"
    for key, value in VARIATIONS.items():
        if getattr(cfg, key) != value:
            return f"{key}={getattr(cfg, key)!r} (the native step implements {value!r})"
    if cfg.attn_scale != cfg.head_dim ** -0.5 or cfg.rotary_dim != cfg.head_dim:
        return "a score scale or rotary fraction other than Llama's"
    if cfg.windowed or any(k != "main" for k in cfg.layer_rope) or cfg.rope_scaling.rope_type == "longrope":
        return "sliding windows, per-layer RoPE or longrope"
    if any(set(lw.present()) != set(LAYER_SLOTS) for lw in w.layers):
        return "weights beyond a plain Llama block (biases, norms, experts)"
    if model.device.type != "cpu" or model.dtype not in TYPES or model.cache_dtype not in TYPES \
            or model.fp32_units or model.resid_fp32_from is not None:
        return "not float32, bfloat16 or float16 on the CPU, or a precision plan"
    # a matrix kept in its blocks is whole blocks by construction (QuantMatrix): the rules below are the float kernel's
    mats = [t for t in [getattr(lw, f) for lw in w.layers for f in LAYER_SLOTS] if not _kept(t)]
    head = [] if _kept(w.lm_head) else [w.lm_head]
    if any(t.dtype != model.dtype or not t.is_contiguous() for t in [*mats, w.norm, *head]) \
            or any(n % 8 for t in [*mats, *head] if t.dim() == 2 for n in t.shape) \
            or cfg.head_dim % 2 or cfg.num_heads % cfg.num_kv_heads:
        return f"weights that are not contiguous {model.dtype} matrices in multiples of 8"
    return None


class StepArgs(ctypes.Structure):
    _fields_ = _FIELDS


class RowsArgs(ctypes.Structure):       # decode_rows.c's Rows
    _fields_ = [(n, ctypes.c_int) for n in ("L", "d", "H", "K", "hd", "F", "V", "B", "nth", "wtype", "ctype")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)] + [
        (n, _P) for n in ("x_in", "attn_norm", "wqkv", "wo", "mlp_norm", "wgu", "wdown", "kc", "vc", "max_len", "pos",
                          "cos", "sin", "final_norm", "lm_head", "logits", "work", "stats", "marks", "bad")]



class NativeDecoder:
    """Built once per model (None from `for_model` when the model cannot take it)."""

    def __init__(self, model, lib: ctypes.CDLL) -> None:
        self.lib, self.model = lib, model
        self.names = forward_stages(model.config.num_layers)    # its statistics rows, in order
        self.layers = [None] + [i for i in range(model.config.num_layers) for _ in PLAIN_STAGES] + [None, None]
        self.mark_labels = ["embed", *(f"blocks.{i}" for i in range(model.config.num_layers)), "logits"]
        self._layer_ptrs, self._lock = None, threading.Lock()    # made once, however many runs start at once
        kept = model.weights.quantized()
        # decode_rows.c reads float (in, out) matrices only; a lone token's step (decode.c) reads GGUF blocks too
        self.rows_refusal = f"weights kept quantized ({len(kept)} GGUF matrices, e.g. {kept[0]})" if kept else ""

    @property
    def layer_ptrs(self) -> dict:
        """Slot -> a C array of the layers' weight pointers, made at the first decode step (the weights as they are
        then: a model whose layers are replaced before it decodes is read as replaced)."""
        with self._lock:
            if self._layer_ptrs is None:
                self._keep = []      # ctypes arrays the StepArgs point into
                layers = self.model.weights.layers
                self._layer_ptrs = {f: self._ptrs([getattr(lw, f) for lw in layers]) for f in LAYER_SLOTS}
                self._layer_ptrs |= {f"q_{f}": self._types([getattr(lw, f) for lw in layers]) for f in MATRICES}
        return self._layer_ptrs

    def _ptrs(self, tensors) -> ctypes.c_void_p:
        """A C array of the tensors' data pointers (a matrix kept quantised: its blocks'; kept alive with this
        decoder)."""
        arr = (_P * len(tensors))(*[_data(t) for t in tensors])
        self._keep.append(arr)
        return ctypes.cast(arr, _P)

    def _types(self, matrices) -> ctypes.c_void_p:
        """A C array of each matrix's GGML type for decode.c: 0 for a float (in, out) matrix."""
        arr = (ctypes.c_int * len(matrices))(*[_qtype(t) for t in matrices])
        self._keep.append(arr)
        return ctypes.cast(arr, _P)

    def sharing(self, variant, field: str, layers: dict[int, torch.Tensor]) -> "NativeDecoder | None":
        """The decode step of `variant`, a model that differs from this decoder's model only in some layers' `field`
        matrix (one of MATRICES; layers: layer -> the variant's matrix, as the weights store it): it reads the
        variant's own weights, every other one of which is this model's (no copy). None when the variant differs in
        anything else (another tensor, dtype, config or device)."""
        mine, theirs = self.model.weights, variant.weights
        same = [(getattr(a, f), getattr(b, f)) for i, (a, b) in enumerate(zip(mine.layers, theirs.layers))
                for f in (f.name for f in dataclasses.fields(a)) if not (f == field and i in layers)]
        same += [(mine.embed, theirs.embed), (mine.norm, theirs.norm), (mine.lm_head, theirs.lm_head)]
        if (mine.quantized() or field not in MATRICES or variant.config != self.model.config or variant.dtype != self.model.dtype
                or variant.device != self.model.device or variant.fp32_units or variant.resid_fp32_from is not None
                or len(theirs.layers) != len(mine.layers) or any(a is not b for a, b in same)
                or any(getattr(theirs.layers[i], field) is not w or w.shape != getattr(lw, field).shape
                       or w.dtype != self.model.dtype or not w.is_contiguous()
                       for i, w in layers.items() for lw in [mine.layers[i]])):
            return None
        return NativeDecoder(variant, self.lib)

    @classmethod
    def for_model(cls, model) -> "NativeDecoder | None":
        if refusal(model) is not None:
            return None
        lib, _ = build.load()
        return None if lib is None else cls(model, lib)

    def _work(self, cache, nth: int) -> torch.Tensor:
        c = self.model.config
        return cache.scratch("native_decode", self.lib.llmi_work_floats(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size, cache.max_len,
            nth))

    def __call__(self, token: int, cache, pos: int, eps: float, stats: bool, timing: bool = False) -> tuple:
        """One token at pos -> (logits (1, V), statistics (G, 1, 7) or None, status: 0, or 1 = a NaN/Inf met,
        marks: with timing, (label, seconds since the call began) after the embedding, each layer and the logits
        (`mark_labels`), else None)."""
        m, c = self.model, self.model.config
        w = m.weights
        # (d,) in float32 (a row of a tied model's embedding is a strided column); the rotary rows likewise: exact
        x = w.embed_rows(torch.tensor([token]))[0].to(torch.float32).contiguous()
        cos, sin = m.cos[pos].to(torch.float32).contiguous(), m.sin[pos].to(torch.float32).contiguous()
        logits = torch.empty(1, c.vocab_size)
        st = torch.empty(len(self.names), 1, 7) if stats else None
        marks = torch.empty(c.num_layers + 2, dtype=torch.float64) if timing else None
        nth = torch.get_num_threads()     # read once: the work buffer is sized for the threads the call uses
        work = self._work(cache, nth)
        s = StepArgs(c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                 c.vocab_size, cache.max_len, pos, nth, TYPES[m.dtype], TYPES[cache.k.dtype], eps, c.head_dim ** -0.5,
                 x.data_ptr(),
                 self.layer_ptrs["attn_norm"], self.layer_ptrs["wqkv"], self.layer_ptrs["wo"],
                 self.layer_ptrs["mlp_norm"], self.layer_ptrs["w_gate_up"], self.layer_ptrs["w_down"],
                 cache.k.data_ptr(), cache.v.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                 w.norm.data_ptr(), _data(w.lm_head), logits.data_ptr(), work.data_ptr(),
                 st.data_ptr() if stats else None, marks.data_ptr() if timing else None,
                 *(self.layer_ptrs[f"q_{f}"] for f in ("wqkv", "wo", "w_gate_up", "w_down")), _qtype(w.lm_head))
        status = self.lib.llmi_decode_step(ctypes.byref(s))
        return self._typed(logits), st, status, (list(zip(self.mark_labels, marks.tolist())) if timing else None)

    def _typed(self, logits: torch.Tensor) -> torch.Tensor:
        """The kernels' float32 logits (each already rounded to the model's dtype) in that dtype, as the PyTorch
        forward returns them (exact)."""
        return logits if self.model.dtype == torch.float32 else logits.to(self.model.dtype)

    def rows(self, tokens: list[int], caches: list, positions: list[int], eps: float, stats: bool,
             timing: bool = False) -> tuple:
        """One token of each of B runs (engine.batch), token b at positions[b] in caches[b] (each a KVCache of the
        block layout: this model has no windows) -> (logits (B, V), statistics (B, G, 7) or None (row b's in the
        order of `names`, as __call__ gives one row's), how many rows met a NaN/Inf, marks as __call__'s). Each
        row's cache is written at its position; its attention reads only its own cache."""
        if self.rows_refusal:
            raise ValueError(f"the batched native step cannot run this model: {self.rows_refusal}")
        m, c = self.model, self.model.config
        B = len(tokens)
        x = m.weights.embed[torch.tensor(tokens)].to(torch.float32).contiguous()       # (B, d)
        at = torch.tensor(positions)
        cos, sin = m.cos[at].to(torch.float32).contiguous(), m.sin[at].to(torch.float32).contiguous()   # (B, hd)
        logits = torch.empty(B, c.vocab_size)
        st = torch.empty(B, len(self.names), 7) if stats else None
        marks = torch.empty(c.num_layers + 2, dtype=torch.float64) if timing else None
        bad = torch.zeros(B, dtype=torch.int32)
        lens = torch.tensor([cache.max_len for cache in caches], dtype=torch.int32)
        pos = torch.tensor(positions, dtype=torch.int32)
        if any(cache.k.dtype != caches[0].k.dtype for cache in caches):
            raise ValueError(f"the rows' KV caches differ in dtype: {sorted({str(c.k.dtype) for c in caches})}")
        kc = (_P * B)(*[cache.k.data_ptr() for cache in caches])
        vc = (_P * B)(*[cache.v.data_ptr() for cache in caches])
        nth = torch.get_num_threads()
        work = torch.empty(self.lib.llmi_rows_work_floats(B, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                                          c.intermediate_size, c.vocab_size, max(positions) + 1, nth))
        r = RowsArgs(c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                     c.vocab_size, B, nth, TYPES[m.dtype], TYPES[caches[0].k.dtype], eps, c.head_dim ** -0.5,
                     x.data_ptr(),
                     self.layer_ptrs["attn_norm"], self.layer_ptrs["wqkv"], self.layer_ptrs["wo"],
                     self.layer_ptrs["mlp_norm"], self.layer_ptrs["w_gate_up"], self.layer_ptrs["w_down"],
                     ctypes.cast(kc, _P), ctypes.cast(vc, _P), lens.data_ptr(), pos.data_ptr(), cos.data_ptr(),
                     sin.data_ptr(), m.weights.norm.data_ptr(), m.weights.lm_head.data_ptr(), logits.data_ptr(),
                     work.data_ptr(), st.data_ptr() if stats else None, marks.data_ptr() if timing else None,
                     bad.data_ptr())
        failed = self.lib.llmi_decode_rows(ctypes.byref(r))
        return self._typed(logits), st, failed, (list(zip(self.mark_labels, marks.tolist())) if timing else None)

    def serve_rows(self, tokens: list[int], positions: list[int], caches: list, probe, eps: float):
        """rows() for a batch's fan-out probe (engine.batch.rows.FanProbe, which it serves: served_by), each run's
        probe offered its own row as a lone step's -> logits (B, V); None when a row met a NaN or Inf (nothing
        offered: the caller redoes the step on the PyTorch path, which rewrites the same cache positions and whose
        accounting of non-finite values is the reference), and None when `rows_refusal` says why decode_rows.c cannot
        run this model (the caller's PyTorch path then runs the batch)."""
        if self.rows_refusal:
            return None
        watched, start = probe.watching, time.perf_counter()
        logits, values, failed, marks = self.rows(tokens, caches, positions, eps, watched, watched and probe.timing)
        if failed:
            return None
        if watched:
            probe.offer_step(self.names, self.layers, values, logits, marks, start)
        return logits


def _kept(t) -> bool:
    """Whether a weight is a matrix kept in GGUF blocks (engine.quant_matrix.QuantMatrix: its `format` and its
    `blocks`). Recognised by those attributes, not imported: engine.quant_matrix multiplies through
    engine.accelerator, which imports this module (tests/unit/test_layout.py forbids the circle)."""
    return isinstance(getattr(t, "format", None), str) and isinstance(getattr(t, "blocks", None), torch.Tensor)


def _data(t) -> int:
    """The address decode.c reads a weight at: a float tensor's data, a QuantMatrix's block bytes."""
    return (t.blocks if _kept(t) else t).data_ptr()


def _qtype(t) -> int:
    """decode.c's type code of a matrix: its GGML type number kept in GGUF blocks, 0 as a float tensor."""
    return QUANT_TYPES[t.format] if _kept(t) else 0
