"""The decoder: one code path for the Llama, Mistral, Qwen2 and Gemma2 families and every backend.

Module names follow transformers' checkpoints (`embed_tokens`, `layers.N.self_attn.o_proj`, ...)
so a safetensors file loads by name; q/k/v and gate/up are each one `FusedLinear`, whose parts
`state_dict` and `load_state_dict` still name as checkpoints do (`q_proj`, `gate_proj`, ...).
What a step needs (positions, masks, write indices) is computed once per step by the cache
(`KVCache.begin_step`), the RoPE tables once by the decoder; each layer gets them and its own
`LayerView` of the cache, as in mistral-inference. The model never knows which cache it runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..caches.base import KVCache
from ..caches.view import LayerView
from ..config import ModelConfig
from ..rope import apply_rope, inverse_frequencies, rope_tables

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [B, 1, T, D], one pair a step for every layer


class RMSNorm(nn.Module):
    """RMSNorm in float32. `offset` 0 is Llama's `w * x`; 1 is Gemma2's `(1 + w) * x`, which
    also multiplies before casting back (the two families round differently)."""

    def __init__(self, dim: int, eps: float, offset: float) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).type_as(x)
        return self.weight * xf.to(x.dtype)


class FusedLinear(nn.Linear):
    """Projections of one input held as one matrix, so that a decode step reads it with one
    matrix-vector product instead of several: on CPU each BLAS call has a fixed cost, large next to
    the small matrices of a small model (docs/measurements.md), and on GPU each is a kernel launch. `parts` maps each
    part's checkpoint name to its output size, in order; `forward` returns the parts' outputs.

    Checkpoints name the parts apart (`q_proj`, `k_proj`, ...): the owning module translates with
    `name_fused_parts_apart`, so `state_dict()` and `load_state_dict` speak the checkpoint's names.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = parts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # x [..., in] -> one [..., size] a part
        return super().forward(x).split(list(self.parts.values()), dim=-1)


def _fused_children(module: nn.Module, prefix: str) -> dict[str, FusedLinear]:
    """`prefix + name` -> each FusedLinear child of `module`."""
    return {f"{prefix}{name}": child for name, child in module.named_children() if isinstance(child, FusedLinear)}


def _split_fused(module: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, local_metadata: dict) -> None:
    """state_dict post-hook: each fused weight and bias become their parts (views), in place and
    in checkpoint order (each part's weight, then its bias, where the fused weight stood)."""
    fused = _fused_children(module, prefix)
    items = dict(state_dict)
    state_dict.clear()
    for key, value in items.items():
        owner, _, field = key.rpartition(".")
        child = fused.get(owner)
        if child is None:
            state_dict[key] = value
        elif field == "weight":
            sizes = list(child.parts.values())
            biases = items[f"{owner}.bias"].split(sizes) if child.bias is not None else [None] * len(sizes)
            for part, weight, bias in zip(child.parts, value.split(sizes), biases):
                state_dict[f"{prefix}{part}.weight"] = weight
                if bias is not None:
                    state_dict[f"{prefix}{part}.bias"] = bias


def _join_fused(module: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, *args: object) -> None:
    """load_state_dict pre-hook: parts given under their checkpoint names are concatenated into
    the fused tensor; a checkpoint missing a part is left for the strict check to name."""
    for owner, child in _fused_children(module, prefix).items():
        for field in ("weight", "bias") if child.bias is not None else ("weight",):
            names = [f"{prefix}{part}.{field}" for part in child.parts]
            if all(name in state_dict for name in names):
                state_dict[f"{owner}.{field}"] = torch.cat([state_dict.pop(name) for name in names])


def name_fused_parts_apart(module: nn.Module) -> None:
    """Make `module`'s state_dict and load_state_dict use its FusedLinear children's part names."""
    module.register_state_dict_post_hook(_split_fused)
    module.register_load_state_dict_pre_hook(_join_fused)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, bias = config, config.mlp_bias
        self.gate_up_proj = FusedLinear(
            c.hidden_size, {"gate_proj": c.intermediate_size, "up_proj": c.intermediate_size}, bias
        )
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=bias)
        self.tanh_gelu = c.hidden_act in ("gelu_pytorch_tanh", "gelu_tanh")
        name_fused_parts_apart(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.tanh_gelu else F.silu(gate)
        return self.down_proj(gate * up)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        c = config
        qkv_bias = c.attention_bias or c.qkv_bias
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.attention_scale
        self.softcap = c.attn_logit_softcapping
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv_proj = FusedLinear(c.hidden_size, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}, qkv_bias)
        self.o_proj = nn.Linear(q_size, c.hidden_size, bias=c.attention_bias)
        name_fused_parts_apart(self)

    def forward(self, x: torch.Tensor, rope: Rope, view: LayerView) -> torch.Tensor:
        batch, seq_len = view.meta.batch, view.meta.seq_len  # x [B*T, C]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        group = heads // kv_heads
        q, k, v = self.qkv_proj(x)
        q = apply_rope(q.view(batch, seq_len, heads, dim).transpose(1, 2), *rope)  # [B, H, T, D]
        k = apply_rope(k.view(batch, seq_len, kv_heads, dim).transpose(1, 2), *rope)  # [B, Hkv, T, D]
        v = v.view(batch, seq_len, kv_heads, dim).transpose(1, 2)
        # SDPA where it gives the explicit path's tokens: float32 (in bfloat16 it keeps the scores
        # in float32 where transformers' eager attention rounds them, and tiny models' tokens part)
        if seq_len > 1 and view.fused and self.softcap is None and q.dtype == torch.float32:
            out = view.attend(q, k, v, self.scale)  # [B, H, T, D]; a long prefill's scores never materialise
        else:
            # GQA without repeating K/V: the G query heads that share a KV head are stacked along
            # the query axis, so one batched matmul per KV head reads the cache once.
            out = self.attend_apart(q.reshape(batch, kv_heads, group * seq_len, dim), k, v, view)
        out = out.view(batch, heads, seq_len, dim).transpose(1, 2).reshape(batch * seq_len, heads * dim)
        return self.o_proj(out)

    def attend_apart(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, view: LayerView) -> torch.Tensor:
        """`q [B, Hkv, G*T, D]` -> `[B, Hkv, G*T, D]` with the scores as a tensor of their own: a
        decode step's are small and its own kernels are fastest, they round as transformers' eager
        attention does in bfloat16, and Gemma2's softcap and the sink cache rewrite them."""
        batch, seq_len = view.meta.batch, view.meta.seq_len
        scores = view.scores(q, k, v) * self.scale  # [B, Hkv, G*T, L (+ T)]; writes first where exact
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        length = scores.shape[-1]
        scores = scores.view(batch, self.num_kv_heads, -1, seq_len, length).masked_fill(
            ~view.mask[:, :, None], float("-inf")
        )
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(*q.shape[:3], length)
        return view.weigh(probs, k, v)  # [B, Hkv, G*T, D]; a step that read first writes here


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        eps, offset, hidden = config.rms_norm_eps, config.norm_offset, config.hidden_size
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(hidden, eps, offset)
        # Llama names its pre-MLP norm `post_attention_layernorm`; Gemma2 uses that name for a
        # norm on the attention output and adds pre/post-feedforward norms ("sandwich").
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset)

    def forward(self, x: torch.Tensor, rope: Rope, view: LayerView) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), rope, view)
        if self.sandwich:
            x = x + self.post_attention_layernorm(attn)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


def _run_layer(layer: DecoderLayer, x: torch.Tensor, rope: Rope, view: LayerView) -> torch.Tensor:
    return layer(x, rope, view)


# The same call as a region torch.compile traces and compiles once and reuses for every layer of
# the same shape (its "hierarchical compilation"); outside torch.compile it is the plain call.
_run_layer_once = torch.compiler.nested_compile_region(_run_layer)


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.register_buffer("inv_freq", inverse_frequencies(config.rope, config.head_dim), persistent=False)
        self.quantization = None  # a QuantSpec once `quantize.quantize_weights` ran
        self.packed = False  # linear layers over oneDNN-packed weights once `packed_linear.pack` ran

    def forward(
        self,
        input_ids: torch.Tensor,
        write_index: torch.Tensor,
        cache: KVCache,
        num_new: torch.Tensor | None = None,
        last_only: bool = True,
        fresh: bool = False,
        layers_once: bool = False,
        columns: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run `input_ids [B, T]` at positions `write_index[b] + t`, writing the cache in place.

        `num_new [B]` counts each row's real tokens (the rest is right padding; default T). Returns
        logits `[B, V]` at each row's last real token, or `[B, T, V]` with `last_only=False`, or
        with `columns [L]` too `[B, L, V]` at those columns of every row (the head, a fifth of a
        small model's weights, runs on them alone: the ONNX graph's one step for prefill and verify).
        `fresh`: the caller knows every write_index is 0, so attention skips the cache's buffers.
        `layers_once`: under torch.compile, compile one layer's code and reuse it for the others
        (`_run_layer_once`); the same arithmetic, a fraction of the compile time.
        """
        batch, seq_len = input_ids.shape
        if num_new is None:
            num_new = torch.full((batch,), seq_len, dtype=torch.int64, device=input_ids.device)
        # The tokens stay flattened, `[B*T, C]`, through every layer: each projection is then a
        # plain matrix product on a row-major buffer (a `[B, T, C]` buffer with B = T = 1 reaches
        # inductor's CPU matmul as a `[1, C]` view with stride 0, which ATen copies before BLAS).
        x = self.embed_tokens(input_ids.reshape(batch * seq_len))  # [B*T, C]
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        meta = cache.begin_step(write_index, num_new, seq_len, fresh)
        rope = rope_tables(meta.positions, self.inv_freq, x.dtype)  # cos, sin [B, 1, T, D]
        run_layer = _run_layer_once if layers_once else _run_layer
        for i, layer in enumerate(self.layers):
            x = run_layer(layer, x, rope, cache.view(i, meta, x))
        if last_only:
            last = (num_new - 1).clamp(min=0)
            x = x.view(batch, seq_len, -1)[torch.arange(batch, device=x.device), last]  # [B, C]
        elif columns is not None:
            x = x.view(batch, seq_len, -1).index_select(1, columns).flatten(0, 1)  # [B*L, C]
        x = self.norm(x)
        logits = (
            F.linear(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(x)
        )  # [B or B*T or B*L, V]
        if self.config.final_logit_softcapping is not None:
            cap = self.config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits if last_only else logits.view(batch, -1, logits.shape[-1])


def use_column_major_weights(model: Decoder) -> Decoder:
    """Store every projection and the output head column-major, in place.

    Decode at small batch is one matrix-vector product per weight, bound by how fast the weights
    stream. CPU BLAS streams a matrix whose input dimension is the slow one ([in, out]
    contiguous) about a quarter faster than the [out, in] layout checkpoints use
    (docs/measurements.md). Shapes and values are unchanged, so `state_dict`,
    checkpoints and the model code are unaffected; only strides change. An untied embedding table
    is only gathered from, row by row, so it keeps its row-major layout; quantized weights keep
    the layout of their kernels.
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    weights = [m.weight for m in linears if not is_traceable_wrapper_subclass(m.weight)]
    if model.lm_head is None:
        weights.append(model.embed_tokens.weight)  # tied: the table is also the output head
    with torch.no_grad():
        for weight in weights:
            if weight.is_contiguous():
                weight.data = weight.data.t().contiguous().t()
    return model


def init_random(model: Decoder, seed: int) -> Decoder:
    """Seeded random weights for presets: small normal matrices and norms near their identity,
    so logits are spread enough that greedy tokens differ step to step."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # by checkpoint names and order, so a fused projection draws as its parts did
        for name, param in model.state_dict(keep_vars=True).items():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("layernorm.weight") or name == "norm.weight":
                param.copy_(noise * 0.1 + (0.0 if model.config.norm_offset else 1.0))
            else:  # a small embedding keeps tied heads from just echoing the input token
                param.copy_(noise * (0.02 if name == "embed_tokens.weight" else 0.15))
    return model
