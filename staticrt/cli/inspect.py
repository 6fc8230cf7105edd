"""`staticrt inspect`: a cache's layout and memory, layer by layer, without allocating it."""

from __future__ import annotations

import argparse

from .console import console, show_table


def cmd_inspect(args: argparse.Namespace) -> int:
    import torch

    from ..caches import CacheSpec, build_cache, resolve_max_cache_len
    from ..dtypes import resolve_dtype
    from ..loading.checkpoint import load_config
    from ..models.quant_spec import parse_quantize
    from ..models.quantize import kernels_for, quantized_dtype

    # The cache holds what the model computes in: bfloat16 by default for torchao's quantized
    # weights, float32 for staticrt's int8-activation kernels ("int8" and "int4" on most CPUs).
    config = load_config(args.model)
    spec, dtype = parse_quantize(args.quantize), args.dtype and resolve_dtype(args.dtype)
    spec = spec and kernels_for(spec, torch.device("cpu"), dtype, config, build=False)  # as `run` here would
    dtype = quantized_dtype(spec, dtype)
    max_cache_len = resolve_max_cache_len(config, args.cache, args.max_cache_len, window=args.window)
    cache = build_cache(config, CacheSpec(args.cache, args.batch_size, max_cache_len, args.window), dtype, "meta")
    static = build_cache(config, CacheSpec("static", args.batch_size, max_cache_len), dtype, "meta")
    # each cache layer's decoder layer: a parallel layer's (Falcon-H1's) Mamba2 and attention share one
    owner = {j: layer for layer in range(config.num_layers) for j in config.cache_layers(layer)}
    rows = []
    for i, attention in enumerate(config.layer_types):
        layout = cache.layer_layout(i)
        # K's shape (V's is the same); a recurrent layer's parts by name (caches/recurrent.py)
        parts = cache.layer_parts(i)[: 1 if i not in cache.recurrent else None]
        shape = ", ".join(
            f"{'' if i not in cache.recurrent else name + ' '}{'x'.join(map(str, s))}" for name, s, _ in parts
        )
        rows.append(
            [
                owner[i],
                attention,
                layout,
                "host" if layout == "offloaded" else "device",
                shape,
                f"{cache.layer_bytes(i):,}",
            ]
        )
    title = f"{args.model}: {cache.kind} cache, batch {args.batch_size}, max_cache_len {max_cache_len}"
    if cache.window:
        title += f", window {cache.window}"
    columns = ["layer", "mixer", "cache", "held in", "K, V [B,H_kv,L,D] or state", "bytes"]
    show_table(title, columns, rows, args.format)
    ours, host, full = cache.device_bytes(), cache.host_bytes(), static.device_bytes()
    console.print(
        f"device bytes (K/V{', working buffers' if host else ''} and lengths): {ours:,}; host bytes: "
        f"{host:,}; a static cache of the same length holds {full:,} on the device ({ours / full:.1%} "
        "of it)",
        soft_wrap=True,
    )
    return 0
