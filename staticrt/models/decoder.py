"""The decoder: one code path for every family of the family table (loading/families.py) and every
backend. A family is a set of switches in `ModelConfig`, read here and in attention.py, norms.py
and feed_forward.py; never a copy of this code.

Module names follow transformers' checkpoints (`embed_tokens`, `layers.N.self_attn.o_proj`, ...)
so a safetensors file loads by name; q/k/v and gate/up are each one `FusedLinear`, whose parts
`state_dict` and `load_state_dict` still name as checkpoints do (`q_proj`, `gate_proj`, ...).
What a step needs (positions, masks, write indices) is computed once per step by the cache
(`KVCache.begin_step`), the RoPE tables once by the decoder for each distinct rotary embedding;
each layer gets them and its own `LayerView` of the cache, as in mistral-inference. The model
never knows which cache it runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..caches.base import KVCache
from ..caches.recurrent import StateView
from ..caches.view import LayerView
from ..config import ModelConfig
from ..rope import RopeStep, inverse_frequencies, rope_step
from .attention import Attention
from .feed_forward import MLP
from .gated_deltanet import GatedDeltaNet
from .mamba2 import Mamba2
from .moe import SparseMoE
from .norms import RMSNorm
from .short_conv import ShortConv

# The recurrent layer kinds' token mixers, under the names their checkpoints give them: LFM2's gated
# short convolution, Mamba2 (Granite 4.0-H's name), gated DeltaNet (Qwen3.5's); attention otherwise.
MIXERS: dict[str, tuple[str, type[nn.Module]]] = {
    "conv": ("conv", ShortConv),
    "mamba": ("mamba", Mamba2),
    "deltanet": ("linear_attn", GatedDeltaNet),
}


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        c = config
        norm = lambda: RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_offset, c.norm_weight_in_float32)  # noqa: E731
        # the token mixer: attention, or a recurrent layer's (MIXERS) under its checkpoint name; a
        # parallel layer's (Falcon-H1) attention reads its second cache layer, a Mamba2 beside it the first
        cache_layer = c.cache_layers(layer_idx)[-1]
        self.mixer_name, mixer = MIXERS.get(c.layer_types[cache_layer], ("self_attn", None))
        setattr(self, self.mixer_name, Attention(config, cache_layer) if mixer is None else mixer(config))
        self.parallel = c.parallel_mamba
        if self.parallel:
            self.mamba = Mamba2(config)
            self.branch_multipliers = c.branch_multipliers  # attention's input, output; Mamba2's input, output
        self.mixer_only = c.mixer_only  # Mamba2's blocks: a norm and the mixer
        if not self.mixer_only:
            self.mlp = SparseMoE(config) if layer_idx in config.moe_layers else MLP(config)
        if c.shared_expert and layer_idx in config.moe_layers:  # Granite 4.0-H: a dense MLP beside the experts
            self.shared_mlp = MLP(config)
        # Llama norms the attention's and the MLP's inputs ("pre"; its pre-MLP norm is called
        # `post_attention_layernorm`). Gemma also norms their outputs ("sandwich": that name is its
        # norm on the attention output, beside pre/post-feedforward norms); OLMo 2 norms the
        # outputs alone ("post").
        self.placement = "post" if c.post_norms else "sandwich" if c.sandwich_norms else "pre"
        if self.placement != "post":
            self.input_layernorm = norm()
        if not self.mixer_only:
            self.post_attention_layernorm = norm()
        if self.placement == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if self.placement != "pre":
            self.post_feedforward_layernorm = norm()
        self.residual_multiplier = c.residual_multiplier  # Granite's; 1 elsewhere

    def forward(
        self, x: torch.Tensor, rope: RopeStep | None, view: LayerView | tuple[StateView, LayerView]
    ) -> torch.Tensor:
        """`x [B*T, C]` -> `[B*T, C]`; `view`: a parallel layer's two (its Mamba2's, its attention's)."""
        if self.placement == "pre":
            x = self._add(x, self._mix(self.input_layernorm(x), rope, view))
            return x if self.mixer_only else self._add(x, self._feed_forward(self.post_attention_layernorm(x)))
        post = self.placement == "post"
        attn = self._mix(x if post else self.input_layernorm(x), rope, view)
        x = self._add(x, self.post_attention_layernorm(attn))
        ff = self._feed_forward(x if post else self.pre_feedforward_layernorm(x))
        return self._add(x, self.post_feedforward_layernorm(ff))

    def _mix(
        self, x: torch.Tensor, rope: RopeStep | None, view: LayerView | tuple[StateView, LayerView]
    ) -> torch.Tensor:
        """The token mixer's output; a parallel layer's Mamba2 and attention on the same input, each
        times its multipliers, summed (Falcon-H1)."""
        mixer = getattr(self, self.mixer_name)
        if not self.parallel:
            return mixer(x, rope, view)
        ssm_view, view = view
        attention_in, attention_out, ssm_in, ssm_out = self.branch_multipliers
        return self.mamba(x * ssm_in, None, ssm_view) * ssm_out + mixer(x * attention_in, rope, view) * attention_out

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP, or the experts plus the shared MLP beside them (Granite 4.0-H)."""
        out = self.mlp(x)
        return out + self.shared_mlp(x) if hasattr(self, "shared_mlp") else out

    def _add(self, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        return x + (branch if self.residual_multiplier == 1.0 else branch * self.residual_multiplier)


def _run_layer(layer: DecoderLayer, x: torch.Tensor, rope: RopeStep | None, view: LayerView | tuple) -> torch.Tensor:
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
        # each layer's rotary embedding: an index into `config.ropes`, None for a layer without one
        ropes = [config.layer_rope(i) for i in range(config.num_layers)]
        self.layer_ropes = [None if r is None else config.ropes.index(r) for r in ropes]
        self.reset_buffers()
        self.quantization = None  # a QuantSpec once `quantize.quantize_weights` ran
        self.packed = False  # linear layers over oneDNN-packed weights once `packed_linear.pack` ran

    def reset_buffers(self) -> None:
        """(Re)build the buffers outside the checkpoint: the inverse frequencies, `inv_freq` for the
        first rotary embedding, `inv_freq_1` for a second (Gemma 3's local one), each with a
        `_long` twin for LongRoPE (rope.py); Falcon-H1's Mamba2 µP vectors."""
        for layer in self.layers:
            if layer.parallel:
                layer.mamba.reset_buffers()
        for i, rope in enumerate(self.config.ropes):
            name = f"inv_freq{f'_{i}' if i else ''}"
            self.register_buffer(name, inverse_frequencies(rope, self.config.rotary_dim), persistent=False)
            if rope.kind == "longrope":
                long = inverse_frequencies(rope, self.config.rotary_dim, long=True)
                self.register_buffer(f"{name}_long", long, persistent=False)

    def rope_steps(self, positions: torch.Tensor, num_new: torch.Tensor, dtype: torch.dtype) -> list[RopeStep]:
        """Each distinct rotary embedding's tables for a step at `positions [B, T]` whose rows feed
        `num_new [B]` real tokens."""
        last = None  # each row's last real position, for LongRoPE's choice: its column num_new - 1
        # (right-padded rows; an ONNX step's rows are left-padded and take every column: the last)
        if self.config.rope_restart is not None:
            last = positions.gather(1, (num_new - 1).clamp(min=0)[:, None]).squeeze(1)  # [B]
        steps = []
        for i, rope in enumerate(self.config.ropes):
            name = f"inv_freq{f'_{i}' if i else ''}"
            steps.append(
                rope_step(rope, positions, last, getattr(self, name), getattr(self, f"{name}_long", None), dtype)
            )
        return steps

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
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        meta = cache.begin_step(write_index, num_new, seq_len, fresh)
        ropes = self.rope_steps(meta.positions, num_new, x.dtype)  # tables [B, 1, T, R]
        run_layer = _run_layer_once if layers_once else _run_layer
        for i, layer in enumerate(self.layers):
            rope = None if self.layer_ropes[i] is None else ropes[self.layer_ropes[i]]
            views = [cache.view(j, meta, x) for j in self.config.cache_layers(i)]  # a parallel layer's two
            x = run_layer(layer, x, rope, views[0] if len(views) == 1 else tuple(views))
        if last_only:
            last = (num_new - 1).clamp(min=0)
            x = x.view(batch, seq_len, -1)[torch.arange(batch, device=x.device), last]  # [B, C]
        elif columns is not None:
            x = x.view(batch, seq_len, -1).index_select(1, columns).flatten(0, 1)  # [B*L, C]
        x = self.norm(x)
        logits = (
            F.linear(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(x)
        )  # [B or B*T or B*L, V]
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        if self.config.logits_multiplier != 1.0:
            logits = logits * self.config.logits_multiplier
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
            if name.endswith("norm.weight"):  # every RMSNorm: the layers', q/k's, the final one
                param.copy_(noise * 0.1 + (0.0 if model.config.norm_offset else 1.0))
            else:  # a small embedding keeps tied heads from just echoing the input token
                param.copy_(noise * (0.02 if name == "embed_tokens.weight" else 0.15))
    return model
