"""Attention of every family: GQA over the cache's `LayerView`, with what the later families add
(q/k RMSNorm over each head or the whole projection, a partial or absent rotary, a query scale by
position, Granite's scale) as switches read off the config."""

from __future__ import annotations

import torch
from torch import nn

from ..caches.view import LayerView
from ..config import ModelConfig
from ..rope import RopeStep, apply_rope
from .fused_linear import FusedLinear, name_fused_parts_apart
from .norms import RMSNorm


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        c = config
        qkv_bias = c.attention_bias or c.qkv_bias
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.attention_scale
        self.softcap = c.attn_logit_softcapping
        self.key_multiplier = c.key_multiplier
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.gated = c.attention_output_gate  # Qwen3.5: q_proj gives each head's query, then its gate
        q_width = q_size * (2 if self.gated else 1)
        self.qkv_proj = FusedLinear(c.hidden_size, {"q_proj": q_width, "k_proj": kv_size, "v_proj": kv_size}, qkv_bias)
        self.o_proj = nn.Linear(q_size, c.hidden_size, bias=c.attention_bias)
        # gpt-oss: a learned logit a head that joins each softmax's denominator and takes no value
        self.sinks = nn.Parameter(torch.empty(c.num_heads)) if c.attention_sinks else None
        self.qk_norm = c.qk_norm
        if c.qk_norm is not None:  # "head": over each head's D; "width": over all of q's (k's) heads at once
            q_width, k_width = (c.head_dim, c.head_dim) if c.qk_norm == "head" else (q_size, kv_size)
            norm = (c.rms_norm_eps, c.norm_offset, c.norm_weight_in_float32)
            self.q_norm, self.k_norm = RMSNorm(q_width, *norm), RMSNorm(k_width, *norm)
        name_fused_parts_apart(self)

    def forward(self, x: torch.Tensor, rope: RopeStep | None, view: LayerView) -> torch.Tensor:
        """`x [B*T, C]` -> `[B*T, C]`; `rope` None: a layer without a rotary (SmolLM3's NoPE)."""
        batch, seq_len = view.meta.batch, view.meta.seq_len
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        group = heads // kv_heads
        q, k, v = self.qkv_proj(x)  # [B*T, H*D] (gated: H*2D), [B*T, Hkv*D] twice
        if self.key_multiplier != 1.0:  # Falcon-H1's
            k = k * self.key_multiplier
        if self.qk_norm == "width":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.gated:
            q, gate = q.view(batch, seq_len, heads, 2 * dim).chunk(2, dim=-1)  # [B, T, H, D] each
        q, k = q.reshape(batch, seq_len, heads, dim), k.view(batch, seq_len, kv_heads, dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, D], [B, Hkv, T, D]
        if rope is not None:
            q, k = apply_rope(q, rope.cos, rope.sin), apply_rope(k, rope.cos, rope.sin)
            if rope.query_scale is not None:
                q = q * rope.query_scale
        v = v.view(batch, seq_len, kv_heads, dim).transpose(1, 2)
        # SDPA where it gives the explicit path's tokens: float32 (in bfloat16 it keeps the scores
        # in float32 where transformers' eager attention rounds them, and tiny models' tokens part)
        if seq_len > 1 and view.fused and self.softcap is None and self.sinks is None and q.dtype == torch.float32:
            out = view.attend(q, k, v, self.scale)  # [B, H, T, D]; a long prefill's scores never materialise
        else:
            # GQA without repeating K/V: the G query heads that share a KV head are stacked along
            # the query axis, so one batched matmul per KV head reads the cache once.
            out = self.attend_apart(q.reshape(batch, kv_heads, group * seq_len, dim), k, v, view)
        out = out.view(batch, heads, seq_len, dim).transpose(1, 2).reshape(batch * seq_len, heads * dim)
        if self.gated:
            out = out * torch.sigmoid(gate.reshape(batch * seq_len, heads * dim))
        return self.o_proj(out)

    def attend_apart(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, view: LayerView) -> torch.Tensor:
        """`q [B, Hkv, G*T, D]` -> `[B, Hkv, G*T, D]` with the scores as a tensor of their own: a
        decode step's are small and its own kernels are fastest, they round as transformers' eager
        attention does in bfloat16, and Gemma2's softcap, gpt-oss's sinks and the sink cache rewrite them."""
        batch, seq_len = view.meta.batch, view.meta.seq_len
        scores = view.scores(q, k, v) * self.scale  # [B, Hkv, G*T, L (+ T)]; writes first where exact
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        length = scores.shape[-1]
        scores = scores.view(batch, self.num_kv_heads, -1, seq_len, length).masked_fill(
            ~view.mask[:, :, None], float("-inf")
        )
        if self.sinks is None:
            probs = torch.softmax(scores.float(), dim=-1)
        else:  # as gpt-oss computes it: its max taken out in the scores' dtype, the softmax in it too
            sink = self.sinks.view(1, self.num_kv_heads, -1, 1, 1).to(scores.dtype).expand(*scores.shape[:-1], 1)
            joined = torch.cat([scores, sink], dim=-1)  # [B, Hkv, G, T, L + 1]
            joined = joined - joined.amax(dim=-1, keepdim=True)
            probs = torch.softmax(joined, dim=-1, dtype=joined.dtype)[..., :-1]
        probs = probs.to(q.dtype).view(*q.shape[:3], length)
        return view.weigh(probs, k, v)  # [B, Hkv, G*T, D]; a step that read first writes here
