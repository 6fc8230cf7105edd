"""What a decode step can approach, measured on this machine in the same run: the streaming rate
of a large matrix-vector product, a CUDA device's copy bandwidth, and the bytes a step must read."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..config import ModelConfig
from ..models.a8_linear import A8Linear
from ..models.decoder import Decoder
from ..models.expert_quant import QuantizedStack
from ..models.moe import Experts
from ..models.packed_linear import address


def stored_bytes(tensor: torch.Tensor) -> int:
    """The bytes `tensor` holds: a quantized weight (a tensor subclass) counts its inner tensors."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return sum(stored_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def weight_bytes_per_step(model: Decoder, batch_size: int) -> int:
    """Bytes of weights one decode step reads: every matrix once (as stored: int8 / int4 with
    their scales when quantized; staticrt's int8-activation kernels' codes and scales are buffers), but of an
    untied embedding table only the looked-up rows, and of a layer's E experts the k a row reads
    (models/moe.py: min(E, rows x k) of them, the most a batch's rows can touch)."""
    coded = (A8Linear, QuantizedStack)  # codes and scales held as buffers
    codes = [b for m in model.modules() if isinstance(m, coded) for b in m.buffers(recurse=False)]
    # A dense view of a packed copy (a packed lookup's table, a packed linear's `blocks`) is the
    # packed tensor's own bytes, counted with it.
    params = [p for m in model.modules() for p in m.parameters(recurse=False)]
    packed = {address(p) for p in params if p.is_mkldnn}
    held = [p for p in params if p.is_mkldnn or address(p) not in packed]
    total = sum(stored_bytes(p) for p in [*held, *codes])
    embed = model.embed_tokens.weight
    if model.lm_head is not None and embed is not getattr(model.lm_head, "weight", None):  # not a packed head's
        total -= embed.numel() * embed.element_size()
        total += batch_size * embed.shape[1] * embed.element_size()
    for experts in (m for m in model.modules() if isinstance(m, Experts)):
        whole = sum(stored_bytes(t) for t in [*experts.parameters(), *experts.buffers()])  # codes and scales too
        count = experts.num_experts
        total -= whole - whole * min(count, batch_size * model.config.experts_per_token) // count
    return total


def graph_weight_bytes(path: Path, batch_size: int) -> int:
    """Bytes of weights one step of the ONNX graph at `path` reads: every initializer once (as
    stored: packed int4 / int8 with their scales and zero points when quantized), but of a table
    only gathered from (the embedding of an untied model, its int8 codes and their scales in a
    quantized graph: exporters/onnx_lookup.py) only the looked-up rows."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    made_by = {out: node for node in graph.node for out in node.output}
    lookups = [node for node in graph.node if node.op_type in ("Gather", "GatherBlockQuantized")]
    # a quantized lookup's scales come through a Reshape of their initializer
    scales = [made_by[node.input[2]] for node in lookups if node.op_type == "GatherBlockQuantized"]
    gathered = {node.input[0] for node in [*lookups, *scales]}
    rows = {id(node) for node in [*lookups, *scales]}
    elsewhere = {name for node in graph.node if id(node) not in rows for name in node.input}
    total = 0
    for init in graph.initializer:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
        shape = list(init.dims)
        if init.name in gathered and init.name not in elsewhere:
            shape[0] = batch_size  # one row a token
        total += math.prod(shape) * itemsize
    return total


def kv_bytes_per_step(
    config: ModelConfig, batch_size: int, attended: int, dtype: torch.dtype, int8: bool = False
) -> int:
    """Bytes of K and V a decode step must read when every layer attends to `attended` positions;
    `int8`: an int8 cache, one byte a value plus a scale of `dtype` a token and head."""
    element = torch.finfo(dtype).bits // 8
    per_head = config.head_dim + element if int8 else config.head_dim * element
    return 2 * config.num_layers * batch_size * config.num_kv_heads * attended * per_head


class StreamProbe:
    """The streaming rate of a large matrix-vector product on `device`: the bound a decode step
    can approach. A shared machine's memory bandwidth drifts by 20% and more from minute to minute,
    so the rate is sampled next to each timed run (`sample` before every timed generation and
    after the last) rather than once a process. The matrix is allocated once."""

    def __init__(self, dtype: torch.dtype, device: torch.device, mib: int = 256) -> None:
        cols = 8192
        rows = mib * 2**20 // (cols * torch.finfo(dtype).bits // 8)
        self.matrix = torch.randn(rows, cols).to(dtype=dtype, device=device)  # [rows, 8192]
        self.vector = torch.randn(cols).to(dtype=dtype, device=device)
        self.sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
        self.samples: list[float] = []

    def sample(self, repeats: int = 15) -> float:
        """Bytes/s of the median of `repeats` products after 3 warm-up ones; kept in `samples`."""
        for _ in range(3):
            torch.mv(self.matrix, self.vector)
        times = []
        for _ in range(repeats):
            self.sync()
            start = time.perf_counter()
            torch.mv(self.matrix, self.vector)
            self.sync()
            times.append(time.perf_counter() - start)
        rate = self.matrix.numel() * self.matrix.element_size() / statistics.median(times)
        self.samples.append(rate)
        return rate


def copy_bytes_per_s(device: torch.device, mib: int = 1024, repeats: int = 20, from_host: bool = False) -> float:
    """A CUDA device's memory bandwidth as a device-to-device copy of `mib` MiB measures it (bytes
    read plus bytes written a second): the yardstick of the CUDA-graph decode goal. `from_host`:
    the rate of a copy from pinned host memory (bytes moved a second), which bounds an offloaded
    cache's step, whose every layer crosses from the host."""
    size = mib * 2**20
    target = torch.empty(size, dtype=torch.uint8, device=device)
    source = torch.empty_like(target, device="cpu", pin_memory=True) if from_host else torch.empty_like(target)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    target.copy_(source, non_blocking=True)
    start.record()
    for _ in range(repeats):
        target.copy_(source, non_blocking=True)
    end.record()
    end.synchronize()
    return (1 if from_host else 2) * size * repeats / (start.elapsed_time(end) / 1000)
