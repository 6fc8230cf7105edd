"""What a benchmark will run, decided before anything is loaded: the request, checked, and the
list of runs (label, backend, cache, prompts) it expands to."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..artifacts.manifest import FORMATS
from ..errors import BenchError
from ..models.quant_spec import parse_quantize

QUANTO_CACHE = "quanto-int4"  # transformers' QuantizedCache (bench/hf.py)
GGUF_TYPES = ("F32", "Q8_0", "Q4_0", "Q4_1")  # `--gguf` names that write the model as a GGUF (gguf_write.py)
FLOAT_ONLY = ("hf",)  # transformers runs the float weights only
GRAPH_QUANTIZED = ("onnx",)  # exported from the float weights, the graph quantizes its own (onnx_quantize.py)

# The defaults of `staticrt bench` and `run_bench`: a short prompt and enough tokens that the
# median decode step is stable.
NEW_TOKENS, PROMPT_LEN, REPEATS = 64, 32, 5


@dataclass(frozen=True)
class BenchRequest:
    """A benchmark as asked for. With `window`, every layer gets that sliding window; with
    `offload` (`kv_int8`), each staticrt backend also runs with an OffloadedStatic (static-int8)
    cache, and with `kv_int8` transformers also with its QuantizedCache. Each of `quantize`
    ("none", "int8", "int4-g64", ...) is a variant of the weights that every staticrt backend runs
    beside the others (ONNX Runtime with ONNX Runtime's own quantization of the float weights);
    transformers runs the float weights only."""

    model: str
    backends: tuple[str, ...]
    new_tokens: int = NEW_TOKENS
    prompt_len: int = PROMPT_LEN
    batch_size: int = 1
    repeats: int = REPEATS
    threads: int | None = None
    dtype: str = "float32"
    window: int | None = None
    offload: bool = False
    kv_int8: bool = False
    device: str | None = None
    quantize: tuple[str, ...] = ("none",)
    gguf: tuple[str, ...] = ()

    def check(self) -> None:
        """Refuse a combination that cannot run, naming the option, before anything is loaded."""
        for name in self.quantize:
            parse_quantize(name)
        if self.gguf and (self.batch_size != 1 or self.window is not None or self.offload):
            raise BenchError(
                "--gguf runs llama.cpp at batch 1 on its own cache; drop --batch-size, --window, --offload"
            )
        missing = [path for path in self.gguf if path not in GGUF_TYPES and not Path(path).is_file()]
        if missing:
            raise BenchError(
                f"--gguf {', '.join(missing)}: no such file (or name a type, {', '.join(GGUF_TYPES)}, to write "
                "the bench's model as a GGUF of it)"
            )
        if self.quantize and all(name in FLOAT_ONLY for name in self.backends) and "none" not in self.quantize:
            raise BenchError(
                f"--quantize {','.join(self.quantize)}: backends {', '.join(self.backends)} run the float weights "
                "only; add a staticrt backend (eager, compiled, cudagraph, aoti, pt2, onnx) or none to --quantize"
            )
        if self.window is not None and (self.offload or self.kv_int8):
            raise BenchError("--window and --offload/--kv-int8 compare different things; run them one at a time")
        if self.kv_int8 and "hf" in self.backends and importlib.util.find_spec("optimum.quanto") is None:
            raise BenchError(
                "--kv-int8 with hf also times transformers' QuantizedCache, which needs optimum-quanto: "
                "pip install 'staticrt[kvquant]', or drop hf from --backends"
            )
        exported = [b for b in self.backends if b in FORMATS]
        if self.offload and exported:
            raise BenchError(
                f"offloaded caches do not export, so --offload cannot run the {exported[0]} backend; drop "
                f"{exported[0]} from --backends"
            )
        if self.window is not None and self.prompt_len < self.window:
            raise BenchError(
                f"prompt_len {self.prompt_len} is shorter than window {self.window}; the sliding benchmark decodes "
                f"past the window, so use --prompt-len {self.window} or more"
            )
        if self.window is not None and self.new_tokens >= self.window:
            raise BenchError(
                f"new_tokens {self.new_tokens} must be below window {self.window}: the Static run holds the window; "
                "ask for fewer --new-tokens"
            )


@dataclass(frozen=True)
class Run:
    """One timed contender: `backend` with a `cache` on `prompts`; `attended` is the positions a
    decode step attends to (what its K/V bytes are counted on)."""

    label: str
    backend: str
    cache: str
    prompts: list[list[int]]
    attended: int
    max_cache_len: int | None = None
    quantize: str = "none"
    gguf: str | None = None  # the file llama.cpp runs (backend "llamacpp")

    @property
    def weights(self) -> str:
        """The quantize variant of the loaded model this run takes: the float one for transformers
        and for ONNX Runtime, whose exported graph quantizes the float weights itself."""
        return "none" if self.backend in FLOAT_ONLY + GRAPH_QUANTIZED else self.quantize


def bench_prompts(vocab: int, batch_size: int, prompt_len: int) -> list[list[int]]:
    """The same seeded random prompts for every contender."""
    rng = np.random.default_rng(0)
    return [rng.integers(1, vocab, size=prompt_len).tolist() for _ in range(batch_size)]


def gguf_label(path: str | Path) -> str:
    """`llamacpp-Q4_1` for `model.Q4_1.gguf` (and for the type `Q4_1`): the contender's name in the report."""
    stem = Path(path).stem
    return f"llamacpp-{stem.rsplit('.', 1)[-1] if '.' in stem else stem}"


def plan_runs(request: BenchRequest, prompts: list[list[int]]) -> list[Run]:
    """Every backend once on a Static cache; with `window`, each staticrt backend twice, with a
    SlidingWindow cache past the window ("NAME-sliding") and a Static cache of `window` positions
    ("NAME-static": the same attended length, so the only difference is the rotating buffer),
    and "hf" with transformers' sliding-window cache; with `offload`, each staticrt backend with
    a Static ("NAME-static") and an OffloadedStatic ("NAME-offloaded") cache; with `kv_int8`, also
    with a static-int8 cache ("NAME-kvint8"), and "hf" also with transformers' QuantizedCache
    ("hf-kvquanto", optimum-quanto int4: quanto has no int8). A quantized variant
    of the weights is a backend of its own, "NAME-int8", run with the same caches; each GGUF file
    (or GGUF type, written from the model: gguf_write.py) a llama.cpp run, "llamacpp-Q4_1"."""
    runs = _float_runs(request, prompts)
    quantized = [
        dataclasses.replace(run, label=f"{run.backend}-{quantize}{run.label[len(run.backend) :]}", quantize=quantize)
        for quantize in request.quantize
        for run in runs
        if quantize != "none" and run.backend not in FLOAT_ONLY
    ]
    llamacpp = [
        Run(gguf_label(path), "llamacpp", "static", prompts, request.prompt_len + request.new_tokens, gguf=path)
        for path in request.gguf
    ]
    return [run for run in runs if "none" in request.quantize or run.backend in FLOAT_ONLY] + quantized + llamacpp


def _float_runs(request: BenchRequest, prompts: list[list[int]]) -> list[Run]:
    full = request.prompt_len + request.new_tokens
    runs = []
    for name in request.backends:
        static = Run(name, name, "static", prompts, full)
        variants = [("offloaded", "offloaded")] * request.offload + [("kvint8", "static-int8")] * request.kv_int8
        if request.window is None and variants and name != "hf":
            runs.append(dataclasses.replace(static, label=f"{name}-static"))
            runs += [dataclasses.replace(static, label=f"{name}-{tag}", cache=cache) for tag, cache in variants]
        elif request.window is None:
            runs.append(static)
            if request.kv_int8:  # name is "hf"
                runs.append(dataclasses.replace(static, label="hf-kvquanto", cache=QUANTO_CACHE))
        elif name == "hf":
            runs.append(Run(name, name, "sliding", prompts, request.window))
        else:
            short = [p[: request.window - request.new_tokens] for p in prompts]
            runs += [
                Run(f"{name}-sliding", name, "sliding", prompts, request.window, request.prompt_len),
                Run(f"{name}-static", name, "static", short, request.window, request.window),
            ]
    return runs
