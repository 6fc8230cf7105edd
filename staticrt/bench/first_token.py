"""The child process of `bench --cold-start`: build one program, generate NEW_TOKENS greedy tokens
(so that a compiled program also builds or loads its decode graph), print when the first came,
the tokens, and the process's peak RSS.

`cold_start` runs this file by its path (`runpy.run_path`), not as `staticrt.bench.first_token`:
importing the package would run `staticrt/bench/__init__.py`, which imports torch, and a
torch-free program (an ONNX artifact, llama.cpp) would be charged torch's start-up and memory.
So every import here is absolute and inside the function that needs it.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Sequence

PROMPT = [1, 2, 3]  # token ids every vocabulary has
NEW_TOKENS = 8
STAMPS: list[float] = []  # time.time() of each token as it arrives


def _stamp(*_: object) -> None:
    STAMPS.append(time.time())


def _staticrt(mode: str, source: str, threads: int) -> list[int]:
    """`source`: the artifact's folder, or for eager and compiled the JSON of its recipe."""
    from staticrt.generation.generator import Generator, load_artifact

    if mode == "onnx":  # torch-free
        gen = load_artifact(source, backend=mode, threads=threads or None)
        return gen.generate([PROMPT], NEW_TOKENS, stream=_stamp)[0]
    import torch

    if threads:
        torch.set_num_threads(threads)
    if mode not in ("eager", "compiled"):
        return load_artifact(source, backend=mode).generate([PROMPT], NEW_TOKENS, stream=_stamp)[0]
    from staticrt.loading.checkpoint import load_model

    spec = json.loads(source)
    gen = Generator(  # the model loaded as `staticrt run` loads it for this backend
        load_model(spec["model"], dtype=spec["dtype"], packed=mode == "compiled"),
        cache=spec["cache"],
        max_batch_size=spec["batch_size"],
        max_cache_len=spec["max_cache_len"],
        window=spec["window"],
        backend=mode,
        prefill_buckets=spec["prefill_buckets"],
    )
    return gen.generate([PROMPT], NEW_TOKENS, stream=_stamp)[0]


def _transformers(folder: str, threads: int) -> list[int]:
    import torch
    import transformers

    if threads:
        torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        clock = type("Clock", (), {"put": _stamp, "end": lambda self: None})()  # put: the prompt, then each token
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, streamer=clock)
    del STAMPS[0]
    return out[0, len(PROMPT) :].tolist()


def _llamacpp(gguf: str, threads: int) -> list[int]:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(
        gguf, n_ctx=len(PROMPT) + NEW_TOKENS, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    tokens, step = [], PROMPT
    for _ in range(NEW_TOKENS):
        llm.eval(step)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        step = [int(np.argmax(logits))]
        tokens += step
        _stamp()
    return tokens


def main(argv: Sequence[str]) -> None:
    """argv: MODE SOURCE THREADS; MODE is eager, compiled, an artifact format, transformers or llamacpp."""
    mode, source, threads = argv[0], argv[1], int(argv[2])
    if mode == "transformers":
        tokens = _transformers(source, threads)
    elif mode == "llamacpp":
        tokens = _llamacpp(source, threads)
    else:
        tokens = _staticrt(mode, source, threads)
    peak_mb = _peak_rss_kib() * 1024 / 1e6
    print(json.dumps({"first_token_at": STAMPS[0], "exit_at": time.time(), "tokens": tokens, "peak_rss_mb": peak_mb}))


def _peak_rss_kib() -> int:
    """This program's peak RSS. Linux keeps `ru_maxrss` across exec, so a child forked from a
    bigger parent would report the parent's peak; VmHWM belongs to the exec'd image alone."""
    try:
        status = open("/proc/self/status").read()
    except OSError:  # no procfs: ru_maxrss (KiB on Linux and the BSDs)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))


if __name__ == "__main__":
    main(sys.argv[1:])
