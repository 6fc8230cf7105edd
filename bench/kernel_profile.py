"""Where a decode step's time goes, kernel by kernel: torch's profiler over two generations that
differ only in their number of new tokens, so the prefill, the first step and the host loop's
fixed costs cancel and what remains, divided by the extra steps, is one decode step's kernels.

    python bench/kernel_profile.py OUT.json [--model bench-1b] [--backend cudagraph] [--batch 1]

For each kernel: its time and launches a step; then the kernels grouped (matrix products,
attention, norms, rotary, elementwise, copies, the token choice), the sum of kernel time against
the step's wall time (the gaps between kernels are the rest), and the bytes a step must read
(weights + K/V) over the kernel time of the products, against a device-to-device copy: which
kernels keep the step from the copy rate. Run by `bench/gpu.sh profile OUT`; on the CPU
(`--device cpu`) it lists operators instead of kernels, to try it without a GPU.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import staticrt
from staticrt.bench.probes import copy_bytes_per_s, kv_bytes_per_step, weight_bytes_per_step

# kernel name pattern -> group, first match wins (inductor names its Triton kernels for their ops)
GROUPS = [
    (r"gemv|gemm|matmul|mm_|_mm|cutlass|sm90_xmma|splitK|ampere_|nvjet|addmm", "matrix products"),
    (r"flash|attention|sdpa|softmax|fmha", "attention"),
    (r"rsqrt|norm|mean", "norms"),
    (r"sin|cos|rope|rotary", "rotary"),
    (r"argmax|sort|topk|cumsum|max_|choice", "token choice"),
    (r"copy|memcpy|memset|index_put|scatter|cat", "copies and cache writes"),
]


def group_of(name: str) -> str:
    lowered = name.lower()
    return next((group for pattern, group in GROUPS if re.search(pattern, lowered)), "elementwise and other")


def kernel_times(gen: staticrt.Generator, prompts: list[list[int]], new_tokens: int, device: str) -> dict:
    """name -> (total microseconds, launches) of one generation, profiled."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        gen.generate(prompts, new_tokens)
        if device == "cuda":
            torch.cuda.synchronize()
    times: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        if (device == "cuda") != on_device or (device == "cpu" and event.cpu_parent is not None):
            continue  # the device's kernels; on the CPU, top-level operators
        entry = times[event.name]
        entry[0] += event.device_time if on_device else event.cpu_time
        entry[1] += 1
    return times


def per_step(few: dict, many: dict, steps: int) -> dict[str, tuple[float, float]]:
    """Each kernel's microseconds and launches a decode step: the longer generation's less the
    shorter's, over the steps between them; slowest first, kernels of the fixed part dropped."""
    difference = {}
    for name, (us, launches) in many.items():
        us_before, launches_before = few.get(name, (0.0, 0))
        difference[name] = ((us - us_before) / steps, (launches - launches_before) / steps)
    return {name: v for name, v in sorted(difference.items(), key=lambda kv: -kv[1][0]) if v[1] > 0}


def report_of(args: argparse.Namespace, step_ms: float, kernels: dict, read: int) -> dict:
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, (us, launches) in kernels.items():
        groups[group_of(name)][0] += us
        groups[group_of(name)][1] += launches
    kernel_us = sum(us for us, _ in kernels.values())
    cuda = args.device == "cuda"
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "settings": {**vars(args), "out": str(args.out)},
        "decode_ms_per_token": step_ms,
        "kernel_us_per_step": kernel_us,
        "gaps_us_per_step": 1000 * step_ms - kernel_us,
        "bytes_per_step": read,
        "copy_bytes_per_s": copy_bytes_per_s(torch.device("cuda")) if cuda else None,
        "groups": {g: {"us": us, "launches": n} for g, (us, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])},
        "kernels": [{"name": k, "us": us, "launches": n, "group": group_of(k)} for k, (us, n) in kernels.items()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="bench-1b")
    parser.add_argument("--backend", default="cudagraph")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=64, help="decode steps between the two generations")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = staticrt.load_model(args.model, dtype=dtype, device=args.device)
    short, long = 8, 8 + args.steps
    max_len = args.prompt_len + long + 16
    gen = staticrt.Generator(model, backend=args.backend, max_batch_size=args.batch, max_cache_len=max_len)
    prompts = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt_len)).tolist()
    gen.generate(prompts, long)  # compiles and captures
    step_ms = []
    for _ in range(3):
        gen.generate(prompts, long)
        step_ms.append(gen.last_stats.decode_ms_per_token)
    few, many = (kernel_times(gen, prompts, n, args.device) for n in (short, long))
    kv = kv_bytes_per_step(model.config, args.batch, args.prompt_len + long, dtype)
    report = report_of(
        args, sorted(step_ms)[1], per_step(few, many, args.steps), weight_bytes_per_step(model, args.batch) + kv
    )
    args.out.write_text(json.dumps(report, indent=1))
    step, kernel_us = report["decode_ms_per_token"], report["kernel_us_per_step"]
    print(f"decode {step:.3f} ms a step; kernels {kernel_us:.1f} us, gaps {1000 * step - kernel_us:.1f} us")
    if report["copy_bytes_per_s"]:
        share = report["bytes_per_step"] / (step / 1000) / report["copy_bytes_per_s"]
        print(f"{report['bytes_per_step'] / 1e9:.4f} GB a step: {100 * share:.1f}% of the copy rate")
    for group, entry in report["groups"].items():
        print(f"  {group:26} {entry['us']:9.1f} us  {entry['launches']:6.1f} launches")
    for kernel in report["kernels"][:25]:
        print(f"  {kernel['us']:9.1f} us {kernel['launches']:5.1f}x  {kernel['name'][:110]}")


if __name__ == "__main__":
    main()
