"""Model: weights plus a hand-written forward for decoder-only families (RMSNorm, RoPE, GQA, gated MLPs, and each
family's variations: q/k norms, post-norms, soft caps, multipliers, sliding windows, a rotary fraction, layers
without RoPE, mixtures of experts; engine.family declares them and _block reads the declaration).

The model holds weights only and is shared by every session and thread; a run brings its own KVCache and Probe. Every
stage is offered to the probe by name. Over several query positions the output of attention comes from torch's fused
scaled_dot_product_attention; scores and pattern are materialised (H, T, S) only when a hook needs them whole (a
replace hook, a full capture). Statistics of them, or some of their rows, are computed in query blocks beside the
fused kernel (engine.inspection.attention_stats). One decode row computes scores and pattern anyway (two small
grouped matmuls) and offers them as they are (engine.attention.attend: the one attention function).

One forward, forward_batch, computes any batch description (engine.forward_batch.Batch: flat token ids at their
absolute positions, as a serving engine's forward takes them): a lone run's chunk (the trivial batch; forward is its
convenience), one token of each of several runs (engine.batch's decode step), the packed prompts of several runs
(engine.batch's prefill); it alone chooses the native step, the native batched step or the PyTorch forward. The
forward asks its cache and its probe only what their protocols declare (engine.cache_protocol.Cache: attend,
last_rows; engine.inspection.stage_sink.RunSink / BlockSink): a lone run's KVCache and a batch's rows are handed in
the same way, and nothing here asks a form what it is."""
from __future__ import annotations

import copy
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from engine.accelerator import Accelerator, choose
from engine.attention import Where
from engine.cache_protocol import Cache
from engine.config import ModelConfig
from engine.errors import InputError
from engine.forward_batch import Batch
from engine.inspection.probe import Probe
from engine.inspection.probe_views import NO_PROBE
from engine.inspection.stage_sink import RunSink
from engine.inspection.stages import hook_names
from engine.inspection.stop_points import stop_point
from engine.kv_cache import KVCache
from engine.matmul import mm
from engine.moe import activation, experts_mlp, route
from engine.norms import family_norm, rms_norm
from engine.progress import STOP, Stopped
from engine.quant_matrix import QuantMatrix
from engine.rope import RopeTables, apply_rope, rotate, table_kinds
from engine.weights import LayerWeights, Weights

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer


class Model:
    def __init__(self, cfg: ModelConfig, weights: Weights, tokenizer: "Tokenizer", *, device: torch.device,
                 dtype: torch.dtype, name: str = "model", path: Path | None = None, native_decode: bool = False
                 ) -> None:
        """native_decode: this model may get its own native decode step (engine.loader's models; a model made from
        another, such as a precision plan or a quantised copy, does not). The accelerator (decode step and
        statistics backend) is chosen here, once (engine.accelerator.choose)."""
        self.config, self.weights, self.tokenizer = cfg, weights, tokenizer
        self.device, self.dtype, self.name, self.path = device, dtype, name, path
        # one table per rotary kind the layers use ("main", Gemma 3's "local", longrope's "long")
        self.rope = RopeTables(cfg, device, dtype, table_kinds(cfg))     # grown as positions are reached
        self.resid_fp32_from: int | None = None    # precision plan (see engine.variants.precision_plan)
        self.fp32_units: list[str] = []
        self.cache_dtype = dtype                   # float32 in a plan with an fp32 attention unit
        self.base_name = name                      # the model a plan was made from
        self._live_hooks, self._lock = 0, threading.Lock()
        self.accelerator: Accelerator = choose(self, native_decode)

    @property
    def live_hooks(self) -> int:
        """Hooks attached right now, over all threads. Zero whenever no forward call is running."""
        return self._live_hooks

    def hook_names(self) -> list[str]:
        return hook_names(self.config)

    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(self.config, min(max_len, self.context_length), self.device, self.cache_dtype)

    @contextmanager
    def attached(self, probe: Probe | None, pos0: int):
        """Count the probe's hooks as live and let it accept stages for one call; always undone."""
        if probe is None:
            yield
            return
        n = probe.hook_count
        with self._lock:
            self._live_hooks += n
        try:
            probe.begin_call(pos0, self.device, self.accelerator.stats)
            try:
                yield
            finally:
                probe.end_call()
        finally:
            with self._lock:
                self._live_hooks -= n

    def with_accelerator(self, accelerator: Accelerator) -> "Model":
        """This model (the same weights, tokenizer and tables) with another accelerator, e.g.
        engine.accelerator.PLAIN: the public switch that holds the native path to the PyTorch forward."""
        twin = copy.copy(self)
        twin._lock, twin._live_hooks, twin.accelerator = threading.Lock(), 0, accelerator
        return twin

    def forward(self, ids: torch.Tensor, cache: KVCache, probe: Probe | None = None, *, last_only: bool = False,
                grad: bool = False, stop_after: str | int | None = None,
                on_layer: Callable[[int], object] | None = None) -> torch.Tensor:
        """ids (T,) at the cache's position -> logits (T, V), or (1, V) with last_only: the lone run's batch
        (engine.forward_batch.Batch.run) through forward_batch. Advances the cache. grad=True runs outside inference
        mode so a replace hook may hand in a tensor that requires grad (gradient x input attribution); the weights
        never do. stop_after: a forward stage ("blocks.5.attn.pattern") or block index; every stage up to it is
        offered, the forward ends with its half-block (probe.stop_point), returns the residual stream there (T, d)
        and leaves later layers' cache rows unwritten. on_layer(i): just before block i; an answer STOP raises
        engine.progress.Stopped there (the cache is not advanced)."""
        if ids.dim() != 1 or ids.numel() == 0:
            raise InputError(f"forward needs a non-empty 1-D tensor of token ids, got shape {tuple(ids.shape)}")
        T, pos = ids.shape[0], cache.get_pos()
        if pos + T > self.context_length:
            raise InputError(f"{pos + T} positions exceed the model's context length {self.context_length}")
        cache.check_room(T)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise InputError(f"token id {hi if hi >= self.config.vocab_size else lo} is outside the "
                             f"vocabulary [0, {self.config.vocab_size})")
        stop = None if stop_after is None else stop_point(stop_after, self.config.num_layers)
        logits = self.forward_batch(Batch.run(ids.to(self.device), cache, probe, pos0=pos, last_only=last_only,
                                              on_layer=on_layer, stop=stop, grad=grad))
        cache.advance(T)
        return logits

    def forward_batch(self, batch: Batch) -> torch.Tensor:
        """The one forward over a batch description (engine.forward_batch.Batch: a lone run's chunk, one token of
        each of several runs, the packed prompts of several runs) -> logits (T, V), or those of batch.cache.last_rows
        with last_only (each run's last row), or with batch.stop the residual stream there. The path is chosen here
        and nowhere else: a lone run's one token takes the native decode step and one token of each run the native
        batched step (engine.native.step: serve_rows) where the model has one and every row's probe is served by it
        (a NaN or Inf met there: the PyTorch forward redoes it, its accounting of non-finite values the reference);
        everything else the PyTorch forward. Advances no cache (the caller does, as it alone knows which runs
        failed)."""
        probe = batch.probe
        with torch.inference_mode(not batch.grad), self.attached(None if probe is NO_PROBE else probe, batch.pos0):
            eps = self.config.rms_norm_eps if probe.norm_eps is None else probe.norm_eps
            step = self.accelerator.decode
            if step is not None and batch.native_rows and (probe is NO_PROBE or probe.served_by(step.names)):
                logits = self._on_native_step(step, batch, eps)
                if logits is not None:
                    return logits
            return self._forward(batch, eps)

    def _on_native_step(self, step, batch: Batch, eps: float) -> torch.Tensor | None:
        """The batch on the native step (batch.native_rows one-token runs) -> logits, or None where a row met a NaN
        or Inf (or the batched step cannot run this model): the PyTorch forward then computes it."""
        probe = batch.probe
        if batch.form == "rows":
            return step.serve_rows(batch.ids.tolist(), batch.positions.tolist(), batch.caches, probe, eps)
        watched, start = probe is not NO_PROBE, time.perf_counter()
        logits, values, status, marks = step(int(batch.ids[0]), batch.cache, batch.pos0, eps, watched,
                                             watched and probe.timing)
        if status:
            return None
        if watched:
            probe.offer_step(step.names, step.layers, values, logits, marks, start)
        return logits

    def _forward(self, batch: Batch, eps: float) -> torch.Tensor:
        cfg, w, probe, ids, cache = self.config, self.weights, batch.probe, batch.ids, batch.cache
        T = ids.shape[0]
        embed, norm = probe.weight("embed.weight", w.embed), probe.weight("final_norm.weight", w.norm)
        lm_head = probe.weight("lm_head.weight", w.lm_head)
        at = Where(cfg, self.rope, batch.positions, contiguous=batch.contiguous)
        if probe.timing:
            probe.mark("start")
        x = embed.rows(ids) if isinstance(embed, QuantMatrix) else F.embedding(ids, embed)       # (T, d)
        if cfg.embed_scale != 1.0:    # Gemma's sqrt(d), Granite's multiplier: in the embedding's dtype, as HF
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        if w.pos_embed is not None:   # GPT-2's learned absolute positions, added to the tokens' rows
            x = x + F.embedding(at.rows, w.pos_embed).to(x.dtype)
        x = probe("embed", x)
        if probe.timing:
            probe.mark("embed")
        stop = batch.stop
        end, half, final = (cfg.num_layers, False, True) if stop is None else stop
        # nothing reads the stream but this forward (no probe, no gradient): its adds and the MLP's gate can be
        # done in place, the same arithmetic without four fresh (T, d) / (T, F) tensors per block
        own = probe is NO_PROBE and not torch.is_grad_enabled()
        x = self._blocks(x, cache, probe, 0, end, at, eps, batch.on_layer, half, own)
        if final:
            x = probe("final_norm", family_norm(cfg, x, norm, w.norm_bias, eps))
        if stop is not None:
            return x
        if batch.last_only:   # the last row; of a packed prefill (engine.batch.segments), each run's last
            x = x[cache.last_rows(T)]
            probe.move_to(batch.pos0 + T - 1)   # the one logits row belongs to the last position
        logits = self._head(x, lm_head, probe)                                  # (T, V)
        if probe.timing:
            probe.mark("logits")
        return logits

    def _head(self, x: torch.Tensor, lm_head: torch.Tensor, probe) -> torch.Tensor:
        """The final-normed stream (T, d) -> logits (T, V): the lm_head (and Phi's head bias), Granite's
        logits_scaling (Cohere's logit_scale as its reciprocal), Gemma 2's final soft cap (the logits before it
        offered as logits_uncapped)."""
        cfg = self.config
        logits = mm(x.to(lm_head.dtype), lm_head)
        if self.weights.head_bias is not None:    # in the product's dtype (a precision plan's fp32 head: fp32)
            logits = logits + self.weights.head_bias.to(logits.dtype)
        if cfg.logits_divisor != 1.0:
            logits = logits / cfg.logits_divisor
        if cfg.final_softcap is not None:
            logits = probe("logits_uncapped", logits)
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return probe("logits", logits)

    def _blocks(self, x, cache: Cache, probe: RunSink, first: int, end: int, at: Where, eps: float, on_layer,
                attn_half: bool = False, own: bool = False) -> torch.Tensor:
        """Blocks [first, end) on the stream x, then with attn_half block `end`'s attention half: the one
        layer loop of every forward and span. own: nothing else holds x or reads a stage (see _block)."""
        layers, timing = self.weights.layers, probe.timing
        for i in range(first, end + attn_half):
            if on_layer is not None and on_layer(i) is STOP:
                raise Stopped        # the job's on_progress answered STOP: nothing after this block runs
            if i == self.resid_fp32_from:
                x = x.float()     # precision plan: the residual stream stays in fp32 from this layer on
            x = self._block(probe.layer(i), probe.layer_weights(i, layers[i]), x, cache, i, at, eps, i < end, own)
            if timing:
                probe.mark(f"blocks.{i}")
        return x

    def run_blocks(self, x: torch.Tensor, cache: Cache, start: int, end: int, probe: Probe | None = None, *,
                   positions: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks [start, end) on the stream x (T, d) entering block `start` -> the stream leaving block end - 1, as
        a forward computes it (precision plan, probe). positions (T,): the rows' absolute positions (RoPE; any order:
        a hook's ctx.pos0 is the first's). cache: a Cache (engine.cache_protocol): a KVCache (written, not
        advanced), or a tool's RunCache whose keys are positions 0 .. S - 1. mask (T, S): True where row t reads key
        s; None: causal, S == T. A window layer also keeps each row to its window."""
        if not 0 <= start <= end <= self.config.num_layers or x.shape[1:] != (self.config.hidden_size,) \
                or positions.shape != x.shape[:1]:
            raise InputError(f"run_blocks needs a span in [0, {self.config.num_layers}] and a stream (T, d) with T "
                             f"positions; got [{start}, {end}), {tuple(x.shape)}, {tuple(positions.shape)}")
        eps = self.config.rms_norm_eps if probe is None or probe.norm_eps is None else probe.norm_eps
        positions = positions.to(self.device)
        at = Where(self.config, self.rope, positions, None if mask is None else mask.to(self.device), contiguous=False)
        with torch.inference_mode(), self.attached(probe, int(positions[0])):
            return self._blocks(x.to(self.device), cache, probe or NO_PROBE, start, end, at, eps, None)

    def _block(self, p, lw: LayerWeights, x, cache: Cache, i: int, at: Where, eps: float,
               mlp: bool = True, own: bool = False) -> torch.Tensor:
        """One transformer block (without mlp: its attention half, ending at resid_mid), as the family declares it:
        a weight slot present is a step computed (pre- and post-norms, q/k norms, router and experts). p offers each
        stage under blocks.{i}.<name> (a no-op without a probe). Each half computes in its weights' dtype (a
        precision plan may hold some units in fp32) and adds its output to the residual stream in the stream's dtype:
        resid_mid = resid_pre + (attn_post_norm or attn_out), resid_post = resid_mid + (mlp_post_norm or mlp_out).
        own (no probe, no gradient, a stream only this forward holds): the residual adds and the gate's activation
        and product are done in place, the same operations on the same values."""
        x = self._attention(p, lw, x, cache, i, at, eps, own)
        if self.config.parallel_residual:   # x + attn(ln1(x)) + mlp(ln2(x)); its attention half ends at x + attn
            x, attn, h = x
            return self._mlp(p, lw, x, eps, own, attn, h) if mlp else x + attn
        return self._mlp(p, lw, x, eps, own) if mlp else x

    def _attention(self, p, lw: LayerWeights, x, cache: Cache, i: int, at: Where, eps: float, own: bool
                   ) -> torch.Tensor:
        """A block's attention half: the stream x (T, d) -> resid_mid; a parallel block (GPT-NeoX, Phi): -> (x,
        attn_out, attn_norm's output) for _block, whose MLP also reads x (Phi's: the normed x, its one norm)."""
        cfg = self.config
        T, H, K, hd = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = x if lw.attn_norm is None else p("attn_norm", family_norm(cfg, x, lw.attn_norm, lw.attn_norm_bias,
                                                                      eps))                       # (T, d)
        qkv = mm(h, lw.wqkv) if lw.bqkv is None else torch.addmm(lw.bqkv, h, lw.wqkv)      # (T, (H + 2K) hd)
        q0, k0, v = qkv.view(T, H + 2 * K, hd).split([H, K, K], dim=1)                  # (T, heads, hd) each
        q, k, v = p("attn.q", q0), p("attn.k", k0), p("attn.v", v)
        if lw.q_norm is not None:
            if lw.q_norm.shape[0] == hd:      # Qwen3, Gemma 3: each head's vector
                q, k = rms_norm(q, lw.q_norm, eps), rms_norm(k, lw.k_norm, eps)
            else:                             # OLMo 2: the whole projection
                q = rms_norm(q.reshape(T, H * hd), lw.q_norm, eps).view(T, H, hd)
                k = rms_norm(k.reshape(T, K * hd), lw.k_norm, eps).view(T, K, hd)
            q, k = p("attn.q_norm", q), p("attn.k_norm", k)
        kind = cfg.layer_rope[i]
        if kind is not None:                  # SmolLM3's no-RoPE layers leave q and k as they are
            cos, sin = at.rope(kind)                                            # (T, 1, rotary_dim)
            if cos.dtype != q.dtype:      # a precision plan: fp32 tables, cast for the layers that stay low
                cos, sin = cos.to(q.dtype), sin.to(q.dtype)
            pairs = cfg.family.positions == "rope_interleaved"      # Cohere: adjacent dimensions rotate together
            if q is q0 and k is k0 and cos.shape[-1] == hd:    # one rotation for q and k together (decode)
                q, k = apply_rope(qkv.view(T, H + 2 * K, hd)[:, :H + K], cos, sin, pairs).split([H, K], dim=1)
            else:
                q, k = rotate(q, cos, sin, pairs), rotate(k, cos, sin, pairs)
        q, k = p("attn.q_rot", q), p("attn.k_rot", k)
        # written to the cache and attended against it (a batch's rows: each against its own run's cache)
        z = cache.attend(i, q.transpose(0, 1), k, v, p, at)                      # (H, T, hd)
        z = p("attn.z", z.transpose(0, 1))                                      # (T, H, hd)
        out = mm(z.reshape(T, H * hd), lw.wo)
        if lw.bo is not None:
            out = out + lw.bo
        if cfg.residual_scale != 1.0:         # Granite: the branch scaled before it joins the stream
            out = out * cfg.residual_scale
        out = p("attn_out", out.to(x.dtype))                                   # (T, d)
        if lw.attn_post_norm is not None:
            out = p("attn_post_norm", rms_norm(out, lw.attn_post_norm, eps).to(x.dtype))
        if cfg.parallel_residual:    # GPT-NeoX, Phi: the MLP reads the block's input; _mlp adds both branches
            return x, out, h
        return x.add_(out) if own else p("resid_mid", x + out)

    def _mlp(self, p, lw: LayerWeights, x, eps: float, own: bool, attn: torch.Tensor | None = None,
             normed: torch.Tensor | None = None) -> torch.Tensor:
        """A block's MLP half (gated, plain, or a router and its experts): resid_mid -> resid_post; with attn (a
        parallel block) the block's input -> resid_post = x + attn + mlp_out, the MLP reading its own norm of x
        or, a block with no mlp_norm (Phi), `normed`: attn_norm's output."""
        cfg = self.config
        if lw.mlp_norm is not None:
            h = p("mlp_norm", family_norm(cfg, x, lw.mlp_norm, lw.mlp_norm_bias, eps))
        else:
            h = x if normed is None else normed
        act_fn = activation(cfg.activation)
        if lw.router is not None:
            gates = p("mlp.experts", route(p("mlp.router", mm(h, lw.router)), cfg.experts_per_token,
                                           cfg.norm_topk_prob))                  # (T, E): 0 but each row's top k
            out = experts_mlp(h, gates, lw.experts_gate_up, lw.experts_down, act_fn)
        elif lw.w_up is not None:             # GPT-2, GPT-NeoX: act(h W_up + b) W_down + b, no gate
            up = p("mlp.up", mm(h, lw.w_up) if lw.b_up is None else torch.addmm(lw.b_up, h, lw.w_up))   # (T, F)
            act = p("mlp.act", act_fn(up))
            out = mm(act, lw.w_down) if lw.b_down is None else torch.addmm(lw.b_down, act, lw.w_down)
        else:
            gate, up = mm(h, lw.w_gate_up).chunk(2, dim=-1)                    # (T, F) each
            if own and cfg.activation == "silu":
                act = F.silu(gate, inplace=True).mul_(up)                        # gate's half of the product
            else:
                act = p("mlp.act", act_fn(p("mlp.gate", gate)) * p("mlp.up", up))
            out = mm(act, lw.w_down)
        if cfg.residual_scale != 1.0:
            out = out * cfg.residual_scale
        out = p("mlp_out", out.to(x.dtype))                                     # (T, d)
        if lw.mlp_post_norm is not None:
            out = p("mlp_post_norm", rms_norm(out, lw.mlp_post_norm, eps).to(x.dtype))
        if attn is not None:
            return p("resid_post", x + attn + out)
        return x.add_(out) if own else p("resid_post", x + out)

    @torch.inference_mode()
    def logits(self, ids, probe: Probe | None = None) -> torch.Tensor:
        """Full forward of ids without a shared cache -> float32 CPU logits (len(ids), vocab)."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        cache = self.new_cache(max(1, ids.numel()))
        return self.forward(ids, cache, probe).float().cpu()

    @torch.inference_mode()
    def unembed(self, resid: torch.Tensor) -> torch.Tensor:
        """Residual-stream vectors (..., d) through the final norm and lm_head -> float32 CPU logits (..., V).
        The logit lens: what the model would predict if it stopped at that layer."""
        stream = torch.float32 if self.resid_fp32_from is not None or "embed" in self.fp32_units else self.dtype
        x = family_norm(self.config, resid.to(self.device, stream), self.weights.norm, self.weights.norm_bias,
                        self.config.rms_norm_eps)
        return self._head(x.reshape(-1, x.shape[-1]), self.weights.lm_head, NO_PROBE).view(
            *x.shape[:-1], -1).float().cpu()
