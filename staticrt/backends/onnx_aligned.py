"""An ONNX graph's external data laid out again with every tensor and every prepacked blob at a
page-aligned offset, so that ONNX Runtime maps each one at an address its kernels can read.

ONNX Runtime 1.31.1 writes the prepacked weights of a saved graph
(`session.save_external_prepacked_constant_initializers`) one after another, at whatever offset the
bytes before them end on. It maps each blob back at that offset's remainder of a page, and MLAS
reads a float MatMul's packed B with aligned vector loads: a blob that starts off a 64-byte boundary
crashes the process (SIGSEGV) at its first run. A float MatMul of [3, 120] then [120, 40] is enough
(tests/test_onnx.py): the first blob lands right after its 1,440-byte tensor, 32 bytes past a
boundary. Every region starts on a page here.

The blob entries are ONNX Runtime's own (onnxruntime/core/framework/tensor_external_data_info.cc):
an external-data key starting "prepacked", its value `key|offset;length;checksum[|...]`. Imports no torch.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

from ..errors import StaticrtError

ALIGNMENT = mmap.ALLOCATIONGRANULARITY  # what ONNX Runtime maps a tensor from: a page on Linux


def align_external_data(graph: Path, data: Path) -> None:
    """Rewrite `data` (the file `graph`'s external tensors read) with every region at an
    `ALIGNMENT` multiple and `graph` pointing at the new offsets. Both files are replaced in place
    once all is written, and left as they were if anything fails: call it on a copy being built."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    moved = data.with_name(f"{data.name}.aligned")
    try:
        with open(data, "rb") as source, open(moved, "wb") as target:
            for tensor in _external_tensors(model.graph):
                try:
                    _relocate(tensor, lambda offset, length: _place(source, target, offset, length, data))
                except (KeyError, ValueError) as err:  # another onnxruntime's form: the copy is not kept
                    raise StaticrtError(
                        f"{graph}: the external data of {tensor.name!r} is not in the form this staticrt lays out "
                        f"({type(err).__name__}: {err})"
                    ) from None
    except BaseException:
        moved.unlink(missing_ok=True)
        raise
    moved.replace(data)
    onnx.save(model, str(graph))


def _relocate(tensor: Any, place: Any) -> None:
    """Point `tensor`'s offset and its prepacked blobs' offsets where `place(offset, length)` copied them."""
    entries = {entry.key: entry for entry in tensor.external_data}
    entries["offset"].value = str(place(int(entries["offset"].value), int(entries["length"].value)))
    for key, entry in entries.items():
        if key.startswith("prepacked"):
            name, *blobs = entry.value.split("|")
            placed = []
            for blob in blobs:
                offset, length, checksum = blob.split(";")
                placed.append(f"{place(int(offset), int(length))};{length};{checksum}")
            entry.value = "|".join([name, *placed])


def _place(source: Any, target: Any, offset: int, length: int, data: Path) -> int:
    """Copy `length` bytes at `offset` of `source` to the next aligned offset of `target`; return that offset."""
    at = -(-target.tell() // ALIGNMENT) * ALIGNMENT
    target.write(b"\0" * (at - target.tell()))
    source.seek(offset)
    copied = 0
    while copied < length:
        chunk = source.read(min(length - copied, 1 << 24))
        if not chunk:
            raise StaticrtError(f"{data} ends before the {length} bytes its graph names at offset {offset}")
        target.write(chunk)
        copied += len(chunk)
    return at


def _external_tensors(graph: Any) -> list[Any]:
    """Every tensor of `graph` and its subgraphs whose bytes live in an external file."""
    import onnx

    found = [t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    for node in graph.node:
        for attribute in node.attribute:
            tensors = [attribute.t, *attribute.tensors]
            found += [t for t in tensors if t.data_location == onnx.TensorProto.EXTERNAL]
            for sub in [attribute.g, *attribute.graphs] if attribute.HasField("g") else attribute.graphs:
                found += _external_tensors(sub)
    return found
