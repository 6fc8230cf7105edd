"""A Mamba2 layer (Granite 4.0-H's and Mamba2's token mixer): a gated state-space model.

`in_proj` gives a gate z `[N, H*D]`, the convolution's inputs xBC `[N, H*D + 2*G*S]` and a time
step dt `[N, H]` a head (N = B*T tokens; H heads of D channels; a state of S a head, B and C
shared by the H / G heads of each of G groups). xBC runs through a causal depthwise convolution
over its last K positions (its history kept as a conv layer's is, caches/conv_state.py) and silu,
then splits into x, B and C, and the state h `[B, H, D, S]` of each head runs

    h_t = exp(dt_t * A) h_{t-1} + dt_t x_t B_t^T,   y_t = h_t C_t + D x_t

(A = -exp(A_log) and D per head, dt = softplus(dt + dt_bias)). y, gated by silu(z) and normed per
group, goes through `out_proj`. A one-token step runs the recurrence (`_recurrent_step`), a
longer one transformers' chunked scan (`_chunked_scan`: quadratic within chunks of `mamba_chunk`
positions, the recurrence between them), each as transformers' torch path computes it, so
float32 tokens are transformers'. The step starts from the state the cache keeps for the row and
leaves the one after its last real token (caches/recurrent.py says what that allows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..caches.recurrent import StateView, mamba_conv_width
from ..config import ModelConfig
from ..rope import RopeStep
from .short_conv import causal_conv


class GatedRMSNorm(nn.Module):
    """RMSNorm over each of G groups of channels of `y * silu(z)` (transformers' MambaRMSNormGated),
    or with `gate_after` of y, then times silu(z) (Falcon-H1's `mamba_norm_before_gate`)."""

    def __init__(self, width: int, groups: int, eps: float, gate_after: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.groups, self.eps, self.gate_after = groups, eps, gate_after

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """`y`, `z` `[..., H*D]` -> `[..., H*D]`."""
        dtype, gate = y.dtype, F.silu(z.float())
        y = y.float() if self.gate_after else y.float() * gate
        grouped = y.view(*y.shape[:-1], self.groups, y.shape[-1] // self.groups)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gate_after:  # in float32 to the end, as Falcon-H1's norm
            return (self.weight * grouped.view_as(y) * gate).to(dtype)
        return self.weight * grouped.view_as(y).to(dtype)


class Mamba2(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.heads, self.head_dim, self.state = c.mamba_heads, c.mamba_head_dim, c.mamba_state
        self.groups, self.chunk = c.mamba_groups, c.mamba_chunk
        self.dt_limit = c.time_step_limit
        inner, conv_width = self.heads * self.head_dim, mamba_conv_width(c)
        # nn.Conv1d for the checkpoint's names and shapes (`conv1d.weight [C, 1, K]`); forward calls F.conv1d
        self.conv1d = nn.Conv1d(conv_width, conv_width, c.conv_kernel, groups=conv_width, bias=c.conv_bias)
        self.in_proj = nn.Linear(c.hidden_size, inner + conv_width + self.heads, bias=c.mamba_proj_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.D = nn.Parameter(torch.empty(self.heads))
        if c.mamba_norm != "none":  # else y * silu(z) (Falcon-H1 without `mamba_rms_norm`)
            self.norm = GatedRMSNorm(inner, self.groups, c.rms_norm_eps, c.mamba_norm == "gate_after")
        self.out_proj = nn.Linear(inner, c.hidden_size, bias=c.mamba_proj_bias)
        self.multipliers = c.ssm_multipliers
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)build `mup`, outside the checkpoint: Falcon-H1's µP, each of in_proj's parts z, x, B,
        C and dt times its multiplier (transformers' `mup_vector`), in the weights' dtype; None elsewhere."""
        mup = None
        if self.multipliers:
            inner, dtype = self.heads * self.head_dim, self.in_proj.weight.dtype
            parts = (inner, inner, self.groups * self.state, self.groups * self.state, self.heads)
            mup = torch.cat([torch.full((n,), m, dtype=dtype) for n, m in zip(parts, self.multipliers, strict=True)])
        self.register_buffer("mup", mup, persistent=False)

    def forward(self, x: torch.Tensor, rope: RopeStep | None, view: StateView) -> torch.Tensor:
        """`x [B*T, C]` -> `[B*T, C]`; `rope` is unused (the signature is the attention's)."""
        batch, seq_len = view.meta.batch, view.meta.seq_len
        inner, conv_width = self.heads * self.head_dim, self.conv1d.weight.shape[0]
        # sizes spelled out, never -1: torch.export keeps T one symbol (the ONNX graph's S)
        widths = [inner, conv_width, self.heads]
        projected = self.in_proj(x) if self.mup is None else self.in_proj(x) * self.mup  # [B*T, sum(widths)]
        z, xbc, dt = projected.view(batch, seq_len, sum(widths)).split(widths, dim=-1)
        xbc = F.silu(causal_conv(view, xbc, self.conv1d))  # [B, T, conv width]
        xs, b, c = xbc.split([inner, self.groups * self.state, self.groups * self.state], dim=-1)
        dt = F.softplus(dt + self.dt_bias)  # [B, T, H]
        real = view.real_tokens()  # [B, T]: padding gets dt 0, which leaves the state as it was (recurrent.py)
        shape = (batch, seq_len, self.groups, self.state)
        xs, b, c = xs.view(batch, seq_len, self.heads, self.head_dim), b.view(shape), c.view(shape)
        if view.one_position():
            y, state = self._recurrent_step(view.state(), xs[:, 0], dt[:, 0] * real, b[:, 0], c[:, 0])
        else:
            dt = torch.clamp(dt, self.dt_limit[0], self.dt_limit[1]) * real[..., None]
            y, state = self._chunked_scan(view.state(), xs, dt, b, c, view.in_one_chunk() is not None)
        view.keep_state(state)
        y = y.reshape(batch, seq_len, inner)
        y = self.norm(y, z) if hasattr(self, "norm") else y * F.silu(z)  # [B, T, H*D]
        return self.out_proj(y.view(batch * seq_len, inner).to(x.dtype))

    def _per_head(self, groups: torch.Tensor, dim: int) -> torch.Tensor:
        """B or C `[..., G, S]` (G at `dim`) -> `[..., H, S]`: each group's for its H / G heads."""
        return groups.repeat_interleave(self.heads // self.groups, dim=dim, output_size=self.heads)

    def _recurrent_step(
        self, state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One position a row: `state [B, H, D, S]`, `x [B, H, D]`, `dt [B, H]`, `b`, `c` `[B, G, S]`
        -> (y `[B, H, D]`, the next state), as transformers' selective_state_update."""
        a = -torch.exp(self.A_log.float())
        decay = torch.exp(dt[..., None, None].float() * a[:, None, None])  # [B, H, 1, 1]
        b, c = self._per_head(b, 1)[:, :, None], self._per_head(c, 1)  # [B, H, 1, S], [B, H, S]
        state = state * decay + dt[..., None, None] * b * x[..., None]
        y = torch.bmm(state.flatten(0, 1).to(c.dtype), c.flatten(0, 1)[..., None]).view_as(x)
        return y + x * self.D[:, None], state

    def _chunked_scan(
        self,
        state: torch.Tensor,
        x: torch.Tensor,
        dt: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        one_chunk: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """T positions a row: `x [B, T, H, D]`, `dt [B, T, H]`, `b`, `c` `[B, T, G, S]` -> (y
        `[B, T, H, D]`, the state after position T - 1), as transformers' mamba2_chunk_scan: chunks
        of L positions (T padded up to a multiple), within each a masked product of C and B (the
        diagonal blocks), across them each chunk's state carried by the recurrence. `one_chunk`:
        L = T, no padding (the ONNX graph's, whose T is a symbol: a padded T's arithmetic would
        specialise it; it costs T x T a head, and its sums round differently from chunks of L)."""
        seq_len = x.shape[1]
        size, count = (seq_len, 1) if one_chunk else (self.chunk, (seq_len + self.chunk - 1) // self.chunk)
        pad = 0 if one_chunk else count * size - seq_len
        x, b, c = x.float(), self._per_head(b.float(), 2), self._per_head(c.float(), 2)
        skip = self.D[:, None] * (F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x)  # the D x term, padded as the chunks
        x = x * dt[..., None]
        a = -torch.exp(self.A_log.float()) * dt  # [B, T, H]

        def chunks(t: torch.Tensor) -> torch.Tensor:  # [B, T, ...] -> [B, T / L, L, ...]
            if one_chunk:
                return t.unsqueeze(1)
            t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
            return t.reshape(t.shape[0], count, size, *t.shape[2:])

        x, a, b, c = chunks(x), chunks(a).permute(0, 3, 1, 2), chunks(b), chunks(c)  # a [B, H, chunks, L]
        a_cumsum = torch.cumsum(a, dim=-1)
        decay_in = torch.exp(_segment_sum(a))  # [B, H, chunks, L, L]: decay from position s to l
        scores = torch.einsum("bclhn,bcshn->bclsh", c, b) * decay_in.permute(0, 2, 3, 4, 1)
        y_diag = torch.einsum("bclsh,bcshp->bclhp", scores, x)
        decay_out = torch.exp(a_cumsum[:, :, :, -1:] - a_cumsum)  # to each chunk's end
        states = torch.einsum("bclhn,bclhp->bchpn", b * decay_out.permute(0, 2, 3, 1)[..., None], x)
        states = torch.cat([state[:, None].to(states.dtype), states], dim=1)  # [B, 1 + chunks, H, D, S]
        across = torch.exp(_segment_sum(F.pad(a_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
        states = torch.einsum("bzch,bzhpn->bchpn", across, states)
        states, last = states[:, :-1], states[:, -1]  # each chunk's starting state; the final one
        y_off = torch.einsum("bclhn,bchpn->bclhp", c, states) * torch.exp(a_cumsum).permute(0, 2, 3, 1)[..., None]
        y = (y_diag + y_off).flatten(1, 2) + skip  # [B, count * L, H, D]
        return y[:, :seq_len], last


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """`x [..., L]` -> `[..., L, L]`: entry (l, s) the sum of x over s + 1 .. l, -inf above the
    diagonal (transformers' segment_sum: cumulative sums of a masked copy, for stability)."""
    size = x.shape[-1]
    x = x[..., None].expand(*x.shape, size)
    below = torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device), diagonal=-1)
    sums = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device))
    return sums.masked_fill(~keep, -torch.inf)
