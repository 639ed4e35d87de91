"""Model: weights plus a hand-written Llama-family forward (RMSNorm, RoPE, GQA, SwiGLU).

The model holds weights only and is shared by every session and thread; a run brings its own KVCache and
Probe. Every stage is offered to the probe by name; attention scores and pattern are materialised only
when the probe asks for them, otherwise torch's fused scaled_dot_product_attention runs.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .errors import InputError
from .kv_cache import KVCache
from .probe import Probe
from .rope import apply_rope, rope_tables
from .stages import LayerNames, hook_names
from .weights import Weights

if TYPE_CHECKING:
    from .tokenizer import Tokenizer


class Model:
    def __init__(self, cfg: ModelConfig, weights: Weights, tokenizer: "Tokenizer", *, device: torch.device,
                 dtype: torch.dtype, name: str = "model", path: Path | None = None) -> None:
        self.config = cfg
        self.weights = weights
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.name = name
        self.path = path
        self.cos, self.sin = rope_tables(cfg, cfg.max_position_embeddings, device, dtype)
        self._names = [LayerNames(i) for i in range(cfg.num_layers)]
        self._live_hooks = 0
        self._lock = threading.Lock()

    # ---- introspection --------------------------------------------------------------------------
    @property
    def live_hooks(self) -> int:
        """Hooks attached right now, over all threads. Zero whenever no forward call is running."""
        return self._live_hooks

    def hook_names(self) -> list[str]:
        return hook_names(self.config.num_layers)

    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(self.config, min(max_len, self.context_length), self.device, self.dtype)

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
            probe.begin_call(pos0, self.device)
            try:
                yield
            finally:
                probe.end_call()
        finally:
            with self._lock:
                self._live_hooks -= n

    # ---- forward --------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, probe: Probe | None = None, *,
                last_only: bool = False) -> torch.Tensor:
        """ids (T,) at the cache's position -> logits (T, V), or (1, V) with last_only. Advances the cache."""
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
        ids = ids.to(self.device)
        with self.attached(probe, pos):
            logits = self._forward(ids, cache, probe, pos, last_only)
        cache.advance(T)
        return logits

    def _forward(self, ids, cache: KVCache, p: Probe | None, pos: int, last_only: bool) -> torch.Tensor:
        cfg, w = self.config, self.weights
        T = ids.shape[0]
        eps = cfg.rms_norm_eps if p is None or p.norm_eps is None else p.norm_eps
        embed, norm, lm_head = w.embed, w.norm, w.lm_head
        if p is not None:
            embed, norm = p.weight("embed.weight", embed), p.weight("final_norm.weight", norm)
            lm_head = p.weight("lm_head.weight", lm_head)
        cos, sin = self.cos[pos:pos + T], self.sin[pos:pos + T]                 # (T, 1, hd)
        mask = None
        if T > 1 and pos > 0:   # a chunk after earlier positions: causal within, full view of the past
            mask = torch.arange(pos + T, device=ids.device)[None, :] <= (pos + torch.arange(T, device=ids.device))[:, None]

        if p is not None and p.timing:
            p.mark("start")
        x = F.embedding(ids, embed)                                             # (T, d)
        if p is not None:
            x = p("embed", x)
            if p.timing:
                p.mark("embed")
        for i, lw in enumerate(w.layers):
            if p is not None:
                lw = p.layer_weights(i, lw)
            x = self._block(i, lw, x, cache, p, cos, sin, pos, mask, eps)
            if p is not None and p.timing:
                p.mark(f"blocks.{i}")
        x = F.rms_norm(x, (cfg.hidden_size,), norm, eps)
        if p is not None:
            x = p("final_norm", x)
        if last_only:
            x = x[-1:]
            if p is not None:
                p.move_to(pos + T - 1)   # the one logits row belongs to the last position
        logits = x @ lm_head                                         # (T, V)
        if p is not None:
            logits = p("logits", logits)
            if p.timing:
                p.mark("logits")
        return logits

    def _block(self, i, lw, x, cache: KVCache, p: Probe | None, cos, sin, pos: int, mask, eps: float) -> torch.Tensor:
        cfg, n = self.config, self._names[i]
        T, H, K, hd = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = F.rms_norm(x, (cfg.hidden_size,), lw.attn_norm, eps)
        if p is not None:
            h = p(n.attn_norm, h)
        qkv = (h @ lw.wqkv if lw.bqkv is None else torch.addmm(lw.bqkv, h, lw.wqkv)).view(T, H + 2 * K, hd)
        if p is None:
            qk = apply_rope(qkv[:, :H + K], cos, sin)                           # (T, H+K, hd): one rotation for q and k
            q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + K:]
        else:
            q, k, v = qkv.split([H, K, K], dim=1)                               # (T, heads, hd) each
            q, k, v = p(n.q, q), p(n.k, k), p(n.v, v)
            q, k = p(n.q_rot, apply_rope(q, cos, sin)), p(n.k_rot, apply_rope(k, cos, sin))
        keys, values = cache.update(i, k.transpose(0, 1), v.transpose(0, 1))     # (K, S, hd)
        qh = q.transpose(0, 1)                                                  # (H, T, hd)
        if p is not None and (p.wants(n.scores) or p.wants(n.pattern)):
            z = self._explicit_attention(qh, keys, values, p, n, mask)
        elif T == 1:
            z = self._decode_attention(qh, keys, values)
        else:
            z = self._fused_attention(qh, keys, values, mask)
        z = z.transpose(0, 1)                                                   # (T, H, hd)
        if p is not None:
            z = p(n.z, z)
        attn_out = z.reshape(T, H * hd) @ lw.wo                         # (T, d)
        if p is None:
            x = x + attn_out
            h = F.rms_norm(x, (cfg.hidden_size,), lw.mlp_norm, eps)
            gate, up = (h @ lw.w_gate_up).chunk(2, dim=-1)                # (T, F) each
            return x + (F.silu(gate) * up) @ lw.w_down
        x = p(n.resid_mid, x + p(n.attn_out, attn_out))
        h = p(n.mlp_norm, F.rms_norm(x, (cfg.hidden_size,), lw.mlp_norm, eps))
        gate, up = (h @ lw.w_gate_up).chunk(2, dim=-1)
        act = p(n.act, F.silu(p(n.gate, gate)) * p(n.up, up))
        return p(n.resid_post, x + p(n.mlp_out, act @ lw.w_down))

    def _decode_attention(self, qh, keys, values) -> torch.Tensor:
        """One query position: grouped matmuls, no copies of the cache. (H, 1, hd) out.

        The query heads sharing a KV head are stacked as rows of one matrix, so GQA needs no
        repeat_interleave; at this size two small bmm beat SDPA's kernels (whose thread start-up dominates)."""
        K, G, hd = self.config.num_kv_heads, self.config.kv_groups, self.config.head_dim
        scores = (qh.reshape(K, G, hd) @ keys.transpose(1, 2)) * (hd ** -0.5)   # (K, G, S)
        pattern = torch.softmax(scores.float(), dim=-1).to(qh.dtype)
        return (pattern @ values).reshape(K * G, 1, hd)

    def _fused_attention(self, qh, keys, values, mask) -> torch.Tensor:
        """Several query positions: torch SDPA (flash attention where available). (H, T, hd) out."""
        if qh.device.type == "cpu":   # the CPU flash kernel takes GQA only as repeated heads
            G = self.config.kv_groups
            keys, values = keys.repeat_interleave(G, dim=0), values.repeat_interleave(G, dim=0)
            gqa = False
        else:
            gqa = self.config.num_kv_heads != self.config.num_heads
        z = F.scaled_dot_product_attention(qh[None], keys[None], values[None], attn_mask=mask,
                                           is_causal=mask is None, enable_gqa=gqa)
        return z[0]

    def _explicit_attention(self, qh, keys, values, p: Probe, n: LayerNames, mask) -> torch.Tensor:
        """Attention with scores and pattern as tensors, for hooks that ask for them. (H, T, hd) out.

        Query heads sharing a KV head are stacked (K, G*T, hd) so GQA needs no copies of the cache."""
        H, T, hd = qh.shape
        K, S = keys.shape[0], keys.shape[1]
        scores = (qh.reshape(K, -1, hd) @ keys.transpose(1, 2)).view(H, T, S) * (hd ** -0.5)   # (H, T, S)
        if T > 1:
            allowed = mask if mask is not None else torch.ones(T, S, dtype=torch.bool, device=qh.device).tril()
            scores = scores.masked_fill(~allowed, float("-inf"))
        scores = p(n.scores, scores)
        pattern = p(n.pattern, torch.softmax(scores.float(), dim=-1).to(qh.dtype))
        grouped = pattern.reshape(K, -1, S)                                              # (K, G*T, S)
        if T > 1 and not bool(torch.isfinite(values).all()):
            # 0 * NaN = NaN: a matmul would let a NaN value at position j leak into rows t < j that give it
            # zero weight. Generation is causal, so report NaN only where a row really reads one.
            finite = torch.isfinite(values)
            z = grouped @ torch.where(finite, values, 0.0)
            reads_bad = (grouped != 0).to(values.dtype) @ (~finite).to(values.dtype)     # (K, G*T, hd)
            return torch.where(reads_bad > 0, float("nan"), z).view(H, T, hd)
        return (grouped @ values).view(H, T, hd)

    # ---- convenience surfaces -------------------------------------------------------------------
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
        x = F.rms_norm(resid.to(self.device, self.dtype), (self.config.hidden_size,), self.weights.norm,
                       self.config.rms_norm_eps)
        return (x @ self.weights.lm_head).float().cpu()

    def generate(self, prompt_or_ids, **kwargs):
        """See engine.generate.generate."""
        from .generate import generate
        return generate(self, prompt_or_ids, **kwargs)
