"""cudagraph decode with each of its two speed choices on and off, side by side in one process on
one GPU: greedy decode launched a step ahead (`CudaGraphBackend.run_ahead`) and one row's
matrix-vector products as tuned reductions (`CudaGraphBackend.matvec_options`).

    python bench/cudagraph_ab.py OUT.json [--model bench-1b] [--batches 1,8] [--rounds 5] [--start-after FILE]

Rounds alternate the variants, so a drift of the machine falls on all of them. For each: decode
ms/token (the median step), the decode graph's GPU time a replay, the host's share (step minus
graph) and the weight + K/V bytes a step reads over the step time against a device-to-device copy.
Run by `bench/gpu.sh ab OUT`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import staticrt
from staticrt.backends.cudagraph import CudaGraphBackend
from staticrt.bench.probes import copy_bytes_per_s, kv_bytes_per_step, weight_bytes_per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--model", default="bench-1b")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--start-after",
        metavar="FILE",
        help="time nothing until FILE exists (at most an hour): the compiles and captures may overlap other work",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    model = staticrt.load_model(args.model, dtype=torch.bfloat16, device="cuda")
    gens, prompts = {}, {}  # (batch, kind) -> Generator; batch -> its prompts
    for batch in map(int, args.batches.split(",")):
        prompts[batch] = torch.randint(1, model.config.vocab_size, (batch, args.prompt_len)).tolist()
        gens[batch, "matvec"] = generator(model, batch, args)
        if batch == 1:  # the tuned reductions are taken for one row only
            gens[batch, "cublas"] = generator(model, batch, args, matvec=False)
    times: dict[tuple[int, str], list[float]] = {}
    tokens: dict[tuple[int, str], list[list[int]]] = {}
    for round_ in range(args.rounds + 1):  # the first round compiles and captures, and is not counted
        if round_ == 1 and args.start_after:
            wait_for(Path(args.start_after))
        for (batch, kind), gen in gens.items():
            for ahead in (True, False):
                gen.backend.run_ahead = ahead
                variant = (batch, f"{kind}-{'ahead' if ahead else 'in-turn'}")
                tokens[variant] = gen.generate(prompts[batch], args.new_tokens)
                if round_:
                    times.setdefault(variant, []).append(gen.last_stats.decode_ms_per_token)
    copy_bps = copy_bytes_per_s(torch.device("cuda"))
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bytes_per_s": copy_bps, "runs": []}
    graph_ms = {key: gen.backend.report()["graph_gpu_ms"] for key, gen in gens.items()}
    for (batch, variant), ms in times.items():
        read = weight_bytes_per_step(model, batch) + kv_bytes_per_step(
            model.config, batch, args.prompt_len + args.new_tokens, torch.bfloat16
        )
        step_ms, gpu_ms = statistics.median(ms), graph_ms[batch, variant.split("-")[0]]
        run = {
            "batch": batch,
            "variant": variant,
            "decode_ms_per_token": step_ms,
            "rounds_ms": ms,
            "graph_gpu_ms": gpu_ms,
            "host_overhead_us": 1000 * (step_ms - gpu_ms),
            "bytes_per_step": read,
            "bandwidth_fraction": read / (step_ms / 1000) / copy_bps,
            "graph_bandwidth_fraction": read / (gpu_ms / 1000) / copy_bps,
            # running ahead changes no token; cuBLAS's products may part from the reductions' in bf16
            "same_tokens_as_in_turn": tokens[batch, variant] == tokens[batch, variant.replace("ahead", "in-turn")],
        }
        report["runs"].append(run)
        print(
            f"batch {batch} {variant:18} {step_ms:7.3f} ms/token  graph {gpu_ms:.3f} ms  "
            f"host {run['host_overhead_us']:6.1f} us  {100 * run['bandwidth_fraction']:.1f}% of copy "
            f"(graph alone {100 * run['graph_bandwidth_fraction']:.1f}%)  "
            f"same tokens: {run['same_tokens_as_in_turn']}",
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


def wait_for(path: Path, limit_s: float = 3600) -> None:
    began = time.monotonic()
    while not path.exists():
        if time.monotonic() - began > limit_s:
            raise SystemExit(f"{path} did not appear within {limit_s:.0f} s")
        time.sleep(1)


def generator(model, batch: int, args: argparse.Namespace, matvec: bool = True) -> staticrt.Generator:
    """A cudagraph Generator of `batch` rows; `matvec` False compiles one row's decode with
    inductor's defaults (cuBLAS's matrix-vector products), as before `matvec_options`."""
    max_len = args.prompt_len + args.new_tokens + 16
    gen = staticrt.Generator(model, backend="cudagraph", max_batch_size=batch, max_cache_len=max_len)
    assert isinstance(gen.backend, CudaGraphBackend)
    if not matvec:
        gen.backend.matvec_options = CudaGraphBackend.compile_options
    return gen


if __name__ == "__main__":
    main()
