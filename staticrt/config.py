"""Model and cache configuration: one dataclass for every supported family.

A `ModelConfig` holds the switches the one decoder reads (where its norms sit, what its attention
adds, which rotary embedding each layer takes). loading/hf_config.py fills them from a transformers
`config.json` through the family table (loading/families.py); the built-in presets fill them
directly (gpt-fast style). The model code never looks at a raw config dict.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError, as_int, check_positive
from .recurrent_config import RECURRENT_KINDS, check_recurrent_layers
from .rope_config import RopeConfig

# transformers' model_type of each family the decoder runs (loading/families.py has a row for each)
FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "gemma2",
    "qwen3",
    "gemma3_text",
    "phi3",
    "smollm3",
    "olmo2",
    "olmo3",
    "granite",
    "ministral3",
    "mixtral",
    "qwen3_moe",
    "olmoe",
    "gpt_oss",
    "lfm2",
    "mamba2",
    "granitemoehybrid",
    "falcon_h1",
    "qwen3_5_text",
)
# What a layer mixes its tokens with: attention over every position or a window, a short causal
# convolution over the last `conv_kernel` positions (LFM2; models/short_conv.py), or a Mamba2
# (models/mamba2.py) or gated DeltaNet layer (models/gated_deltanet.py): a convolution, then a recurrent state
LAYER_KINDS = ("full_attention", "sliding_attention", "conv", "mamba", "deltanet")
# The MLP activations models/feed_forward.py implements, by transformers' names: silu (and its alias swish), and
# the tanh approximation of gelu. Any other would silently run as one of these, so it is refused.
ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh", "gelu_tanh")
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
QK_NORMS = ("head", "width")  # q/k RMSNorm over each head (Qwen3, Gemma 3) or the whole projection (OLMo 2)


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v/o biases (Llama's `attention_bias`)
    qkv_bias: bool = False  # q/k/v biases only (Qwen2)
    mlp_bias: bool = False
    hidden_act: str = "silu"  # silu | gelu_pytorch_tanh
    # Gemma2 specifics; neutral values for the other families.
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + w): 1.0 for Gemma2
    scale_embeddings: bool = False
    sandwich_norms: bool = False  # post-attention and pre/post-feedforward norms
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # What the families of 2025-26 add; neutral values for the others.
    rope_local: RopeConfig | None = None  # the sliding layers' rotary where it differs (Gemma 3's local base)
    rotary_dim: int = 0  # leading dims of each head that rotate (Phi's partial_rotary_factor); 0: head_dim
    nope_layers: tuple[int, ...] = ()  # layers without a rotary embedding (SmolLM3)
    qk_norm: str | None = None  # QK_NORMS: RMSNorm of q and k before the rotary
    norm_weight_in_float32: bool = False  # RMSNorm multiplies by w before the cast back (OLMo 2; Gemma's 1 + w too)
    post_norms: bool = False  # norms on the attention's and the MLP's outputs, none on their inputs (OLMo 2)
    embedding_multiplier: float = 1.0  # Granite's four multipliers
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None  # the attention scale, in place of 1/sqrt(head_dim)
    logits_scaling: float = 1.0  # logits are divided by it
    # Mixture of experts (models/moe.py); num_experts 0: a dense MLP on every layer.
    num_experts: int = 0
    experts_per_token: int = 0  # k: the experts each token's MLP reads
    moe_intermediate_size: int = 0  # each expert's; 0: intermediate_size
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is the experts' (the others dense); () with experts: all
    router_renormalizes: bool = False  # the k chosen weights divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)
    router_weights_float32: bool = False  # the weights stay float32 (Mixtral); else cast to the model's dtype
    router_topk_first: bool = False  # gpt-oss: the k best logits, then a softmax over them (else softmax, then k)
    moe_bias: bool = False  # biases on the router and every expert's projections (gpt-oss)
    swiglu_limit: float | None = None  # gpt-oss's clamped SwiGLU: (clamp(up) + 1) * g * sigmoid(alpha * g), g clamped
    swiglu_alpha: float = 1.702
    attention_sinks: bool = False  # a learned logit a head that joins every softmax's denominator (gpt-oss)
    # Gated short convolutions on the layers `layer_types` calls "conv" (LFM2): each reads its K last inputs.
    conv_kernel: int = 0  # K (LFM2's conv_L_cache; a Mamba2 layer's mamba_d_conv)
    conv_bias: bool = False  # biases on the conv (LFM2: and its in/out projections)
    # Mamba2 layers (`layer_types` "mamba"): H heads of D channels, a state of N a head in G groups,
    # prefilled in chunks of `mamba_chunk` positions; their convolution is the conv_* fields'
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state: int = 0  # N
    mamba_groups: int = 1  # G: B and C are shared by H / G heads each
    mamba_chunk: int = 256
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))  # dt clamped in a prefill's scan, as transformers does
    # gated DeltaNet layers (`layer_types` "deltanet", Qwen3.5): Hk key heads of Dk, Hv value heads of Dv
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    attention_output_gate: bool = False  # q_proj also gives a gate a head; the output times sigmoid(gate) (Qwen3.5)
    mixer_only: bool = False  # layers of a norm and a token mixer, no MLP (Mamba2)
    shared_expert: bool = False  # the dense MLP runs beside the experts, its output added (Granite 4.0-H)
    # Falcon-H1: a Mamba2 beside each layer's attention, on the same normed input, outputs summed (two
    # cache layers a layer: `cache_layers`), and its µP multipliers, neutral elsewhere
    parallel_mamba: bool = False
    branch_multipliers: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)  # attention's input, output; Mamba2's input, output
    key_multiplier: float = 1.0  # K times it, before the rotary
    ssm_multipliers: tuple[float, ...] = ()  # Mamba2's in_proj parts z, x, B, C, dt times these; (): 1
    mlp_multipliers: tuple[float, ...] = (1.0, 1.0)  # the gate's output before its activation; the MLP's output
    logits_multiplier: float = 1.0  # logits times it (Falcon-H1's lm_head_multiplier; Granite divides)
    mamba_norm: str = "gated"  # recurrent_config.MAMBA_NORMS: how a Mamba2 layer's output y meets its gate z

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"model family {self.family!r} is not supported; staticrt runs {', '.join(FAMILIES)}")
        for name in SIZES:
            object.__setattr__(self, name, as_int(getattr(self, name), name, 1, ConfigError))
        check_positive(self, "rms_norm_eps", "rms_norm_eps", zero=True)
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(self, name) is not None:
                check_positive(self, name, name)
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"hidden_act {self.hidden_act!r} is not implemented; staticrt runs {', '.join(ACTIVATIONS)}, and "
                "running another activation as one of these would give wrong tokens"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if len(self.layer_types) != self.num_layers * (2 if self.parallel_mamba else 1):
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_KINDS))
        if bad:
            raise ConfigError(f"layer_types holds {bad}; staticrt knows {list(LAYER_KINDS)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ConfigError("layer_types has sliding_attention layers but sliding_window is not set")
        check_recurrent_layers(self)
        self._check_additions()
        self._check_experts()

    def _check_additions(self) -> None:
        """The later families' switches: each in its range, before a weight is read."""
        rotary = self.rotary_dim or self.head_dim
        if not 0 < rotary <= self.head_dim or (rotary < self.head_dim and rotary % 2):
            raise ConfigError(
                f"the rotary width ({rotary}, head_dim x partial_rotary_factor) must be even and at most "
                f"head_dim ({self.head_dim}); restore config.json"
            )
        object.__setattr__(self, "rotary_dim", rotary)
        object.__setattr__(self, "nope_layers", tuple(sorted({int(i) for i in self.nope_layers})))
        if any(not 0 <= i < self.num_layers for i in self.nope_layers):
            raise ConfigError(f"nope_layers {list(self.nope_layers)} names layers outside 0..{self.num_layers - 1}")
        if self.qk_norm not in (None, *QK_NORMS):
            raise ConfigError(f"qk_norm {self.qk_norm!r} is not one of {list(QK_NORMS)}")
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            check_positive(self, name, name)
        if self.attention_multiplier is not None:
            check_positive(self, "attention_multiplier", "attention_multiplier")
        for rope in (self.rope, self.rope_local):
            if rope is not None and rope.kind == "longrope":
                sizes = {len(rope.short_factor), len(rope.long_factor)}
                if sizes != {rotary // 2}:
                    raise ConfigError(
                        f"longrope short_factor and long_factor must each hold rotary width / 2 = {rotary // 2} "
                        f"values (they hold {len(rope.short_factor)} and {len(rope.long_factor)}); restore config.json"
                    )

    def _check_experts(self) -> None:
        if not self.num_experts:
            object.__setattr__(self, "moe_layers", ())
            return
        k, experts = self.experts_per_token, self.num_experts
        if not 0 < k <= experts:
            raise ConfigError(f"num_experts_per_tok is {k}; it must lie in 1..num_experts ({experts})")
        layers = tuple(sorted({int(i) for i in self.moe_layers})) or tuple(range(self.num_layers))
        if any(not 0 <= i < self.num_layers for i in layers):
            raise ConfigError(f"the expert layers {list(layers)} name layers outside 0..{self.num_layers - 1}")
        object.__setattr__(self, "moe_layers", layers)
        object.__setattr__(self, "moe_intermediate_size", self.moe_intermediate_size or self.intermediate_size)

    @property
    def attention_scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def cache_layers(self, layer: int) -> tuple[int, ...]:
        """The cache layers (entries of `layer_types`) decoder layer `layer` reads: its own, or a
        parallel layer's Mamba2 then its attention (Falcon-H1's layer 1 reads cache layers 2 and 3)."""
        return (2 * layer, 2 * layer + 1) if self.parallel_mamba else (layer,)

    def layer_rope(self, layer: int) -> RopeConfig | None:
        """The rotary embedding decoder layer `layer` applies; None for a layer without one."""
        kind = self.layer_types[self.cache_layers(layer)[-1]]
        if layer in self.nope_layers or kind in RECURRENT_KINDS:
            return None
        if self.rope_local is not None and kind == "sliding_attention":
            return self.rope_local
        return self.rope

    @property
    def rope_restart(self) -> int | None:
        """The position at which a sequence is computed again from position 0: LongRoPE's switch to
        its long factors once a sequence passes its pretraining length, as transformers makes it
        (rope.py, generation/prefill.py); None for every other rotary embedding."""
        switches = {r.original_max_position_embeddings for r in self.ropes if r.kind == "longrope"}
        return min(switches) if switches else None

    @property
    def ropes(self) -> tuple[RopeConfig, ...]:
        """The distinct rotary embeddings the layers apply, in layer order: a step computes each
        one's tables once, for every layer that takes it."""
        # two comprehensions, no `:=` in one: torch 2.11's dynamo cannot trace that (tests/test_architecture.py)
        every = [self.layer_rope(i) for i in range(self.num_layers)]
        return tuple(dict.fromkeys(r for r in every if r is not None))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        data["rope"] = RopeConfig(**data.get("rope", {}))
        if data.get("rope_local") is not None:
            data["rope_local"] = RopeConfig(**data["rope_local"])
        for name in (
            "layer_types",
            "eos_token_ids",
            "nope_layers",
            "moe_layers",
            "branch_multipliers",
            "ssm_multipliers",
            "mlp_multipliers",
        ):
            data[name] = tuple(data.get(name, ()))
        return cls(**data)
