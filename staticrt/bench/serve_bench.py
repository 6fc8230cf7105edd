"""`staticrt bench-serve`: continuous batching measured against one request at a time.

The same requests (serve_load.py) go to `staticrt serve` and, where transformers is installed,
to `transformers serve --continuous-batching`, each a separate process on a loopback port,
started, measured and stopped in turn, so no two share the CPU; then the same requests run one at
a time through `Generator.generate` (batch 1, same backend and buckets) in this process, the
baseline continuous batching must beat.

The chat workload is serve_chat.py's.

A preset has no files, so it is first written as a checkpoint folder (config.json, safetensors)
with a word-level tokenizer whose words `t0 .. t{V-1}` are the token ids: every server reads the
same weights and turns the same text into the same ids.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import GenerationError
from .llama_server import llama_server_result
from .serve_load import LoadRequest, workload
from .server_process import measure_server

Stage = Callable[[str], None]


@dataclass(frozen=True)
class ServeBenchRequest:
    model: str
    backend: str = "compiled"
    max_batch_size: int = 8
    concurrency: int = 16
    requests: int = 64
    prompt_range: tuple[int, int] = (8, 96)
    output_range: tuple[int, int] = (16, 96)
    prefill_buckets: tuple[int, ...] = (32, 64, 128)
    threads: int | None = None
    duration_s: float = 600.0
    seed: int = 0
    transformers: bool = True
    stream_interval: int = 1  # staticrt serve's tokens a chunk after the first (transformers serve: 1)
    device: str = "cpu"  # every contender's model: cpu, cuda or cuda:N
    workload: str = "random"  # or "chat": `concurrency` clients, each a conversation of `turns` turns
    turns: int = 4
    system_len: int = 200  # the chat workload's shared system prompt, in tokens
    speculative: str | None = None  # also staticrt serve --speculative (the load's requests are greedy)
    replicas: int | None = None  # also staticrt serve --replicas N (Ray Serve), each replica the same rows
    structured: bool = False  # also staticrt serve with every request asking for a JSON object
    kill_every_s: float | None = None  # the soak with replicas: SIGKILL one this often (soak_replicas.py)
    quantize: str | None = None  # staticrt serve --quantize: the weight width of the GGUF it is compared with

    @property
    def max_cache_len(self) -> int:
        """Room for the longest prompt's bucket (chunks of the largest) and the longest answer. A
        conversation's last prompt holds the system prompt, every turn and every answer but the
        last, those re-tokenised from their text (a quarter more, to be safe)."""
        largest, answer = self.prefill_buckets[-1], self.output_range[1]
        if self.workload == "chat":
            prompt = self.system_len + self.turns * self.prompt_range[1] + (self.turns - 1) * answer * 5 // 4
            return max(-(-prompt // largest) * largest, prompt + answer)
        return -(-self.prompt_range[1] // largest) * largest + answer


def checkpoint_folder(model: str, work: Path) -> Path:
    """`model` itself when it is a folder, the folder a GGUF file converts into (once, cached), or
    a preset written as a checkpoint folder in `work`."""
    from ..models.presets import PRESETS

    if model.endswith(".gguf"):
        from ..loading.gguf_folders import local_checkpoint

        return Path(local_checkpoint(model))
    if model not in PRESETS:
        if not (Path(model) / "tokenizer.json").is_file():
            raise GenerationError(f"{model} has no tokenizer.json; bench-serve sends text prompts, as users do")
        return Path(model)
    try:
        import transformers
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise GenerationError(
            "bench-serve writes a preset as a checkpoint with transformers: pip install 'staticrt[hf]'"
        ) from None
    from ..loading.checkpoint import load_model
    from .hf import hf_model_like

    folder = work / model
    hf = hf_model_like(load_model(model))
    hf.generation_config.eos_token_id = None  # random weights: every answer runs to max_tokens
    hf.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(hf.config.vocab_size)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece()  # joins the words with spaces
    transformers.PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(folder)
    return folder


def staticrt_command(folder: Path, request: ServeBenchRequest) -> list[str]:
    command = [sys.executable, "-m", "staticrt.cli", "serve", "--model", str(folder), "--backend", request.backend]
    command += ["--device", request.device]
    command += ["--max-batch-size", str(request.max_batch_size), "--max-cache-len", str(request.max_cache_len)]
    command += ["--prefill-buckets", ",".join(map(str, request.prefill_buckets)), "--served-model-name", "bench"]
    command += ["--max-queue", str(request.requests), "--stream-interval", str(request.stream_interval)]
    command += ["--quantize", request.quantize] if request.quantize not in (None, "none") else []
    return command + (["--threads", str(request.threads)] if request.threads else [])


CB_BLOCK = 32  # transformers serve's paged-cache block, in tokens


def transformers_command(folder: Path, request: ServeBenchRequest) -> list[str]:
    """transformers serve with continuous batching, its paged cache holding every client's longest
    request at once (`concurrency` x `max_cache_len` tokens, more than staticrt's rows). Left to size
    itself it took most of the free memory, and zeroing that made the first request take 43 s
    (tiny-llama, 2-core VM; the same 0.9-1.0k tok/s after)."""
    serve = "from transformers.cli.transformers import main; import sys; sys.argv[0] = 'transformers'; main()"
    blocks = -(-request.concurrency * request.max_cache_len // CB_BLOCK)
    command = [sys.executable, "-c", serve, "serve", str(folder), "--continuous-batching", "--device", request.device]
    return command + ["--cb-block-size", str(CB_BLOCK), "--cb-num-blocks", str(blocks)]


def one_at_a_time(folder: Path, request: ServeBenchRequest, load: list[LoadRequest]) -> dict[str, Any]:
    """The requests one after another through a batch-1 Generator (graphs built before timing)."""
    import torch

    from ..generation.generator import Generator
    from ..loading.checkpoint import load_model

    if request.threads:
        torch.set_num_threads(request.threads)
    model = load_model(folder, device=request.device, quantize=request.quantize)
    longest = request.max_cache_len - request.output_range[1]  # a generate prefills in one step, unchunked
    gen = Generator(
        model,
        max_batch_size=1,
        max_cache_len=request.max_cache_len,
        backend=request.backend,
        prefill_buckets=sorted({*request.prefill_buckets, longest}),
    )
    gen.backend.prepare((*gen.backend.buckets, 1), False)
    tokens, start = 0, time.perf_counter()
    for item in load:
        prompt = model.tokenizer.encode(item.prompt)
        out = gen.generate([prompt], item.max_tokens, stop_token_ids=gen.backend.eos_token_ids)
        tokens += len(out[0])
    wall = time.perf_counter() - start
    return {"requests": len(load), "wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall}


def run_serve_bench(request: ServeBenchRequest, on_stage: Stage = lambda _: None) -> dict[str, Any]:
    """The report: each server's load summary, the baseline, and their ratios."""
    from .machine import machine

    with tempfile.TemporaryDirectory(prefix="staticrt-bench-serve-") as work:
        on_stage(f"writing {request.model} as a checkpoint folder")
        folder = checkpoint_folder(request.model, Path(work))
        from ..text.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(folder)
        vocab = tokenizer.backend.get_vocab_size()
        load = workload(tokenizer, vocab, request.requests, request.prompt_range, request.output_range, request.seed)
        results: dict[str, Any] = {}
        on_stage(f"staticrt serve ({request.backend}; starting, compiling, then {len(load)} requests)")
        results["staticrt"] = measure_server(staticrt_command(folder, request), "bench", request, load)
        if request.speculative:
            on_stage(f"staticrt serve --speculative {request.speculative} ({len(load)} requests)")
            command = [*staticrt_command(folder, request), "--speculative", request.speculative]
            results["staticrt_speculative"] = measure_server(command, "bench", request, load)
        if request.replicas:
            on_stage(f"staticrt serve --replicas {request.replicas} on a local Ray instance ({len(load)} requests)")
            command = [*staticrt_command(folder, request), "--replicas", str(request.replicas)]
            command += ["--replica-cpus", str(request.threads or 1)]
            results["staticrt_ray"] = measure_server(command, "bench", request, load)
        if request.structured:
            on_stage(f"staticrt serve, every request on a JSON schema ({len(load)} requests)")
            json_load = [replace(r, response_format=digits_format(r.max_tokens)) for r in load]
            results["staticrt_json"] = measure_server(staticrt_command(folder, request), "bench", request, json_load)
            from ..loading.checkpoint import load_config

            structured = mask_cost(tokenizer, vocab, load_config(folder).eos_token_ids or (0,)) | {
                "throughput_json_over_plain": results["staticrt_json"]["output_tokens_per_s"]
                / results["staticrt"]["output_tokens_per_s"]
            }
        if request.transformers:
            on_stage(f"transformers serve --continuous-batching ({len(load)} requests)")
            try:
                results["transformers"] = measure_server(
                    transformers_command(folder, request), str(folder), request, load
                )
            except GenerationError as err:
                results["transformers"] = {"error": str(err)}
        if request.model.endswith(".gguf"):
            results["llama_server"] = llama_server_result(request, load, on_stage)
        on_stage(f"one request at a time through Generator.generate ({len(load)} requests)")
        results["one_at_a_time"] = one_at_a_time(folder, request, load)
    rates = {k: v.get("output_tokens_per_s") for k, v in results.items()}
    ratios = {
        f"staticrt_vs_{k}": rates["staticrt"] / rate
        for k, rate in rates.items()
        if not k.startswith("staticrt") and rate  # staticrt's other runs have their own ratios
    }
    settings = {**request.__dict__, "max_cache_len": request.max_cache_len}
    report = {"settings": settings, "machine": machine(), "results": results, "throughput_ratios": ratios}
    report |= {"structured": structured} if request.structured else {}
    return {**report, **speculative_ratios(results), **ray_ratios(results)}


def speculative_ratios(results: dict[str, Any]) -> dict[str, Any]:
    """With a speculative run beside the plain one: its throughput and TPOT p50 against plain's."""
    on, off = results.get("staticrt_speculative"), results["staticrt"]
    if on is None:
        return {}
    tpot_on, tpot_off = on["tpot"]["p50_ms"], off["tpot"]["p50_ms"]
    return {
        "speculative_ratios": {
            "throughput_speculative_over_plain": on["output_tokens_per_s"] / off["output_tokens_per_s"],
            "tpot_p50_plain_over_speculative": tpot_off / tpot_on if tpot_on and tpot_off else None,
        }
    }


def ray_ratios(results: dict[str, Any]) -> dict[str, Any]:
    """With replicas on Ray beside the plain server: what Ray adds to TTFT and takes from throughput."""
    on, off = results.get("staticrt_ray"), results["staticrt"]
    if on is None:
        return {}
    return {
        "ray_ratios": {
            "throughput_ray_over_plain": on["output_tokens_per_s"] / off["output_tokens_per_s"],
            "ttft_p50_ms_added_by_ray": on["ttft"]["p50_ms"] - off["ttft"]["p50_ms"],
        }
    }


def digits_format(max_tokens: int) -> dict[str, Any]:
    """A json_schema response_format that keeps a reply going to its max_tokens: an array of at
    least that many digits, so each request streams as many tokens as its plain twin, and every
    token of it comes through the mask."""
    digits = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": max_tokens}
    return {"type": "json_schema", "json_schema": {"name": "digits", "schema": digits}}


def mask_cost(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], repeats: int = 5) -> dict[str, float]:
    """llguidance's time a token a row, in this process: the allowed-token mask computed and
    written into a bias row (what the server does before each step of a row under a schema),
    then the token consumed, over the tokens of a few JSON documents. The documents are laid out
    as the grammar lays them out (json.dumps)."""
    import json

    import numpy as np

    from ..generation.grammar import Grammar

    documents = [
        {"city": "Paris", "country": "France", "population": 2102650, "tags": ["capital", "river", "museums"]},
        {"name": "Ada Lovelace", "born": 1815, "fields": {"math": True, "poetry": False}, "notes": "first program"},
    ]
    grammar = Grammar(tokenizer, {"type": "object"}, vocab_size, eos_token_ids)
    row = np.zeros(vocab_size, dtype=np.float32)
    spent, count = 0.0, 0
    for _ in range(repeats):
        for document in documents:
            matcher = grammar.matcher()
            for token in tokenizer.encode(json.dumps(document), add_special_tokens=False):
                start = time.perf_counter()
                matcher.forbid(row)
                matcher.consume(token)
                spent, count = spent + time.perf_counter() - start, count + 1
    return {"mask_us_per_token_per_row": 1e6 * spent / count, "mask_tokens_timed": count}
