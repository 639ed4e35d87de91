"""The native decode step (decode.c) behind engine.model: which calls may take it, and the call itself; and its
batched form (decode_rows.c: NativeDecoder.rows / serve_rows), which Model.forward_batch takes for engine.batch's
rows (engine.forward_batch.Batch.rows) when every row's probe is served by it, under the same allow-list.

A model takes it only when everything it computes is on the allow-list of what decode.c implements
(engine.native.allow_list: `refusal`, and `rows_refusal` for the batched step, which computes Llama's block on
float matrices only; for anything else serve_rows leaves the batch to the PyTorch forward). A call then takes it when it is one token and its probe is none or asks only for what one pass of decode.c
gives (Probe.served_by): statistics of any stages, per-layer timing marks, and a capture of the logits (the app's
inspected run asks for exactly these) -- no capture of any other stage, no replacement, weight override or run-only
epsilon. Anything else, or a library that could not be built, runs the PyTorch forward, which stays the reference:
tests hold the two to each other (in each dtype) and to transformers. A probe's declared addition (Probe.add: a
vector added to a block's resid_post, a steering vector) both steps add where the caller hands it over (__call__'s
`add`, rows' `adds`, rounded as the PyTorch forward rounds x + v.to(x.dtype)); engine.model's calls hand over none, so
there such a probe is not served (Probe.served_by without adds=True) and its run takes the PyTorch forward, which
applies it; engine.tools.steering steps its runs on rows with their additions.

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

from engine.inspection.stages import forward_stages
from engine.native import build
from engine.native.allow_list import (ACTIVATIONS, EXPERT_SLOTS, LAYER_SLOTS, MATRICES, MLP_IN, ROPE_KINDS,
                                      ROWS_VECTORS, TYPES, VECTOR_FIELDS, VECTOR_SLOTS, kept_in_blocks, refusal,
                                      rows_refusal)
from engine.native.quant import code as quant_code
from engine.rope import table_for

_P = ctypes.c_void_p
_FIELDS = [(n, ctypes.c_int) for n in ("L", "d", "H", "K", "hd", "F", "V", "max_len", "pos", "nth", "wtype",
                                        "ctype")] + [
    ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("x_in", _P)] + [
    (n, _P) for n in ("attn_norm", "wqkv", "wo", "mlp_norm", "wgu", "wdown", "kc", "vc", "cos", "sin",
                      "final_norm", "lm_head", "logits", "work", "stats", "marks")] + [
    (n, _P) for n in ("qwqkv", "qwo", "qwgu", "qwdown")] + [("qlm", ctypes.c_int)] + [
    (n, _P) for n in ("bqkv", "q_norm", "k_norm", "rope_on")] + [("act", ctypes.c_int)] + [
    (n, ctypes.c_float) for n in ("resid_scale", "logits_div")] + [(n, _P) for n in ("rows", "lkc", "lvc")] + [
    (n, _P) for n in ("attn_post_norm", "mlp_post_norm")] + [(n, ctypes.c_float) for n in ("attn_cap", "final_cap")] + [
    (n, _P) for n in ("cos_local", "sin_local")] + [("rd", ctypes.c_int), ("add", _P)] + [
    (n, ctypes.c_int) for n in ("qk_whole", "layer_norm")] + [
    (n, _P) for n in ("attn_norm_b", "mlp_norm_b", "final_norm_b", "bo")] + [("plain", ctypes.c_int)] + [
    (n, _P) for n in ("bup", "bdown")] + [(n, ctypes.c_int) for n in ("parallel", "rope_pairs")] + [
    ("head_bias", _P)] + [(n, _P) for n in ("router", "egu", "edown")] + [
    (n, ctypes.c_int) for n in ("E", "topk", "Fe", "renorm")] + [(n, _P) for n in ("qegu", "qedown")]


class StepArgs(ctypes.Structure):
    _fields_ = _FIELDS


class RowsArgs(ctypes.Structure):       # decode_rows.c's Rows
    _fields_ = [(n, ctypes.c_int) for n in ("L", "d", "H", "K", "hd", "F", "V", "B", "nth", "wtype", "ctype")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)] + [
        (n, _P) for n in ("x_in", "attn_norm", "wqkv", "wo", "mlp_norm", "wgu", "wdown", "kc", "vc", "max_len", "pos",
                          "cos", "sin", "final_norm", "lm_head", "logits", "work", "stats", "marks", "bad", "add")]



class NativeDecoder:
    """Built once per model (None from `for_model` when the model cannot take it)."""

    def __init__(self, model, lib: ctypes.CDLL) -> None:
        self.lib, self.model = lib, model
        # its statistics rows: the stages the family's forward offers, in order (q/k norms where the block has them)
        self.names = forward_stages(model.config)
        self.layers = [int(n.split(".")[1]) if n.startswith("blocks.") else None for n in self.names]
        self.mark_labels = ["embed", *(f"blocks.{i}" for i in range(model.config.num_layers)), "logits"]
        self._layer_ptrs, self._lock = None, threading.Lock()    # made once, however many runs start at once
        # decode_rows.c reads float (in, out) matrices of a Llama block only; a lone token's step (decode.c) reads
        # GGUF blocks and the variations `refusal` admits too
        self.rows_refusal = rows_refusal(model)

    @property
    def layer_ptrs(self) -> dict:
        """Slot -> a C array of the layers' weight pointers, made at the first decode step (the weights as they are
        then: a model whose layers are replaced before it decodes is read as replaced)."""
        with self._lock:
            if self._layer_ptrs is None:
                self._keep = []      # ctypes arrays the StepArgs point into
                layers = self.model.weights.layers
                # a dense MLP's first matrix, gated or plain (at an experts layer: NULL), and an experts layer's
                # slots (at a dense layer: NULL); a slot no layer has: NULL
                mlp_in = next((f for f in MLP_IN for lw in layers if getattr(lw, f) is not None), MLP_IN[0])
                slots = {"mlp_in": mlp_in, **{f: f for f in (*LAYER_SLOTS, "w_down", *EXPERT_SLOTS)}}
                self._layer_ptrs = {k: self._ptrs([getattr(lw, f) for lw in layers])
                                    if any(getattr(lw, f) is not None for lw in layers) else None
                                    for k, f in slots.items()}
                self._layer_ptrs |= {f"q_{k}": self._types([getattr(lw, slots[k]) for lw in layers])
                                     for k in ("wqkv", "wo", "mlp_in", "w_down", "experts_gate_up", "experts_down")}
                # a variation's vectors: every layer's, or None (the block has none: decode.c skips the step)
                self._layer_ptrs |= {f: self._ptrs([getattr(lw, f) for lw in layers])
                                     if getattr(layers[0], f) is not None else None for f in VECTOR_SLOTS}
                rope = self.model.config.layer_rope
                self._layer_ptrs["rope_on"] = None if set(rope) == {"main"} else self._flags(
                    [ROPE_KINDS[k] for k in rope])
        return self._layer_ptrs

    def _ptrs(self, tensors) -> ctypes.c_void_p:
        """A C array of the tensors' data pointers (a matrix kept quantised: its blocks'; None: NULL, a layer without
        the slot; kept alive with this decoder)."""
        arr = (_P * len(tensors))(*[None if t is None else _data(t) for t in tensors])
        self._keep.append(arr)
        return ctypes.cast(arr, _P)

    def _flags(self, flags) -> ctypes.c_void_p:
        """A C array of ints, one a layer (kept alive with this decoder)."""
        arr = (ctypes.c_int * len(flags))(*[int(f) for f in flags])
        self._keep.append(arr)
        return ctypes.cast(arr, _P)

    def _types(self, matrices) -> ctypes.c_void_p:
        """A C array of each matrix's GGML type for decode.c: 0 for a float (in, out) matrix."""
        arr = (ctypes.c_int * len(matrices))(*[0 if t is None else _qtype(t) for t in matrices])
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

    def _experts(self) -> dict:
        """decode.c's E, topk, Fe, renorm: the experts layers' shape (all 0 without experts)."""
        lw = next((lw for lw in self.model.weights.layers if lw.router is not None), None)
        if lw is None:
            return {"E": 0, "topk": 0, "Fe": 0, "renorm": 0}
        c = self.model.config
        down = lw.experts_down      # float (E, Fe, d); kept in blocks (engine.quant_experts): (E, d rows, Fe values)
        return {"E": lw.router.shape[1], "topk": c.experts_per_token,
                "Fe": down.shape[2] if kept_in_blocks(down) else down.shape[1], "renorm": int(c.norm_topk_prob)}

    def _work(self, cache, nth: int) -> torch.Tensor:
        c, e = self.model.config, self._experts()
        return cache.scratch("native_decode", self.lib.llmi_work_floats(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, max(c.intermediate_size, e["Fe"], e["E"]),
            c.vocab_size, cache.max_len, nth))

    def __call__(self, token: int, cache, pos: int, eps: float, stats: bool, timing: bool = False,
                 add: dict | None = None) -> tuple:
        """One token at pos -> (logits (1, V), statistics (G, 1, 7) or None, status: 0, or 1 = a NaN/Inf met,
        marks: with timing, (label, seconds since the call began) after the embedding, each layer and the logits
        (`mark_labels`), else None). add: None or {layer: vector (d,)}, added to blocks.{layer}.resid_post as the
        PyTorch forward adds a probe's declared addition (Probe.add), as rows' adds."""
        m, c = self.model, self.model.config
        w = m.weights
        # (d,) in float32 (a row of a tied model's embedding is a strided column); the rotary rows likewise: exact.
        # Gemma's sqrt(d), Granite's embedding multiplier: in the embedding's dtype, as the PyTorch forward scales it
        x = w.embed_rows(torch.tensor([token]))[0]
        if c.embed_scale != 1.0:
            x = x * torch.tensor(c.embed_scale, dtype=x.dtype)
        if w.pos_embed is not None:     # GPT-2's learned position, added in the stream's dtype as the forward adds it
            x = x + w.pos_embed[pos].to(x.dtype)
        x = x.to(torch.float32).contiguous()
        # the rotary rows (rotary_dim wide) of the main table (longrope's long factors once past their length, as the
        # PyTorch forward's table_for) and, for Gemma 3's sliding layers, the local one: exact in float32
        m.rope.ensure(pos + 1)
        tables = {k: m.rope[table_for(c, k, pos + 1)] for k in ("main", "local") if k in m.rope}
        rows = {k: (cs[pos].to(torch.float32).contiguous(), sn[pos].to(torch.float32).contiguous())
                for k, (cs, sn) in tables.items()}
        (cos, sin), local = rows["main"], rows.get("local")
        logits = torch.empty(1, c.vocab_size)
        st = torch.empty(len(self.names), 1, 7) if stats else None
        marks = torch.empty(c.num_layers + 2, dtype=torch.float64) if timing else None
        nth = torch.get_num_threads()     # read once: the work buffer is sized for the threads the call uses
        work = self._work(cache, nth)
        # a cache with sliding-window layers (a ring each: engine.kv_cache) is one tensor a layer, of its rows
        L = c.num_layers
        arrays = None if cache.k is not None else ((ctypes.c_int * L)(*cache.rows),
                                                   (_P * L)(*[t.data_ptr() for t in cache.layer_k]),
                                                   (_P * L)(*[t.data_ptr() for t in cache.layer_v]))
        ring = arrays and tuple(ctypes.cast(a, _P) for a in arrays)      # `arrays` keeps them alive for the call
        added, adds = self._additions([add], 1)
        s = StepArgs(c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                 c.vocab_size, cache.max_len, pos, nth, TYPES[m.dtype], TYPES[cache.dtype], eps, c.attn_scale,
                 x.data_ptr(),
                 self.layer_ptrs["attn_norm"], self.layer_ptrs["wqkv"], self.layer_ptrs["wo"],
                 self.layer_ptrs["mlp_norm"], self.layer_ptrs["mlp_in"], self.layer_ptrs["w_down"],
                 *((None, None) if ring else (cache.k.data_ptr(), cache.v.data_ptr())), cos.data_ptr(), sin.data_ptr(),
                 w.norm.data_ptr(), _data(w.lm_head), logits.data_ptr(), work.data_ptr(),
                 st.data_ptr() if stats else None, marks.data_ptr() if timing else None,
                 *(self.layer_ptrs[f"q_{f}"] for f in ("wqkv", "wo", "mlp_in", "w_down")), _qtype(w.lm_head),
                 rope_on=self.layer_ptrs["rope_on"], act=ACTIVATIONS[c.activation], resid_scale=c.residual_scale,
                 logits_div=c.logits_divisor, attn_cap=c.attn_softcap or 0.0, final_cap=c.final_softcap or 0.0,
                 rd=c.rotary_dim, **{VECTOR_FIELDS.get(f, f): self.layer_ptrs[f] for f in VECTOR_SLOTS if f not in ROWS_VECTORS},
                 qk_whole=int(c.family.qk_norm == "whole"), layer_norm=int(c.family.norm == "layer"),
                 final_norm_b=_opt(w.norm_bias), plain=int(c.family.mlp == "plain"),
                 parallel=int(c.parallel_residual), rope_pairs=int(c.family.positions == "rope_interleaved"),
                 head_bias=_opt(w.head_bias), router=self.layer_ptrs["router"],
                 egu=self.layer_ptrs["experts_gate_up"], edown=self.layer_ptrs["experts_down"], **self._experts(),
                 qegu=self.layer_ptrs["q_experts_gate_up"], qedown=self.layer_ptrs["q_experts_down"],
                 **dict(zip(("rows", "lkc", "lvc"), ring or (None, None, None))),
                 **({"cos_local": local[0].data_ptr(), "sin_local": local[1].data_ptr()} if local else {}), add=adds)
        status = self.lib.llmi_decode_step(ctypes.byref(s))
        del added       # (the vectors decode.c read, kept alive until here)
        return self._typed(logits), st, status, (list(zip(self.mark_labels, marks.tolist())) if timing else None)

    def _typed(self, logits: torch.Tensor) -> torch.Tensor:
        """The kernels' float32 logits (each already rounded to the model's dtype) in that dtype, as the PyTorch
        forward returns them (exact)."""
        return logits if self.model.dtype == torch.float32 else logits.to(self.model.dtype)

    def rows(self, tokens: list[int], caches: list, positions: list[int], eps: float, stats: bool,
             timing: bool = False, adds: list | None = None) -> tuple:
        """One token of each of B runs (engine.batch), token b at positions[b] in caches[b] (each a KVCache of the
        block layout: this model has no windows) -> (logits (B, V), statistics (B, G, 7) or None (row b's in the
        order of `names`, as __call__ gives one row's), how many rows met a NaN/Inf, marks as __call__'s). Each
        row's cache is written at its position; its attention reads only its own cache. adds: None, or per row
        None or {layer: vector (d,)}: the vector added to the row's blocks.{layer}.resid_post, as the PyTorch forward
        adds a probe's declared addition (Probe.add: x + vector.to(x.dtype), one rounding to the model's dtype)."""
        if self.rows_refusal:
            raise ValueError(f"the batched native step cannot run this model: {self.rows_refusal}")
        m, c = self.model, self.model.config
        B = len(tokens)
        x = m.weights.embed[torch.tensor(tokens)].to(torch.float32).contiguous()       # (B, d)
        at = torch.tensor(positions)
        m.rope.ensure(max(positions) + 1)
        mc, ms = m.rope["main"]
        cos, sin = mc[at].to(torch.float32).contiguous(), ms[at].to(torch.float32).contiguous()   # (B, hd)
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
        added, add = self._additions(adds, B)
        nth = torch.get_num_threads()
        work = torch.empty(self.lib.llmi_rows_work_floats(B, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                                          c.intermediate_size, c.vocab_size, max(positions) + 1, nth))
        r = RowsArgs(c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                     c.vocab_size, B, nth, TYPES[m.dtype], TYPES[caches[0].k.dtype], eps, c.head_dim ** -0.5,
                     x.data_ptr(),
                     self.layer_ptrs["attn_norm"], self.layer_ptrs["wqkv"], self.layer_ptrs["wo"],
                     self.layer_ptrs["mlp_norm"], self.layer_ptrs["mlp_in"], self.layer_ptrs["w_down"],
                     ctypes.cast(kc, _P), ctypes.cast(vc, _P), lens.data_ptr(), pos.data_ptr(), cos.data_ptr(),
                     sin.data_ptr(), m.weights.norm.data_ptr(), m.weights.lm_head.data_ptr(), logits.data_ptr(),
                     work.data_ptr(), st.data_ptr() if stats else None, marks.data_ptr() if timing else None,
                     bad.data_ptr(), add)
        failed = self.lib.llmi_decode_rows(ctypes.byref(r))
        del added       # (the vectors decode_rows.c read, kept alive until here)
        return self._typed(logits), st, failed, (list(zip(self.mark_labels, marks.tolist())) if timing else None)

    def _additions(self, adds: list | None, B: int) -> tuple[list, ctypes.c_void_p | None]:
        """decode_rows.c's `add` (and with B = 1 decode.c's): (the float32 vectors, kept alive for the call; B x L
        pointers, NULL where a row adds nothing at a layer), or ([], None) when no row adds anything. Each vector rounded to the model's dtype first,
        as the PyTorch forward's vector.to(x.dtype) (exact in float32)."""
        if adds is None or not any(adds):
            return [], None
        if len(adds) != B:
            raise ValueError(f"adds gives {len(adds)} rows' additions for {B} rows")
        c, L = self.model.config, self.model.config.num_layers
        kept, ptrs = [], (_P * (B * L))()
        for b, row in enumerate(adds):
            for layer, v in (row or {}).items():
                if not (isinstance(layer, int) and 0 <= layer < L) or tuple(v.shape) != (c.hidden_size,):
                    raise ValueError(f"row {b}'s addition must be {{layer in 0..{L - 1}: a ({c.hidden_size},) "
                                     f"vector}}, got layer {layer!r} with shape {tuple(v.shape)}")
                t = v.detach().to("cpu", self.model.dtype).to(torch.float32).contiguous()
                kept.append(t)
                ptrs[b * L + layer] = t.data_ptr()
        return kept + [ptrs], ctypes.cast(ptrs, _P)

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


def _opt(t) -> int | None:
    """A vector's address for decode.c, or NULL where the model has none."""
    return None if t is None else t.data_ptr()


def _data(t) -> int:
    """The address decode.c reads a weight at: a float tensor's data, a QuantMatrix's block bytes."""
    return (t.blocks if kept_in_blocks(t) else t).data_ptr()


def _qtype(t) -> int:
    """decode.c's type code of a matrix: kept in GGUF blocks, the kernel of its format and arithmetic (the code
    quant.c's product takes for it too: engine.native.quant.code); 0 as a float tensor."""
    return quant_code(t.format, t.arithmetic) if kept_in_blocks(t) else 0
