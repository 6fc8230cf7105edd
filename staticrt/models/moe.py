"""A mixture-of-experts feed-forward in fixed shapes (Mixtral, Qwen3-MoE, OLMoE, gpt-oss).

The router scores every expert for every token; the k best carry the token, weighted by their
softmax probabilities (renormalised over the k where the family does; gpt-oss takes the k best
logits first and a softmax over those, and adds biases and its clamped SwiGLU). Routing decides data, never
shapes, in two forms chosen from the step's static shape:

- gathered (decode: N tokens with N * k < E): each token's k experts' weights are gathered by
  index into `[N, k, ...]` and multiplied there, so a decode step reads k of E experts a token
  (gpt-fast's `ConditionalFeedForward`: `w1[expert_indices]`);
- dense (prefill): every expert runs on every token and its output is weighted by the token's
  routing weight, 0 where it was not chosen. E / k times a routed expert's arithmetic, but no
  shape depends on the routing and no weight is copied; a prefill step is compute-bound in its
  attention and projections first, and this is the exact form. (Grouping tokens by expert with a
  fixed capacity needs a fallback for overflow; a loop of masked experts is this same arithmetic.)

Both add the chosen experts' outputs in increasing expert index, as transformers' loop does, so
float32 sums round alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .feed_forward import activate, uses_tanh_gelu


def expert_rows(x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """`x [T, K]` (a token's input to each of its experts) or `[T, k, K]` (one a chosen expert) as
    the rows a kernel takes, one a chosen expert of `chosen [T, k]`: `[T * k, K]`."""
    tokens, k = chosen.shape
    return (x[:, None].expand(tokens, k, x.shape[-1]) if x.dim() == 2 else x).reshape(tokens * k, -1)


class Experts(nn.Module):
    """E experts' gated MLPs, stacked: `gate_up_proj [E, 2I, H]` (an expert's gate rows, then its up
    rows) and `down_proj [E, H, I]`, and with `bias` their biases `[E, 2I]`, `[E, H]`
    (loading/families.py stacks a checkpoint's per-expert tensors, and lays gpt-oss's out so)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None

    def project(self, name: str, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """`x [T, K]` (a token's input to each of its experts) or `[T, k, K]` (one a chosen expert)
        through `name` (gate_up_proj, down_proj) of the experts `chosen [T, k]` -> `[T, k, N]`:
        on staticrt's int8 kernel where the stack's codes run there, else over the gathered weights."""
        stack = getattr(self, name)
        if getattr(stack, "kernel", False):
            return stack.project(x, chosen)
        weights = self.stack(name, chosen, x.dtype)  # [T, k, N, K]
        return torch.einsum("nh,nkoh->nko", x, weights) if x.dim() == 2 else torch.einsum("nki,nkhi->nkh", x, weights)

    def stack(self, name: str, index: torch.Tensor | int, dtype: torch.dtype) -> torch.Tensor:
        """The experts at `index`: their `name` weights (gate_up_proj, down_proj) `[*index, N, K]`,
        gathered from the float stack or dequantized from its codes (expert_quant.py, `--quantize`)."""
        stack = getattr(self, name)
        return stack[index] if isinstance(stack, torch.Tensor) else stack.gather(index, dtype)


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.k, self.num_experts = c.experts_per_token, c.num_experts
        self.renormalizes, self.float_weights = c.router_renormalizes, c.router_weights_float32
        self.topk_first, self.limit, self.alpha = c.router_topk_first, c.swiglu_limit, c.swiglu_alpha
        self.tanh_gelu = uses_tanh_gelu(c)
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=c.moe_bias)  # the router
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, c.moe_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x [N, H]` -> `[N, H]`."""
        weights, chosen = self._route(self.gate(x))  # [N, k] each
        chosen, order = chosen.sort(dim=-1)  # the experts' outputs add in index order
        weights = weights.gather(1, order)
        if x.shape[0] * self.k < self.num_experts:
            return self._gathered(x, chosen, weights)
        routing = x.new_zeros(x.shape[0], self.num_experts, dtype=weights.dtype).scatter(1, chosen, weights)
        return self._dense(x, routing)  # routing [N, E]: 0 where a token did not choose the expert

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The k chosen experts' weights and indices `[N, k]` from the router's `logits [N, E]`."""
        if self.topk_first:  # gpt-oss: a softmax over the k best logits, in the model's dtype
            best, chosen = torch.topk(logits, self.k, dim=-1)
            return torch.softmax(best, dim=-1), chosen
        weights, chosen = torch.topk(torch.softmax(logits.float(), dim=-1), self.k, dim=-1)
        if self.renormalizes:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float_weights else weights.to(logits.dtype)), chosen

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.experts.intermediate, dim=-1)
        if self.limit is not None:  # gpt-oss's clamped SwiGLU
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
            return (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        return activate(gate, self.tanh_gelu) * up

    def _gathered(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each token through its own k experts, whose weights are gathered: `[N, k, 2I, H]`."""
        e = self.experts
        gate_up = e.project("gate_up_proj", x, chosen)  # [N, k, 2I]
        if e.gate_up_proj_bias is not None:
            gate_up = gate_up + e.gate_up_proj_bias[chosen]
        out = e.project("down_proj", self._act(gate_up), chosen)  # [N, k, H]
        if e.down_proj_bias is not None:
            out = out + e.down_proj_bias[chosen]
        total = torch.zeros_like(x)
        for j in range(self.k):
            total = total + (out[:, j] * weights[:, j, None]).to(x.dtype)
        return total

    def _dense(self, x: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by `routing [N, E]`."""
        total, ex = torch.zeros_like(x), self.experts
        for e in range(self.num_experts):
            gate_up_bias = None if ex.gate_up_proj_bias is None else ex.gate_up_proj_bias[e]
            down_bias = None if ex.down_proj_bias is None else ex.down_proj_bias[e]
            hidden = self._act(F.linear(x, ex.stack("gate_up_proj", e, x.dtype), gate_up_bias))  # [N, I]
            down = F.linear(hidden, ex.stack("down_proj", e, x.dtype), down_bias)  # [N, H]
            total = total + (down * routing[:, e, None]).to(x.dtype)
        return total
