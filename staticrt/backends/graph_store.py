"""Compiled step graphs kept across processes: a graph inductor's own cache cannot hold, compiled
once with AOTInductor and stored in the user's cache (artifacts/user_cache.py), `graphs/<key>/`.

A CPU decode or verify graph reads its weights packed for oneDNN (models/packed_linear.py): a
packed constant does not pickle, so inductor's FX cache never holds such a graph and every
process compiled it again: 40 s of a 55 s SmolLM2 start. Here the same step (`run_step`) goes
through torch.export and AOTInductor into a library without weights; a later process loads it in
a fraction of a second and hands it the live model's tensors (a packed graph: the packed twin's,
one copy for every graph) and the cache's buffers as user-managed constants (no copy), so the
other graphs and this one write and read the same K/V, as an artifact's programs do (exported.py).

The key hashes everything the graph depends on (`graph_fields`): the weights' bytes, the config,
dtype, cache kind and shape, the graph's width and choice, threads, torch and staticrt's source,
the CPU's vector ISA. An entry is a folder written atomically (artifacts/write.py) holding
step.so (the library: code only), step.json where the graph calls staticrt's own kernels
(int8-a8, int4-a8: the calls AOTInductor's runner makes through its proxy executor, read from the
file beside the library) and entry.json (the fields and the files' CRCs); an entry that does not
match or does not load is rebuilt with a warning, never run. Two processes filling one entry each
build, and each rename puts a whole folder in place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import shutil
import time
import warnings
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..artifacts.manifest import aoti_libraries
from ..artifacts.user_cache import cache_root
from ..artifacts.write import write_folder
from ..caches import KVCache
from ..cpp_builds.aoti_runtime import runtime_compiled_once
from ..errors import StaticrtError
from ..models.decoder import Decoder
from ..models.packed_gemv import packed_bytes
from ..models.packed_linear import address, pack, weight_stamps
from .step import base_choice, choice_candidates, gives_logprobs, run_step, verifies

log = logging.getLogger("staticrt")

Key = tuple[int, str, bool]  # a graph: (tokens a row, choice, starts fresh), as compiled.py keys it
LIBRARY, CALLS, ENTRY = "step.so", "step.json", "entry.json"
# A library holds no weights: it reads the model's own, or the packed twin's (`StoredStep`). One
# holding them (`package_constants_in_so`) is mapped from its file and copied into the runner at
# load, both counted in the process's memory (SmolLM2: 632 MB mapped + 686 MB copied).
# Never frozen, whatever the caller's context (compiled.py freezes the graphs it compiles itself):
# a frozen library would name constants of its own that no live tensor answers.
AOTI_OPTIONS = {"aot_inductor.package_constants_in_so": False, "freezing": False}
_SOURCE_DIGEST: list[str] = []


def _source_digest() -> str:
    """staticrt's own code, hashed: a graph traced from other code is another graph."""
    if not _SOURCE_DIGEST:
        digest = hashlib.sha256()
        for path in sorted(Path(__file__).parent.parent.rglob("*.py")):
            digest.update(path.read_bytes())
        _SOURCE_DIGEST.append(digest.hexdigest())
    return _SOURCE_DIGEST[0]


def weights_digest(model: Decoder) -> str:
    """The weights' names, layouts and bytes, hashed: sha256 a tensor on every thread torch uses
    (hashlib lets go of the GIL), ~0.3 s for SmolLM2's 517 MB on 2 cores."""

    def one(item: tuple[str, torch.Tensor]) -> str:
        name, tensor = item
        layout = "packed" if tensor.is_mkldnn else list(tensor.stride())
        digest = hashlib.sha256(f"{name}:{tensor.dtype}:{list(tensor.shape)}:{layout};".encode())
        tensor = tensor.detach()
        if tensor.is_mkldnn:
            digest.update(packed_bytes(tensor))
        else:  # in memory order (a column-major matrix as its transpose): no copy of a large table
            order = sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d))
            digest.update(tensor.permute(order).contiguous().reshape(-1).view(torch.uint8).numpy().data)
        return digest.hexdigest()

    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        return hashlib.sha256("".join(pool.map(one, model.state_dict().items())).encode()).hexdigest()


def _crc32(path: Path) -> int:
    value = 0
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            value = zlib.crc32(chunk, value)
    return value


def graph_fields(model: Decoder, weights: str, cache: KVCache, key: Key) -> dict[str, Any]:
    """What a stored graph is valid for; its key is the hash of these fields."""
    spec = cache.spec
    return {
        "graph": list(key),
        "weights": weights,
        "config": model.config.to_dict(),
        "dtype": str(next(model.parameters()).dtype),
        "cache": [type(cache).__name__, spec.kind, spec.max_batch_size, spec.max_cache_len, spec.window],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "staticrt": [__version__, _source_digest()],
        "cpu": [platform.machine(), torch.backends.cpu.get_cpu_capability()],
    }


class StepModule(torch.nn.Module):
    """`run_step` of one graph as a module, so torch.export sees weights and cache buffers as
    named constants (`model.*`, `cache.*`) and the sampling arguments as inputs."""

    def __init__(self, model: Decoder, cache: KVCache, key: Key, packed: bool, layers_once: bool) -> None:
        super().__init__()
        self.model, self.cache = model, cache  # `model`: the packed twin where `packed`
        self.key, (_, self.choice, self.fresh) = key, key
        self.packed, self.layers_once = packed, layers_once

    def forward(self, *inputs: torch.Tensor) -> Any:
        *given, bias = inputs  # `_build`'s inputs: run_step's seven, then the logit bias [B, V]
        return run_step(
            self.model,
            self.cache,
            *given,
            bias=bias,
            candidates=choice_candidates(self.choice),
            fresh=self.fresh,
            layers_once=self.layers_once,
            either=base_choice(self.choice) == "pick",
            every_position=verifies(self.choice),
            logprobs=gives_logprobs(self.choice),
        )


def live_addresses(step: StepModule) -> list[int]:
    """Where the model's weights and the cache's buffers live: a stored step points at them."""
    return [address(t) for t in [*step.parameters(), *step.buffers()]]


class StoredStep:
    """A step function (`run_step`'s signature) running a compiled library over the live model and
    cache: every constant the library names after a weight (`model.*`) or a cache buffer
    (`cache.*`) is that very tensor (user-managed: no copy), so it writes the K/V the other graphs
    read, and a library stored without its weights (`AOTI_OPTIONS`) reads the model's own."""

    def __init__(self, library: Path, step: StepModule) -> None:
        self._runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(library), 1)
        live = {name: t.detach() for name, t in [*step.named_parameters(), *step.named_buffers()]}
        names = self._runner.get_constant_names_to_original_fqns()  # the library's name -> fqn
        missing = [fqn for fqn in names.values() if fqn not in live]
        if missing:
            raise StaticrtError(f"{library} reads constants {missing[:3]} that this model and cache lack")
        supplied = {name: live[fqn] for name, fqn in names.items() if fqn in live}
        self._runner.update_constant_buffer(supplied, False, False, True)
        self.addresses = live_addresses(step)  # what the runner now points at

    def __call__(self, model: Decoder, cache: KVCache, *inputs: Any, bias: torch.Tensor, **_: Any) -> Any:
        # ids, write index, num new, temperature, top k, top p, uniform (none for a beam step)
        *given, uniform = inputs[:7]
        outputs = self._runner.run([*given, torch.zeros(len(given[0])) if uniform is None else uniform, bias])
        return tuple(outputs) if len(outputs) > 1 else outputs[0]  # a beam step's pair, log-probabilities


class GraphStore:
    """The `graphs/` folder of the user's cache, for one model and cache (a backend's)."""

    def __init__(self, model: Decoder, cache: KVCache) -> None:
        self.model, self.cache = model, cache
        self.root = cache_root() / "graphs"
        self._weights: tuple[list[tuple[int, int]], str] | None = None  # (stamps, digest) of the weights
        self._twin: tuple[list[tuple[int, int]], Decoder] | None = None  # (stamps, packed twin) of them
        self.loaded: dict[Key, Path] = {}  # graphs this process loaded from an entry rather than compiled

    def folder(self, step: StepModule) -> tuple[Path, dict[str, Any]]:
        """Where the graph of `step` is stored, and the fields that key it."""
        # Weights written in place or replaced since they were hashed are hashed again: a packed
        # graph built now reads the new ones and must not be found under the old ones' key.
        stamps = weight_stamps(self.model)
        if self._weights is None or self._weights[0] != stamps:
            self._weights = (stamps, weights_digest(self.model))
        fields = graph_fields(self.model, self._weights[1], self.cache, step.key) | {
            "packed": step.packed,
            "layers_once": step.layers_once,
        }
        text = json.dumps(fields, sort_keys=True)
        return self.root / hashlib.sha256(text.encode()).hexdigest()[:24], json.loads(text)  # as entry.json reads

    def graph(self, key: Key, packed: bool, layers_once: bool) -> StepModule:
        """The step of the graph `key` as the store traces it: `packed`, over the model's packed
        twin (one per set of weights, shared by every packed graph), else over the model."""
        if not packed:
            return StepModule(self.model, self.cache, key, False, layers_once)
        stamps = weight_stamps(self.model)
        if self._twin is None or self._twin[0] != stamps:
            self._twin = (stamps, pack(self.model, twin=True))  # a model packed in place is its own twin
        return StepModule(self._twin[1], self.cache, key, True, layers_once)

    def holds(self, step: StepModule) -> bool:
        return (self.folder(step)[0] / ENTRY).is_file()

    def load(self, step: StepModule) -> StoredStep:
        """The graph of `step`, loaded from its entry, or first compiled and stored."""
        folder, fields = self.folder(step)
        if (folder / ENTRY).is_file():
            try:
                stored = self._load(folder, fields, step)
                self.loaded[step.key] = folder
                return stored
            except (OSError, ValueError, RuntimeError, StaticrtError) as err:
                log.warning("the stored graph in %s is unusable (%s); compiling it again", folder, err)
        write_folder(folder, lambda work: self._build(work, fields, step))
        return StoredStep(folder / LIBRARY, step)

    def _load(self, folder: Path, fields: dict[str, Any], step: StepModule) -> StoredStep:
        recorded = json.loads((folder / ENTRY).read_text())
        if recorded.get("fields") != fields:
            raise ValueError("its entry.json records other fields than this graph's")
        if recorded.get("crc32") != _crc32(folder / LIBRARY):  # 4 GB/s: a torn or altered file, not an attack
            raise ValueError(f"{LIBRARY} does not check to what entry.json records")
        calls = folder / CALLS
        if recorded.get("calls_crc32") != (_crc32(calls) if calls.is_file() else None):
            raise ValueError(f"{CALLS} does not check to what entry.json records")
        return StoredStep(folder / LIBRARY, step)

    def _build(self, work: Path, fields: dict[str, Any], step: StepModule) -> None:
        from torch._inductor import aoti_compile_and_package

        width, batch = step.key[0], self.cache.spec.max_batch_size
        inputs = (
            torch.zeros(batch, width, dtype=torch.int64),  # input_ids [B, T]
            torch.zeros(batch, dtype=torch.int64),  # write_index [B]
            torch.ones(batch, dtype=torch.int64),  # num_new [B]
            torch.ones(batch),  # temperature [B]
            torch.ones(batch, dtype=torch.int64),  # top_k [B]
            torch.ones(batch),  # top_p [B]
            torch.zeros(batch),  # uniform [B]
            torch.zeros(batch, self.model.config.vocab_size),  # logit bias [B, V]
        )
        with torch.no_grad(), warnings.catch_warnings(), runtime_compiled_once():  # torch's LeafSpec notice
            warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated", category=FutureWarning)
            program = torch.export.export(step, inputs, strict=False)
            package = aoti_compile_and_package(program, inductor_configs=AOTI_OPTIONS, package_path=str(work / "p.pt2"))
        with zipfile.ZipFile(package) as archive:  # the library (and its custom-op calls) is the graph
            ((library, calls),) = aoti_libraries(archive)
            for name, kept in ((library, LIBRARY), (calls, CALLS)):
                if name is not None:
                    with archive.open(name) as source, open(work / kept, "wb") as target:
                        shutil.copyfileobj(source, target, 1 << 24)
        Path(package).unlink()
        calls_crc = _crc32(work / CALLS) if (work / CALLS).is_file() else None
        entry = {"fields": fields, "crc32": _crc32(work / LIBRARY), "calls_crc32": calls_crc, "written": time.time()}
        (work / ENTRY).write_text(json.dumps(entry, indent=1) + "\n")
