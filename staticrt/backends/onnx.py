"""ONNX Runtime backend: runs an artifact's ONNX graph through the one generation loop, with
onnxruntime and NumPy alone (no torch, no model code).

Each cache tensor is allocated once as an OrtValue on the session's device (on the CPU, pages of
one anonymous mapping, resident only where written: zeroed_pages.py) and bound, with IOBinding, as
both `past_key_values.{i}.*` and `present.{i}.*`, so every step's TensorScatter writes it in place.
Rows are laid out as the graph expects (exporters/onnx_export.py): a prompt is placed at the right
end of a prefill of `max(prompt lengths)` columns (holes on the left, masked), and each decode step
adds one column. For caches with a linear layer the mask keeps one width, the cache length, with
zeros after the last column, so decode runs one shape every step (what ONNX Runtime's CUDA graphs
need); an all-rotating cache has no length, and its mask grows.
Tokens are chosen on the host (host_sampling.py) from the logits of the step's last column; a
verify step (speculative decoding, an artifact of one row) asks the graph for every column's
(`logits_index`, read from `indexed_logits`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..artifacts.manifest import INDEXED_LOGITS, LOGITS_INDEX, REEXPORT
from ..errors import ArtifactError, check_positions
from ..generation.host_sampling import choose, verify
from ..generation.params import SamplingParams
from .artifact_base import ArtifactBackend
from .onnx_session import has_cuda_device, session
from .zeroed_pages import ZeroedPages


class OnnxBackend(ArtifactBackend):
    """A `StepBackend` over the ONNX graph of an artifact folder written by `staticrt export --format onnx`."""

    name = "onnx"
    row_positions = False  # genai's cache layout: each step writes one column of every row

    def __init__(
        self,
        folder: str | Path,
        format: str = "onnx",
        manifest: dict[str, Any] | None = None,
        device: str | None = None,
        threads: int | None = None,
        verified: Callable[[], Any] = lambda: None,
    ) -> None:
        import onnxruntime as ort

        super().__init__(folder, format, manifest)
        folder, manifest = self.folder, self.manifest
        section = manifest["onnx"]
        available = ort.get_available_providers()
        device = device or ("cuda" if "CUDAExecutionProvider" in available and has_cuda_device() else "cpu")
        if device not in ("cpu", "cuda"):
            raise ArtifactError(f"device {device!r} is unknown to the onnx backend; use cpu or cuda")
        if device == "cuda" and "CUDAExecutionProvider" not in available:
            raise ArtifactError(
                f"device 'cuda' asked, but the installed onnxruntime {ort.__version__} runs only on "
                f"{', '.join(available)}: install onnxruntime-gpu in place of onnxruntime (pip uninstall onnxruntime; "
                "pip install onnxruntime-gpu), or run the artifact on the CPU"
            )
        # A CUDA graph needs one decode shape; an all-rotating cache's mask grows, so it runs without.
        graphs = device == "cuda" and manifest["cache"]["max_sequence_len"] is not None
        graph = folder / section["graph"]
        self.session, self.cuda_graphs = session(graph, threads, device, graphs, manifest, verified)
        self.device = device
        self._check_graph(graph, section)
        # Whether the graph returns logits at the columns a step asks for (`indexed_logits`).
        self.indexed = LOGITS_INDEX in {value.name for value in self.session.get_overridable_initializers()} and any(
            value.name == INDEXED_LOGITS for value in self.session.get_outputs()
        )
        # The graph takes any prompt width; the loop's padding is stripped in `_step_inputs`.
        self.buckets = (self.max_sequence_len or manifest["model"]["config"]["max_position_embeddings"],)
        self.binding = self.session.io_binding()
        self._bind_caches(section["inputs"])
        self.logits_dtype = np.dtype(next(spec["dtype"] for spec in section["outputs"] if spec["name"] == "logits"))
        self.logits: dict[tuple[int, bool], Any] = {}  # the logits' buffers [B, columns, V] (`_logits`)
        if self.indexed:  # `logits` too is bound, to a buffer of its own: a CUDA graph replays bound outputs only
            self.binding.bind_ortvalue_output("logits", self._logits(1, own=True))
        self.mask = np.zeros((self.batch_size, self.max_sequence_len or 0), dtype=np.int64)  # [B, width]
        self.columns = 0  # columns written so far (the same for every row)
        self.device_inputs: dict[tuple[str, tuple[int, ...]], Any] = {}
        self.run_options = {1: ort.RunOptions(), 0: ort.RunOptions()}
        for options in self.run_options.values():
            options.log_severity_level = 2  # warnings, as the session's default would
        if self.cuda_graphs:  # decode replays one captured graph; prefill never
            self.run_options[1].add_run_config_entry("gpu_graph_id", "1")
            self.run_options[0].add_run_config_entry("gpu_graph_id", "-1")

    def _bind_caches(self, inputs: list[dict[str, Any]]) -> None:
        """One buffer for each `past_key_values.*` input, bound as it and as its `present.*`
        output: every step's write lands in it, in place."""
        import onnxruntime as ort

        self.caches: dict[str, Any] = {}  # past input name -> its OrtValue [B, H_kv, N_i, D]
        past = [spec for spec in inputs if spec["name"].startswith("past_key_values.")]
        shapes = [([self.batch_size, *spec["shape"][1:]], spec["dtype"]) for spec in past]
        # On the CPU the buffers are pages of one mapping, resident only where a step has written
        self.host = ZeroedPages(shapes) if self.device == "cpu" else None
        for i, (spec, (shape, dtype)) in enumerate(zip(past, shapes, strict=True)):
            if self.host is not None:
                value = ort.OrtValue.ortvalue_from_numpy(self.host.arrays[i], self.device, 0)
            else:
                value = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.dtype(dtype), self.device, 0)
            self.caches[spec["name"]] = value
            self.binding.bind_ortvalue_input(spec["name"], value)
            self.binding.bind_ortvalue_output(spec["name"].replace("past_key_values.", "present."), value)

    def report(self) -> dict[str, Any]:
        """Where the graph ran and whether its decode replayed a captured CUDA graph: the speed of
        ONNX Runtime on CUDA hangs on it (its warning, OnnxCudaGraphWarning, says why not)."""
        return {"device": self.device, "cuda_graph": self.cuda_graphs}

    @property
    def verify_refusal(self) -> str | None:
        """Why this runner cannot check drafts (speculative.check_verifies), or None where it can."""
        if not self.indexed:
            return (
                f"{self.folder}'s graph returns the last column's logits only (exported by an earlier staticrt): "
                f"{REEXPORT} to speculate on it"
            )
        if self.batch_size > 1:
            return (
                f"the onnx backend checks drafts in one row, and {self.folder} holds {self.batch_size}: its graph "
                "writes a column of every row at once, so rows keeping different numbers of drafts would leave "
                "holes; re-export it with --batch-size 1 to speculate, or drop --speculative"
            )
        return None

    def _check_graph(self, path: Path, section: dict[str, Any]) -> None:
        """The vocabulary and every cache input's shape come from the graph ONNX Runtime loaded;
        the manifest's copies must agree (its `past` shapes size the buffers bound below)."""
        graph = {value.name: value.shape for value in self.session.get_inputs() + self.session.get_outputs()}
        self.check_loaded("vocab_size", self.vocab_size, graph.get("logits", [None])[-1], path)
        for spec in section["inputs"]:
            if str(spec.get("name", "")).startswith("past_key_values."):
                held = graph.get(spec["name"], [])[1:]
                self.check_loaded(f"the shape of {spec['name']}", spec["shape"][1:], held, path)

    def reset(self) -> None:
        if self.host is not None:
            self.host.zero()
        else:
            for value in self.caches.values():
                value.update_inplace(np.zeros(value.shape(), dtype=np.dtype(self.manifest["dtype"])))
        self.mask[:] = 0
        self.columns = 0

    def _grow_mask(self, width: int) -> None:
        """An all-rotating cache's mask grows (doubling), since its rows never run out of positions."""
        if width > self.mask.shape[1]:
            grown = np.zeros((self.batch_size, max(width, 2 * self.mask.shape[1])), dtype=np.int64)
            grown[:, : self.mask.shape[1]] = self.mask
            self.mask = grown

    def _step_inputs(
        self, input_ids: np.ndarray, write_index: np.ndarray, num_new: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`input_ids [B, S]`, `attention_mask [B, T]`, `position_ids [B, S]` in the graph's layout:
        a first step places each row's `num_new` tokens at the right end of `max(num_new)` columns;
        a later one adds `num_new` columns (the loop's padding stripped)."""
        batch = self.batch_size
        if self.columns == 0:
            seq_len = int(num_new.max())
            ids = np.zeros((batch, seq_len), dtype=np.int64)
            positions = np.zeros((batch, seq_len), dtype=np.int64)
            self._grow_mask(seq_len)
            for r in range(batch):
                # a row with nothing to prefill (a server's free row) still marks its last column,
                # so the graph's write index (last marked column - S) stays 0, never negative
                n = max(int(num_new[r]), 1)
                ids[r, seq_len - n :] = input_ids[r, :n]
                positions[r, seq_len - n :] = write_index[r] + np.arange(n)
                self.mask[r, seq_len - n : seq_len] = 1
        else:  # one real token a row at the next column, or (batch 1) a row continued from a kept prefix
            if batch == 1:  # one row without holes: its columns are its positions; a kept prefix ends at write_index
                self.columns = int(write_index[0])
                self.mask[:, self.columns :] = 0
            seq_len = int(num_new.max())
            ids, positions = input_ids[:, :seq_len], write_index[:, None] + np.arange(seq_len)
            self._grow_mask(self.columns + seq_len)
            self.mask[:, self.columns : self.columns + seq_len] = 1
        self.columns += seq_len
        width = self.mask.shape[1] if self.max_sequence_len else self.columns
        return ids, self.mask[:, :width], positions

    def _device_input(self, name: str, value: np.ndarray) -> Any:
        """A device OrtValue holding `value`. Decode's inputs (one column, the fixed-width mask,
        logits_index [-1]) are kept, one per shape, so every decode step reads the same addresses,
        as a CUDA graph replay must; a prefill's (any width) are made for the step."""
        import onnxruntime as ort

        key = (name, value.shape)
        if value.shape[-1] != 1 and name != "attention_mask":
            return ort.OrtValue.ortvalue_from_numpy(value, self.device, 0)
        if key not in self.device_inputs:
            self.device_inputs[key] = ort.OrtValue.ortvalue_from_numpy(value, self.device, 0)
        else:
            self.device_inputs[key].update_inplace(value)
        return self.device_inputs[key]

    def step(
        self,
        input_ids: np.ndarray,
        write_index: np.ndarray,
        num_new: np.ndarray,
        sampling: SamplingParams,
        uniforms: np.ndarray | None,
    ) -> np.ndarray:
        logits = self._run(input_ids, write_index, num_new, every_column=False)  # [B, 1, V]
        return choose(logits[:, -1], sampling, uniforms)

    def verify_step(
        self,
        input_ids: np.ndarray,
        write_index: np.ndarray,
        num_new: np.ndarray,
        sampling: SamplingParams | None = None,
        uniforms: np.ndarray | None = None,
    ) -> np.ndarray:
        """A step that checks drafted tokens (speculative.py), one row: it feeds
        `input_ids[0, :num_new[0]]` (its next token, then its draft) and gets the token after each
        position, `[1, T]` int64, greedy or with `uniforms [1, T, 2]` by speculative sampling's rule.
        The row's columns are its positions, so the next step overwrites what a rejected draft wrote."""
        assert self.batch_size == 1, "check_verifies refuses the onnx backend's verify past one row"
        logits = self._run(input_ids, write_index, num_new, every_column=True)  # [1, S, V], S = num_new[0]
        fed = logits.shape[1]
        uniforms = None if uniforms is None else uniforms[:, :fed]
        chosen = np.zeros(input_ids.shape, dtype=np.int64)  # [1, T]: the loop's right padding answers 0
        chosen[:, :fed] = verify(logits, input_ids[:, :fed], num_new, sampling or SamplingParams(), uniforms)
        return chosen

    def _run(self, input_ids: np.ndarray, write_index: np.ndarray, num_new: np.ndarray, every_column: bool) -> Any:
        """Run the graph: logits `[B, 1, V]` at the step's last column, or `[B, S, V]` at every one
        (`every_column`); the step's one device-to-host read."""
        way_out = self.remedy("max_cache_len")
        check_positions(write_index, int(num_new.max()), self.max_sequence_len, self.cache_kind, way_out=way_out)
        ids, mask, positions = self._step_inputs(input_ids, write_index, num_new)
        seq_len = ids.shape[1] if every_column else 1
        inputs = [("input_ids", ids), ("attention_mask", mask), ("position_ids", positions)]
        if self.indexed:  # a graph exported before the input returns the last column's alone
            inputs.append((LOGITS_INDEX, np.arange(-seq_len, 0, dtype=np.int64)))  # [L]: the last L columns
        for name, value in inputs:
            value = np.ascontiguousarray(value)
            if self.device == "cpu" and name != LOGITS_INDEX:  # an overridable initializer binds as an OrtValue
                self.binding.bind_cpu_input(name, value)
            else:
                self.binding.bind_ortvalue_input(name, self._device_input(name, value))
        self.binding.bind_ortvalue_output(INDEXED_LOGITS if self.indexed else "logits", self._logits(seq_len))
        self.session.run_with_iobinding(self.binding, self.run_options[int(ids.shape[1] == 1)])
        return self._logits(seq_len).numpy()

    def _logits(self, columns: int, own: bool = False) -> Any:
        """The output buffer of logits at `columns` columns a row, `[B, columns, V]`, one per width
        (and with `own` one more, for an output that has none of its own)."""
        import onnxruntime as ort

        key = (columns, own)
        if key not in self.logits:
            shape = [self.batch_size, columns, self.vocab_size]
            self.logits[key] = ort.OrtValue.ortvalue_from_shape_and_type(shape, self.logits_dtype, self.device, 0)
        return self.logits[key]
