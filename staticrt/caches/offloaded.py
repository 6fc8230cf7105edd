"""Offloaded caches: K/V storage in host memory, two device working buffers that take turns.

Every offloaded layer's K/V lives in host memory (pinned where CUDA is present). Offloaded layer
number r (counting only offloaded layers) attends from working slot r mod 2, while the next
offloaded layer's K/V is copied host -> device into the other slot on a side CUDA stream, so the
copy overlaps this layer's compute. Events order the two streams: the copy into a slot starts
after the layer that last read it, and a layer starts after its copy. Device memory for K/V is
two layers' worth whatever the depth. A step's new entries go to the working slot (this step's
attention reads them there) and through to host storage (later steps read them from there).

Nothing here allocates after construction and nothing is reassigned, so a step can be captured
in a CUDA graph and replayed: the copies are `cudaMemcpyAsync` from pinned memory at fixed
addresses, and the write-through is an ordinary kernel writing host storage through a device view
of the pinned memory (unified virtual addressing). The stream handoff sits inside two custom ops
that torch.compile keeps opaque and in order, as mutations of the working slots.

Without CUDA the same logic runs on the CPU (host storage and working slots in ordinary memory,
copies synchronous), so every machine tests the bookkeeping.

`OffloadedStaticCache` offloads every layer; `OffloadedHybridCache` offloads only the global
layers of a Hybrid model and keeps the small rotating buffers of sliding layers on the device.
"""

from __future__ import annotations

import warnings

import torch

from ..config import ModelConfig
from .base import KVCache
from .hybrid import HybridCache
from .ops import cache_write
from .spec import CacheSpec
from .static import StaticCache
from .view import LayerView, StepMetadata


class OffloadWarning(RuntimeWarning):
    """The offloaded cache runs, but without pinned memory: slower, and not CUDA-graph capturable."""


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_PENDING: dict[int, torch.cuda.Event] = {}  # working slot address -> event its copy records
_WARNED: set[str] = set()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


@torch.library.custom_op("staticrt::prefetch_kv", mutates_args=("slot_key", "slot_value"))
def prefetch_kv(
    slot_key: torch.Tensor, slot_value: torch.Tensor, host_key: torch.Tensor, host_value: torch.Tensor
) -> None:
    """Copy one layer's host K/V `[B, H_kv, L, D]` into a working slot. On CUDA the copy runs on
    the side stream once the current stream's earlier work (the layer that last read the slot) is
    done, and does not block it; `await_kv` joins it back."""
    if slot_key.device.type != "cuda":
        slot_key.copy_(host_key)
        slot_value.copy_(host_value)
        return
    main, side = torch.cuda.current_stream(slot_key.device), _side_stream(slot_key.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        slot_key.copy_(host_key, non_blocking=True)
        slot_value.copy_(host_value, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(side)
    _PENDING[slot_key.data_ptr()] = copied


@torch.library.custom_op("staticrt::await_kv", mutates_args=("slot_key", "slot_value"))
def await_kv(slot_key: torch.Tensor, slot_value: torch.Tensor, after: torch.Tensor) -> None:
    """Make the current stream wait for the slot's pending copy. It is declared as a mutation of
    the slot, so compiled graphs keep it between the copy and the reads, and it takes the layer's
    input `after`, so inductor cannot hoist it above the previous layer's compute (it did, which
    would serialise every copy before the compute it should overlap). On the CPU the copy was
    synchronous and there is nothing to wait for."""
    copied = _PENDING.pop(slot_key.data_ptr(), None)
    if copied is not None:
        torch.cuda.current_stream(slot_key.device).wait_event(copied)


def _pinned_memory(device: torch.device) -> bool:
    """Whether host storage for a cache on `device` can be pinned; warns where it cannot."""
    if device.type == "meta":  # `staticrt inspect` sizes caches without allocating them
        return False
    if device.type == "cuda":
        try:
            torch.empty(1, pin_memory=True)
            return True
        except RuntimeError as err:
            reason = f"pinned host memory is unavailable ({err})"
    else:
        reason = f"this machine has no pinned memory for {device.type} (CUDA is not available)"
    if reason in _WARNED:  # once a process: warning filters alone repeat it after any catch_warnings
        return False
    _WARNED.add(reason)
    warnings.warn(
        f"offloaded cache on {device}: {reason}; host storage falls back to ordinary memory and the "
        "working buffers are filled by synchronous copies: the same tokens, but no overlap and no "
        "CUDA-graph capture. Offload from a CUDA device with pinned memory, or use cache='static'",
        OffloadWarning,
        stacklevel=4,
    )
    return False


def _device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A `device` tensor aliasing pinned `host`: under unified virtual addressing pinned memory is
    addressable from the device at its host pointer, so a kernel writes host storage directly."""
    interface = {
        "shape": (host.numel() * host.element_size(),),
        "typestr": "|u1",
        "data": (host.data_ptr(), False),
        "version": 3,
    }
    holder = type("PinnedBytes", (), {"__cuda_array_interface__": interface})()
    view = torch.as_tensor(holder, device=device).view(host.dtype).view(host.shape)
    torch._dynamo.mark_static_address(view)
    return view


class OffloadedCache(KVCache):
    """Linear (global) layers offloaded to the host; rotating layers, if any, stay on the device."""

    def __init__(
        self, config: ModelConfig, spec: CacheSpec, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        self.pinned = _pinned_memory(torch.device(device))  # read by allocate_layer
        super().__init__(config, spec, dtype, device)
        self.offloaded = tuple(i for i, rotating in enumerate(self.rotating) if not rotating)
        self._slot = {layer: rank % 2 for rank, layer in enumerate(self.offloaded)}
        self._next = dict(zip(self.offloaded, self.offloaded[1:]))
        for slot in range(min(2, len(self.offloaded))):
            for name in (f"work_key_{slot}", f"work_value_{slot}"):
                self.register_static(
                    name, torch.zeros(self.layer_shape(spec.max_cache_len), dtype=dtype, device=device)
                )
        # Where the write-through lands: a device view of pinned storage (a kernel, capturable), or
        # the host tensors themselves (on the CPU, and the pageable fallback: a host-side write).
        views = self.pinned and self.device.type == "cuda"
        self._write_targets = {
            i: tuple(_device_view(h, self.device) if views else h for h in self.host_buffers(i)) for i in self.offloaded
        }

    def leading_rows(self, rows: int) -> None:
        return None  # its write targets and working buffers are the whole batch's

    def allocate_layer(self, layer_idx: int) -> None:
        if self.rotating[layer_idx]:  # a sliding layer's window is small: it stays on the device
            return super().allocate_layer(layer_idx)
        host = "meta" if self.device.type == "meta" else "cpu"
        shape = self.layer_shape(self.layer_lengths[layer_idx])
        for name in (f"host_key_{layer_idx}", f"host_value_{layer_idx}"):
            storage = torch.zeros(shape, dtype=self.dtype, device=host, pin_memory=self.pinned)
            self.register_static(name, storage, host=True)

    def host_buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An offloaded layer's K/V storage `[B, H_kv, max_cache_len, D]` in host memory."""
        return getattr(self, f"host_key_{layer_idx}"), getattr(self, f"host_value_{layer_idx}")

    def storage_buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return super().storage_buffers(layer_idx) if self.rotating[layer_idx] else self.host_buffers(layer_idx)

    def layer_buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotating[layer_idx]:
            return super().layer_buffers(layer_idx)
        slot = self._slot[layer_idx]
        return getattr(self, f"work_key_{slot}"), getattr(self, f"work_value_{slot}")

    def layer_layout(self, layer_idx: int) -> str:
        return super().layer_layout(layer_idx) if self.rotating[layer_idx] else "offloaded"

    def begin_step(
        self, write_index: torch.Tensor, num_new: torch.Tensor, seq_len: int, fresh: bool = False
    ) -> StepMetadata:
        """Also start copying the first offloaded layer's K/V in."""
        meta = super().begin_step(write_index, num_new, seq_len, fresh)
        if self.offloaded:
            self._prefetch(self.offloaded[0])
        return meta

    def view(self, layer_idx: int, meta: StepMetadata, layer_input: torch.Tensor) -> LayerView:
        """Wait for this layer's K/V, then start copying the next offloaded layer's into the other
        slot, which the previous offloaded layer has finished reading."""
        if not self.rotating[layer_idx]:
            torch.ops.staticrt.await_kv(*self.layer_buffers(layer_idx), layer_input)
            if layer_idx in self._next:
                self._prefetch(self._next[layer_idx])
        return super().view(layer_idx, meta, layer_input)

    def _prefetch(self, layer_idx: int) -> None:
        torch.ops.staticrt.prefetch_kv(*self.layer_buffers(layer_idx), *self.host_buffers(layer_idx))

    def update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_idx: int,
        write_index: torch.Tensor,
        num_new: torch.Tensor,
        after: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write into the layer's working slot, and through to its host storage."""
        buffers = super().update(key, value, layer_idx, write_index, num_new, after)
        if not self.rotating[layer_idx]:
            for target, new in zip(self._write_targets[layer_idx], (key, value)):
                cache_write(target, new.to(target.device), write_index.to(target.device))
        return buffers


class OffloadedStaticCache(OffloadedCache, StaticCache):
    """Every layer linear and offloaded: device K/V is two layers' worth whatever the depth."""

    kind = "offloaded"


class OffloadedHybridCache(OffloadedCache, HybridCache):
    """A Hybrid cache whose global layers are offloaded; sliding layers keep their rotating
    buffers of `window` slots on the device."""

    kind = "offloaded-hybrid"
