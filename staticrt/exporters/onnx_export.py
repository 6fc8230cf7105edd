"""Model + cache -> ONNX graph in ONNX Runtime GenAI's decoder convention, in an artifact folder.

One graph serves prefill and decode (S and T are dynamic; batch, heads, slots and head size are
fixed by the cache):

  inputs   input_ids [B, S] int64, attention_mask [B, T] int64 (T = columns so far, this step's
           included), position_ids [B, S] int64, past_key_values.{i}.key|value [B, H_kv, N_i, D],
           logits_index [L] int64 (optional: an initializer, [-1], is its default)
  outputs  logits [B, 1, V] (the step's last column), indexed_logits [B, L, V] (at the step's
           columns logits_index, counted from the end where negative), present.{i}.key|value
           [B, H_kv, N_i, D]

A runner that checks drafted tokens (speculative decoding) feeds logits_index = [-S .. -1] and
reads indexed_logits, the logits after every column of the step; any other step, and
onnxruntime-genai (which knows neither name), leave the input out: the head then runs on the last
column alone, and `logits` is that column's. genai reads a graph whose logits are a fixed 1 wide as
one that returns the last column's alone.

An int8 cache (caches/quantized.py) stores int8 K/V and adds past_key_values.{i}.key_scale|value_scale
[B, H_kv, N_i, 1] (and their presents) in the model's dtype: the graph quantizes the step's entries
and dequantizes what attention reads with plain arithmetic (Abs, ReduceMax, Div, Round, Clip, Cast,
Mul), standard ops every runtime has. onnxruntime-genai has no input for the scales, so such an
artifact has no genai_config.json; staticrt's runner binds every past by name and runs it.

A conv layer (LFM2's; caches/conv_state.py) takes past_key_values.{i}.conv [B, 1, N, C] instead, its
last inputs by position mod N, read and written by the graph as onnx_step.py's GraphConvView says;
a Mamba2 layer that too, and past_key_values.{i}.ssm [B, H, D, N], its state after the row's last
token (GraphStateView); genai has no input for either.

Cache slots follow the attention mask's columns, as in transformers and onnxruntime-genai: this
step's S entries go to columns T - S .. T - 1, written by the standard `TensorScatter` (opset 24)
at T - S (T counted to each row's last marked column, see `marked_columns`), mode `linear` for a
layer of `max_cache_len` slots and `circular` for a rotating layer of `window` slots. A padded
column is a hole the mask hides. Which token position a column holds is counted from the mask
(cumsum - 1), so sliding windows and causality are judged in positions,
not columns, and holes never shorten a window. Rotating layers attend before they write (the
buffer as it was plus the step's own K/V) and keep only the newest min(S, window) entries, so a
chunk of any length is exact with a window-sized buffer; runners pad on the left (holes before a
row's first token), which keeps every column a rotating buffer still holds a real one.

A runner that binds each past and its present to one buffer (staticrt's ONNX runner, the genai
`past_present_share_buffer`) has the cache updated in place: `present` is the TensorScatter's
output itself, which ONNX Runtime then writes into the bound buffer.

Files, beside manifest.json: onnx/model.onnx and its external data onnx/model.onnx.data, and
genai_config.json (with the checkpoint's tokenizer files) at the top of the folder, where
onnxruntime-genai looks for them.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..artifacts.manifest import INDEXED_LOGITS, LOGITS_INDEX
from ..caches import KVCache
from ..caches.ops import onnx_translations
from ..errors import ArtifactError
from ..models.decoder import Decoder
from ..models.expert_quant import experts_quantized
from ..models.quant_spec import QuantSpec
from .onnx_genai import GENAI_CONFIG, GENAI_SLACK, genai_config
from .onnx_rewrites import multi_output_rules_at_their_op
from .onnx_step import OnnxStep

OPSET = 24
MAX_IR_VERSION = 13  # the newest IR version onnxruntime 1.31 loads
GRAPH = "onnx/model.onnx"


def check_onnx_cache(cache: KVCache) -> None:
    """Refuse a rotating layout onnxruntime-genai would allocate differently: it gives a sliding
    layer `window_size + cache_slack` slots and reads a cache_slack of 0 as its default (16), so
    the rotating layers need at least one slot more than the model's window."""
    if cache.window is not None and cache.window <= cache.config.sliding_window:
        raise ArtifactError(
            f"window is {cache.window}, the model's sliding_window; onnxruntime-genai allocates sliding layers "
            "window_size + cache_slack slots with cache_slack >= 1, so the onnx format needs window >= "
            f"{cache.config.sliding_window + 1}: set window = {cache.config.sliding_window + GENAI_SLACK} "
            "(genai's default slack) or leave it unset"
        )


def example_inputs(cache: KVCache) -> tuple[torch.Tensor, ...]:
    """Inputs to trace with: S = 5, T = 7 and L = 2 (sizes of 0 and 1 would be specialised), zero caches."""
    batch, seq_len, total = cache.spec.max_batch_size, 5, 7
    device = cache.device
    past = [
        torch.zeros(shape, dtype=dtype, device=device)
        for i in range(len(cache.layer_lengths))
        for _, shape, dtype in cache.layer_parts(i)
    ]
    ids = torch.zeros(batch, seq_len, dtype=torch.int64, device=device)
    logits_index = torch.tensor([3, 4], dtype=torch.int64, device=device)  # the graph takes [-2, -1] alike
    return ids, torch.ones(batch, total, dtype=torch.int64, device=device), ids.clone(), logits_index, *past


def io_names(cache: KVCache) -> tuple[list[str], list[str]]:
    kv = [f"{i}.{part}" for i in range(len(cache.rotating)) for part, _, _ in cache.layer_parts(i)]
    return (
        ["input_ids", "attention_mask", "position_ids", LOGITS_INDEX, *(f"past_key_values.{n}" for n in kv)],
        ["logits", INDEXED_LOGITS, *(f"present.{n}" for n in kv)],
    )


def export_graph(model: Decoder, cache: KVCache, path: Path) -> None:
    """Trace one step with dynamic batch, S and T and write it (weights as external data) to `path`."""
    from torch.export import Dim

    step = OnnxStep(model, cache).eval()
    batch, seq_len, total = Dim("batch_size"), Dim("sequence_length"), Dim("total_sequence_length")
    dynamic = (
        {0: batch, 1: seq_len},
        {0: batch, 1: total},
        {0: batch, 1: seq_len},
        {0: Dim("logits_length")},
        tuple({0: batch} for _ in io_names(cache)[0][4:]),
    )
    inputs, outputs = io_names(cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The exporter reports progress and benign notes (missing torchvision, merged axis names) as
    # warnings; staticrt shows its own stages instead.
    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with torch.no_grad(), warnings.catch_warnings(), multi_output_rules_at_their_op():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                step,
                example_inputs(cache),
                str(path),
                dynamo=True,
                opset_version=OPSET,
                dynamic_shapes=dynamic,
                input_names=inputs,
                output_names=outputs,
                custom_translation_table=onnx_translations(),
                external_data=True,
                verbose=False,
            )
    finally:
        quiet.setLevel(level)
    give_default(path, LOGITS_INDEX, [-1])


def give_default(path: Path, name: str, value: list[int]) -> None:
    """Make the graph input `name` optional, `value` (int64) when not fed: an initializer of the
    same name is its default (ONNX IR 4+; ONNX Runtime lists it as an overridable initializer, not
    an input). The weights stay where they are, in the graph's external data."""
    import numpy as np
    import onnx

    graph = onnx.load(str(path), load_external_data=False)
    graph.graph.initializer.append(onnx.numpy_helper.from_array(np.array(value, dtype=np.int64), name))
    onnx.save(graph, str(path))


def graph_io(path: Path) -> dict[str, Any]:
    """What the manifest says of the graph: opset, IR version, each input's and output's dims."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False)
    if graph.ir_version > MAX_IR_VERSION:
        raise ArtifactError(
            f"{path} came out with IR version {graph.ir_version}; onnxruntime loads up to {MAX_IR_VERSION}"
        )

    def values(items: Any) -> list[dict[str, Any]]:
        return [
            {
                "name": v.name,
                "shape": [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim],
                "dtype": onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name,
            }
            for v in items
        ]

    opset = next(o.version for o in graph.opset_import if o.domain in ("", "ai.onnx"))
    return {
        "opset": opset,
        "ir_version": graph.ir_version,
        "inputs": values(graph.graph.input),
        "outputs": values(graph.graph.output),
    }


def write_onnx(
    folder: Path,
    model: Decoder,
    cache: KVCache,
    timed: Callable[[str, Callable[[], Any]], Any],
    quantize: QuantSpec | None = None,
) -> dict[str, Any]:
    """Write the graph (its norms and rotary embeddings fused, `onnx_fuse`; checked with
    `onnx.checker`, full check, before any contrib op is in it), with `quantize`'s weights and its
    static attention layers as GroupQueryAttention (`onnx_gqa`, one row) if given, and genai_config.json
    into `folder`; return the manifest's `onnx` field."""
    import onnx

    from .onnx_fuse import fuse_graph
    from .onnx_gqa import OP as GQA
    from .onnx_gqa import group_query_attention

    path = folder / GRAPH
    with experts_quantized(model, quantize):  # a mixture of experts' stacks as int8/int4 codes in the graph
        timed("trace and translate to ONNX", lambda: export_graph(model, cache, path))
    fused = timed("fuse norms and rotary embeddings (RMSNormalization, RotaryEmbedding)", lambda: fuse_graph(path))
    timed("check the graph (onnx.checker, full_check)", lambda: onnx.checker.check_model(str(path), full_check=True))
    quantized = None
    if quantize is not None:
        from .onnx_quantize import EMBEDDING, quantize_graph

        head = EMBEDDING if model.lm_head is None else "model.lm_head.weight"
        quantized = timed(
            f"quantize the weights to {quantize.layout} (ONNX Runtime's MatMulNBits)",
            lambda: quantize_graph(path, quantize, head),
        )
    # a quantized one-row graph's static layers as one op each (onnx_gqa.py says why others keep theirs);
    # the op sees every column before a query's, so a model with windowed layers keeps its masks
    rows, windowed = cache.spec.max_batch_size, "sliding_attention" in model.config.layer_types
    fused[GQA] = 0
    if quantized and not windowed:
        fused[GQA] = timed(f"static attention layers as {GQA}", lambda: group_query_attention(path, rows))
    genai = None  # genai's decoder takes float K/V only; it cannot feed an int8 cache's scales or a recurrent state
    if cache.parts == KVCache.parts and not cache.recurrent:
        (folder / GENAI_CONFIG).write_text(json.dumps(genai_config(cache, GRAPH), indent=2) + "\n")
        genai = GENAI_CONFIG
    return {"onnx": {"graph": GRAPH, "genai_config": genai, "quantize": quantized, "fused": fused, **graph_io(path)}}
