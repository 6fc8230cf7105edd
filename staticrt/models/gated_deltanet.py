"""A gated DeltaNet layer (Qwen3.5's linear attention): a delta-rule state in place of a K/V cache.

`in_proj_qkv` gives q, k `[N, Hk*Dk]` and v `[N, Hv*Dv]`, which run through a causal depthwise
convolution over their last K positions (its history kept as a conv layer's is,
caches/conv_state.py) and silu; `in_proj_z` a gate, `in_proj_b` and `in_proj_a` a write strength
beta = sigmoid(b) and a decay g = -exp(A_log) softplus(a + dt_bias) a value head. Each value head's
state S `[Dk, Dv]` (q and k L2-normed, each key head serving Hv / Hk value heads) runs

    S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - k_t^T S_t))^T;  o_t = S_t^T q_t / sqrt(Dk)

and o, RMSNormed a head then gated by silu(z), goes through `out_proj`. A one-token step runs that
recurrence, a longer one transformers' chunked form (chunks of 64: within each, the delta rule's
triangular system solved at once; across them, the state carried), each as transformers' torch
path computes it, so float32 tokens are transformers'. Padding gets beta 0 and g 0: the state
passes it unchanged (caches/recurrent.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..caches.recurrent import StateView, deltanet_conv_width
from ..config import ModelConfig
from ..rope import RopeStep
from .fused_linear import FusedLinear, name_fused_parts_apart
from .short_conv import causal_conv

CHUNK = 64  # transformers' chunk_size for the gated delta rule


class GatedRMSNorm(nn.Module):
    """RMSNorm over a head's Dv, then times silu(z) (transformers' Qwen3_5RMSNormGated: norm first)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """`x`, `z` `[..., Dv]` -> `[..., Dv]`."""
        xf = x.float()
        xf = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (xf * F.silu(z.float())).to(x.dtype)


def _solve_by_doubling(system: torch.Tensor, rhs: torch.Tensor, longest: int) -> torch.Tensor:
    """X with (I + N) X = rhs, N the strictly lower part of `system [..., L, L]` (its diagonal read
    as ones, as solve_triangular's unitriangular does), for any L <= `longest`: N is nilpotent,
    so (I + N)^-1 = (I - N)(I + N^2)(I + N^4)...(I + N^(2^(m-1))) with 2^m >= L. Worked, L = 3:
    N^4 = 0, so m = 2 and X = (I + N^2)(I - N) rhs. m - 1 squarings of N, m products with X."""
    n = system.tril(-1)
    x = rhs - n @ rhs
    for _ in range(max(1, math.ceil(math.log2(max(longest, 2)))) - 1):
        n = n @ n
        x = x + n @ x
    return x


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.k_heads, self.v_heads = c.linear_key_heads, c.linear_value_heads
        self.k_dim, self.v_dim = c.linear_key_dim, c.linear_value_dim
        width = deltanet_conv_width(c)
        # nn.Conv1d for the checkpoint's names and shapes (`conv1d.weight [C, 1, K]`); forward calls F.conv1d
        self.conv1d = nn.Conv1d(width, width, c.conv_kernel, groups=width, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.empty(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, c.rms_norm_eps)
        value_width = self.v_heads * self.v_dim
        self.out_proj = nn.Linear(value_width, c.hidden_size, bias=False)
        parts = {"in_proj_qkv": width, "in_proj_z": value_width, "in_proj_b": self.v_heads, "in_proj_a": self.v_heads}
        self.in_proj = FusedLinear(c.hidden_size, parts, bias=False)
        name_fused_parts_apart(self)

    def forward(self, x: torch.Tensor, rope: RopeStep | None, view: StateView) -> torch.Tensor:
        """`x [B*T, C]` -> `[B*T, C]`; `rope` is unused (the signature is the attention's)."""
        batch, seq_len = view.meta.batch, view.meta.seq_len
        qkv, z, b, a = self.in_proj(x)  # [B*T, conv width], [B*T, Hv*Dv], [B*T, Hv] twice
        width, key_width = self.conv1d.weight.shape[0], self.k_heads * self.k_dim
        qkv = F.silu(causal_conv(view, qkv.view(batch, seq_len, width), self.conv1d))  # [B, T, width]
        q, k, v = qkv.split([key_width, key_width, self.v_heads * self.v_dim], dim=-1)
        q, k = q.reshape(batch, seq_len, self.k_heads, self.k_dim), k.reshape(batch, seq_len, self.k_heads, self.k_dim)
        v = v.reshape(batch, seq_len, self.v_heads, self.v_dim)
        real = view.real_tokens()[..., None]  # [B, T, 1]: padding gets beta 0 and g 0, and leaves the state be
        beta = b.view(batch, seq_len, self.v_heads).sigmoid() * real
        g = -self.A_log.float().exp() * F.softplus(a.view(batch, seq_len, self.v_heads).float() + self.dt_bias) * real
        # [B, H, T, D] float32, q and k L2-normed and repeated for the value heads they serve
        repeat = self.v_heads // self.k_heads
        q, k = (t.repeat_interleave(repeat, dim=2) if repeat > 1 else t for t in (q, k))
        q, k, v, beta, g = (t.transpose(1, 2).float().contiguous() for t in (q, k, v, beta, g))
        q, k = _l2norm(q), _l2norm(k)
        if view.one_position():
            out, state = self._recurrent_step(view.state().float(), q / self.k_dim**0.5, k, v, g, beta)
        else:
            out, state = self._chunked(view.state().float(), q * self.k_dim**-0.5, k, v, g, beta, view.in_one_chunk())
        view.keep_state(state)
        out = out.transpose(1, 2).to(x.dtype)  # [B, T, Hv, Dv]
        out = self.norm(out, z.view(batch, seq_len, self.v_heads, self.v_dim))
        return self.out_proj(out.reshape(batch * seq_len, self.v_heads * self.v_dim))

    @staticmethod
    def _recurrent_step(
        state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One position: `state [B, H, Dk, Dv]`, `q`, `k` `[B, H, 1, Dk]`, `v [B, H, 1, Dv]`, `g`, `beta`
        `[B, H, 1]` -> (o `[B, H, 1, Dv]`, the next state), as transformers' recurrent gated delta rule."""
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
        state = state * g[:, :, 0].exp()[..., None, None]
        remembered = (state * k[..., None]).sum(dim=-2)  # [B, H, Dv]: what the state gives for k
        delta = (v - remembered) * beta[:, :, 0, None]
        state = state + k[..., None] * delta[..., None, :]
        return (state * q[..., None]).sum(dim=-2)[:, :, None], state

    @staticmethod
    def _chunked(
        state: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        one_chunk: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """T positions: `q`, `k` `[B, H, T, Dk]`, `v [B, H, T, Dv]`, `g`, `beta` `[B, H, T]` -> (o
        `[B, H, T, Dv]`, the state after T - 1), as transformers' chunked gated delta rule: T padded
        to chunks of L; within a chunk the delta rule's unit lower-triangular system solved at
        once; across chunks, the state carried. `one_chunk` (the ONNX graph's, whose T is a symbol
        no chunk count or padding can be traced over): L = T, at most that many, and the system
        solved by `_solve_by_doubling` (ONNX has no triangular solve)."""
        seq_len = q.shape[2]
        size = seq_len if one_chunk else CHUNK
        pad = 0 if one_chunk else (CHUNK - seq_len % CHUNK) % CHUNK
        if pad:
            q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
            beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
        count = 1 if one_chunk else (seq_len + pad) // CHUNK
        v_beta, k_beta = v * beta[..., None], k * beta[..., None]
        q, k, k_beta, v_beta = (t.unflatten(2, (count, size)) for t in (q, k, k_beta, v_beta))
        decay = g.unflatten(2, (count, size)).cumsum(dim=-1)  # [B, H, chunks, L], log space
        above = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)
        pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(above, float("-inf")).exp()
        system = (k_beta @ k.transpose(-1, -2)) * pairwise
        within = (q @ k.transpose(-1, -2)) * pairwise  # [B, H, chunks, L, L]
        k_decayed = k_beta * decay.exp()[..., None]
        if one_chunk:
            values, k_decayed = (_solve_by_doubling(system, t, one_chunk) for t in (v_beta, k_decayed))
        else:
            values, k_decayed = (
                torch.linalg.solve_triangular(system, t, upper=False, unitriangular=True) for t in (v_beta, k_decayed)
            )
        q = q * decay.exp()[..., None]
        k = k * (decay[..., -1:] - decay).exp()[..., None]
        chunk_decay = decay[..., -1].exp()[..., None, None]
        outs = []
        for i in range(count):
            v_new = values[:, :, i] - k_decayed[:, :, i] @ state
            outs.append(q[:, :, i] @ state + within[:, :, i] @ v_new)
            state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
        out = torch.cat(outs, dim=2)  # [B, H, chunks * L, Dv]
        return out[:, :, :seq_len], state
