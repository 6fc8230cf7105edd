"""staticrt command line: demo | run | export | bench | inspect."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

console = Console(stderr=True)

EPILOG = """\
examples:
  staticrt demo
  staticrt run --model tiny-llama --prompt-ids 1,2,3 --prompt-ids 7,8 --max-new-tokens 16 --json
  staticrt run --model ./my-llama --prompt "The capital of France is" --backend compiled
  staticrt bench --model bench-llama --backends eager,compiled,hf --new-tokens 64 --threads 2 --json bench.json
  staticrt bench --model bench-llama --backends compiled,onnx --threads 2 --json bench-onnx.json
  staticrt bench --backends compiled,hf --window 4096 --prompt-len 4160 --new-tokens 32 --json bench-sliding.json
  staticrt bench --backends compiled --offload --prompt-len 8192 --new-tokens 32 --json bench-offload.json
  staticrt export export/tiny-llama.toml && staticrt bench --cold-start artifacts/tiny-llama --json bench-cold.json
  staticrt run --model tiny-mistral --cache sliding --prompt-ids 1,2,3 --max-new-tokens 500
  staticrt inspect --model tiny-gemma2 --cache hybrid --max-cache-len 4096
  staticrt inspect --model bench-llama --cache offloaded --max-cache-len 8192

A model is a built-in preset ({presets}) or a Hugging Face checkpoint folder
(config.json + safetensors, tokenizer.json for --prompt).
"""


def _preset_names() -> str:
    from .config import PRESETS

    return ", ".join(PRESETS)


def _prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids {text!r}: expected comma-separated integers like 1,2,3") from None


def _add_model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--model", required=required, help="preset name or Hugging Face checkpoint folder")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default float32)")
    p.add_argument("--cache", default="auto",
                   help="KV cache: static (every position), sliding (every layer a rotating buffer of the "
                        "window; generation never runs out), hybrid (rotating buffers for sliding-window "
                        "layers only, as in Gemma2), offloaded (every layer's K/V in host memory, two layers' "
                        "worth on the device), offloaded-hybrid (hybrid with the global layers offloaded), "
                        "auto (default: what the model's config implies, static when the window is no "
                        "shorter than --max-cache-len)")
    p.add_argument("--max-cache-len", type=int, default=None,
                   help="positions a static layer holds (default: run fits prompt + new tokens; inspect takes "
                        "the model's context, at most 1024; never below the window for sliding and hybrid)")
    p.add_argument("--window", type=int, default=None,
                   help="slots of a rotating layer (default: the model's sliding_window)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="staticrt",
        description="LLM decoding as a fixed-shape, static-graph program.",
        epilog=EPILOG.format(presets=_preset_names()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="run every backend on a built-in tiny model and check they agree")
    demo.add_argument("--model", default="tiny-llama", help="preset to demo (default tiny-llama)")
    demo.add_argument("--new-tokens", type=int, default=32)

    run = sub.add_parser("run", help="generate from a prompt", formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog="Tokens stream to stdout as they are chosen; --json prints one object at the end.")
    run.add_argument("artifact", nargs="?", type=Path,
                     help="an artifact folder from `staticrt export` (instead of --model): runs its programs")
    _add_model_args(run, required=False)
    src = run.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer.json)")
    src.add_argument("--prompt-ids", type=_prompt_ids, action="append",
                     help="token ids of one row, comma-separated; repeat for a batch")
    run.add_argument("--max-new-tokens", type=int, default=32)
    run.add_argument("--threads", type=int, default=None,
                     help="CPU threads for torch, or for ONNX Runtime with --backend onnx (default: the library's choice)")
    run.add_argument("--backend", default=None,
                     help="with --model: eager (default) | compiled | cudagraph (CUDA graphs of the compiled step; the "
                          "compiled path on a CPU) | reduce-overhead (torch.compile's own CUDA graphs); with an artifact: aoti (AOTInductor packages) | "
                          "pt2 (torch.export programs) | onnx (ONNX Runtime, no torch), default the first it holds")
    run.add_argument("--do-sample", action="store_true", help="sample instead of greedy")
    run.add_argument("--temperature", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--stop-ids", type=_prompt_ids, default=None,
                     help="stop token ids, comma-separated (default: the checkpoint's eos ids)")
    run.add_argument("--json", action="store_true", help="print {\"tokens\": [[...] per row], ...} as one JSON object")
    _add_export_parser(sub)

    bench = sub.add_parser("bench", help="side-by-side decode benchmark, written as JSON")
    bench.add_argument("--model", default="bench-llama", help="preset or checkpoint folder (default bench-llama)")
    bench.add_argument("--backends", default="eager,compiled,hf",
                       help="comma-separated: eager, compiled, cudagraph, reduce-overhead, onnx (exported to a "
                            "temporary artifact, run in ONNX Runtime), hf (transformers, when installed)")
    bench.add_argument("--new-tokens", type=int, default=64)
    bench.add_argument("--prompt-len", type=int, default=32)
    bench.add_argument("--batch-size", type=int, default=1)
    bench.add_argument("--repeats", type=int, default=5,
                       help="timed rounds after every backend's warm-up; a round runs each backend once, in turn")
    bench.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    bench.add_argument("--dtype", default="float32")
    bench.add_argument("--window", type=int, default=None,
                       help="give every layer this sliding window and compare, past it, a SlidingWindow cache "
                            "with a Static cache of the window and transformers' sliding-window cache "
                            "(needs --prompt-len >= window)")
    bench.add_argument("--offload", action="store_true",
                       help="run each staticrt backend with a Static and an OffloadedStatic cache and report "
                            "the offloaded step's cost (make --prompt-len long enough that the K/V outweighs "
                            "the weights)")
    bench.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    bench.add_argument("--cold-start", type=Path, default=None, metavar="ARTIFACT",
                       help="instead: time from a fresh process to the first token with this artifact's AOTInductor "
                            "and pt2 programs, against the compiled backend on the same model (which compiles)")
    bench.add_argument("--json", type=Path, default=None, help="write the report here")

    inspect = sub.add_parser("inspect", help="show a model's cache layout and memory")
    _add_model_args(inspect)
    inspect.add_argument("--batch-size", type=int, default=1)
    return parser


def _add_export_parser(sub: Any) -> None:
    export = sub.add_parser(
        "export", help="export a model with its cache to an artifact folder",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  staticrt export export/tiny-mistral.toml          # writes artifacts/tiny-mistral/\n"
               "  staticrt export --model ./my-llama --cache static --batch-size 1 --max-cache-len 2048 \\\n"
               "      --prefill-buckets 128,512 --out artifacts/my-llama\n"
               "  staticrt export export/tiny-llama.toml --format onnx  # only the recipe's ONNX graph\n"
               "  staticrt run artifacts/tiny-mistral --prompt-ids 1,2,3 --json\n"
               "  staticrt run artifacts/tiny-mistral --backend onnx --prompt-ids 1,2,3   # ONNX Runtime, no torch")
    export.add_argument("recipe", nargs="?", type=Path, help="a recipe, export/NAME.toml (writes artifacts/NAME/)")
    _add_model_args(export, required=False)
    export.add_argument("--batch-size", type=int, default=1)
    export.add_argument("--prefill-buckets", type=_prompt_ids, default=None,
                        help="prompt widths to export a prefill program for, comma-separated (default: max-cache-len)")
    export.add_argument("--format", default=None,
                        help="comma-separated: aoti (AOTInductor packages), pt2 (torch.export programs), onnx (an "
                             "ONNX graph with genai_config.json for ONNX Runtime and onnxruntime-genai); default: "
                             "the recipe's formats, or all three with --model")
    export.add_argument("--out", type=Path, default=None, help="artifact folder (default artifacts/RECIPE_NAME)")


def cmd_export(args: argparse.Namespace) -> int:
    from .caches import CacheSpec
    from .checkpoint import load_model
    from .exporters import export_artifact
    from .recipe import Recipe, read_recipe

    formats = tuple(f.strip() for f in (args.format or "").split(",") if f.strip())
    if args.recipe is not None:
        recipe = read_recipe(args.recipe)
        recipe = dataclasses.replace(recipe, formats=formats) if formats else recipe
    elif args.model and args.out:
        max_cache_len = args.max_cache_len or 1024
        recipe = Recipe(name=args.out.name, model=args.model, cache=args.cache, batch_size=args.batch_size,
                        max_cache_len=max_cache_len, prefill_buckets=tuple(args.prefill_buckets or (max_cache_len,)),
                        formats=formats or ("aoti", "pt2", "onnx"), dtype=args.dtype, window=args.window)
    else:
        raise SystemExit("staticrt export: give a recipe (export/NAME.toml), or --model and --out")
    out = args.out or Path("artifacts") / recipe.name
    model = load_model(recipe.model, dtype=recipe.dtype)

    def copy_tokenizer(folder: Path) -> None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            source = Path(recipe.model) / name
            if source.is_file():
                (folder / name).write_bytes(source.read_bytes())

    def stage(what: str, seconds: float) -> None:
        console.print(f"  [green]done[/] {what} ({seconds:.1f} s)")

    console.print(f"exporting {recipe.model} ({recipe.cache} cache, batch {recipe.batch_size}, max_cache_len "
                  f"{recipe.max_cache_len}, prefill buckets {list(recipe.prefill_buckets)}) to {out}")
    start = time.perf_counter()
    with console.status("tracing, lowering and compiling (AOTInductor takes tens of seconds a program)"):
        export_artifact(model, CacheSpec(recipe.cache, recipe.batch_size, recipe.max_cache_len, recipe.window),
                        recipe.prefill_buckets, out, recipe.formats, {"recipe": recipe.to_dict()}, stage, copy_tokenizer)
    console.print(f"wrote {out} in {time.perf_counter() - start:.1f} s; run it with: staticrt run {out} --prompt-ids 1,2,3")
    return 0


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    table = Table(title=title)
    for col in columns:
        first = col == columns[0]  # row names stay whole; numeric headers may wrap
        table.add_column(col, justify="left" if first else "right", no_wrap=first)
    for row in rows:
        table.add_row(*(f"{v:,.2f}" if isinstance(v, float) else str(v) for v in row))
    return table


def cmd_demo(args: argparse.Namespace) -> int:
    import torch

    from .artifact import load_artifact
    from .backends import BACKENDS, CUDA_ONLY
    from .caches import CacheSpec
    from .checkpoint import load_model
    from .exporters import export_artifact
    from .generate import Generator

    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = load_model(args.model)
    prompts = [[1, 5, 9, 13, 17, 21, 25], [2, 4, 8], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]
    console.print(f"[bold]staticrt demo[/] on {args.model}: {len(prompts)} prompts, {args.new_tokens} new tokens each")
    scratch = tempfile.TemporaryDirectory()
    artifact = Path(scratch.name) / "demo"
    with console.status("exporting torch.export programs and an ONNX graph (AOTInductor packages take a minute "
                        "more to build: `staticrt export` makes them)"):
        start = time.perf_counter()
        export_artifact(model, CacheSpec("static", len(prompts), 64), [16], artifact, ["pt2", "onnx"])
    console.print(f"exported pt2 programs and an onnx graph in {time.perf_counter() - start:.1f} s")
    # Without CUDA the CUDA-graph backends run the compiled path; the demo runs that once.
    backends = [name for name in BACKENDS if torch.cuda.is_available() or name not in CUDA_ONLY]
    if len(backends) < len(BACKENDS):
        console.print(f"{', '.join(CUDA_ONLY)}: no CUDA device here, where they run the compiled path; skipped")
    makers = {name: partial(Generator, model, max_batch_size=len(prompts), max_cache_len=64, backend=name)
              for name in backends}
    makers |= {"exported-pt2": partial(load_artifact, artifact, "pt2"), "onnx": partial(load_artifact, artifact, "onnx")}
    results, rows = {}, []
    for name, make in makers.items():
        with console.status(f"{name}: first run (compiles or exports where the backend does)"):
            start = time.perf_counter()
            gen = make()
            gen.generate(prompts, max_new_tokens=args.new_tokens)
            first = time.perf_counter() - start
        results[name] = gen.generate(prompts, max_new_tokens=args.new_tokens)
        stats = gen.last_stats
        rows.append([name, first, 1000 * stats.prefill_s, stats.decode_ms_per_token,
                     len(prompts) * 1000 / stats.decode_ms_per_token])
    console.print(_table("tokens/s (decode, batch of 3)", ["backend", "first run s", "prefill ms",
                                                            "decode ms/step", "tokens/s"], rows))
    reference = next(iter(results.values()))
    agree = all(tokens == reference for tokens in results.values())
    for r, tokens in enumerate(reference):
        console.print(f"row {r}: {prompts[r]} -> {tokens}", markup=False, soft_wrap=True)
    if not agree:
        console.print("backends disagree: " + json.dumps(results), style="red", markup=False, soft_wrap=True)
        return 1
    console.print(f"[green]all {len(results)} backends agree token for token[/]")
    return 0


def _prompts(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    if args.prompt is None:
        return args.prompt_ids
    if tokenizer is None:
        raise SystemExit(f"staticrt run: --prompt needs a tokenizer.json in {args.artifact or args.model}, which has "
                         "none; pass token ids with --prompt-ids 1,2,3 instead")
    return [tokenizer.encode(args.prompt).ids]


def _artifact_run(args: argparse.Namespace) -> tuple[Any, Any, list[int], list[list[int]]]:
    from .artifact import load_artifact
    from .tokenizer import load_tokenizer

    if args.model:
        raise SystemExit("staticrt run: give an artifact folder or --model, not both")
    gen = load_artifact(args.artifact, backend=args.backend, threads=args.threads)
    tokenizer = load_tokenizer(args.artifact / "tokenizer.json")
    eos_ids = list(gen.backend.manifest["model"]["config"].get("eos_token_ids", []))
    return gen, tokenizer, eos_ids, _prompts(args, tokenizer)


def _model_run(args: argparse.Namespace) -> tuple[Any, Any, list[int], list[list[int]]]:
    """A model bound to a cache sized for the request."""
    from .checkpoint import load_model
    from .generate import Generator

    if not args.model:
        raise SystemExit("staticrt run: say what to run: --model PRESET_OR_FOLDER, or an artifact folder")
    model = load_model(args.model, dtype=args.dtype)
    prompts = _prompts(args, model.tokenizer)
    max_cache_len = args.max_cache_len or max(len(p) for p in prompts) + args.max_new_tokens
    if not args.max_cache_len and args.cache in ("sliding", "hybrid", "offloaded-hybrid"):
        max_cache_len = max(max_cache_len, args.window or model.config.sliding_window or 0)
    gen = Generator(model, cache=args.cache, max_batch_size=len(prompts), max_cache_len=max_cache_len,
                    backend=args.backend or "eager", window=args.window)
    return gen, model.tokenizer, list(model.config.eos_token_ids), prompts


def cmd_run(args: argparse.Namespace) -> int:
    if args.threads and args.backend != "onnx":
        import torch

        torch.set_num_threads(args.threads)
    gen, tokenizer, eos_ids, prompts = (_artifact_run if args.artifact is not None else _model_run)(args)

    def stream(row: int, token: int) -> None:
        if args.json:
            return
        text = tokenizer.decode([token]) if tokenizer is not None else f" {token}"
        sys.stdout.write(text if len(prompts) == 1 else f"[{row}]{text} ")
        sys.stdout.flush()

    tokens = gen.generate(prompts, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          stop_token_ids=list(args.stop_ids) if args.stop_ids is not None else eos_ids,
                          stream=stream)
    stats = gen.last_stats
    if args.json:
        cache = gen.backend.kind if args.artifact else gen.backend.cache.kind
        out: dict[str, Any] = {"tokens": tokens, "backend": gen.backend.name, "cache": cache,
                               "prefill_ms": 1000 * stats.prefill_s,
                               "decode_ms_per_token": stats.decode_ms_per_token}
        if tokenizer is not None:
            out["text"] = [tokenizer.decode(t) for t in tokens]
        print(json.dumps(out))
    else:
        sys.stdout.write("\n")
        console.print(f"prefill {1000 * stats.prefill_s:.1f} ms, decode {stats.decode_ms_per_token:.2f} ms/token")
    return 0


def _cache_mb(result: dict[str, Any]) -> str:
    if "cache_device_bytes" not in result:  # transformers' cache is not ours to weigh
        return "-"
    return f"{result['cache_device_bytes'] / 1e6:.1f}/{result['cache_host_bytes'] / 1e6:.1f}"


def _bench_cold_start(args: argparse.Namespace) -> int:
    from .bench import cold_start, write_report

    with console.status("cold starts") as status:
        report = cold_start(args.cold_start, ("aoti", "pt2"), on_stage=lambda s: status.update(s))
    rows = [[label.removesuffix("_s"), value] for label, value in report.items()
            if label.endswith("_s") and label != "isa_probe_s"]
    console.print(_table(f"{args.cold_start}: fresh process to first token", ["programs", "seconds"], rows))
    console.print(f"compiled / aoti: {report['compiled_over_aoti']:.1f}x (after a one-time CPU-ISA probe of "
                  f"{report['isa_probe_s']:.1f} s that every inductor user pays once a machine)")
    if args.json:
        write_report(report, args.json)
        console.print(f"wrote {args.json}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench, write_report

    if args.cold_start is not None:
        return _bench_cold_start(args)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if "hf" in backends:
        try:
            import transformers  # noqa: F401
        except ImportError:
            console.print("[yellow]transformers is not installed: skipping the hf backend "
                          "(pip install 'staticrt[hf]')[/]")
            backends.remove("hf")
    with console.status("benchmarking") as status:
        report = run_bench(args.model, backends, new_tokens=args.new_tokens, prompt_len=args.prompt_len,
                           batch_size=args.batch_size, repeats=args.repeats, threads=args.threads,
                           dtype=args.dtype, window=args.window, offload=args.offload, device=args.device,
                           on_stage=lambda s: status.update(s))
    rows = [[name, r["prompt_len"], r["prefill_ms"], r["decode_ms_per_token"], r["tokens_per_s"],
             r["kv_bytes_per_step"] / 1e6, _cache_mb(r), 100 * r["streaming_fraction"],
             100 * r["streaming_fraction_with_kv"]]
            for name, r in report["backends"].items()]
    title = f"{args.model}, batch {args.batch_size}, {report['device']}, {report['machine']['torch_threads']} threads"
    if args.window:
        title += f", sliding window {args.window}"
    console.print(_table(title, ["backend", "prompt", "prefill ms", "ms/token", "tok/s", "K/V MB read",
                                 "cache MB device/host", "% bound", "% bound +K/V"], rows))
    console.print("% bound: weight bytes a decode step reads over the step time, against the streaming rate "
                  "sampled before and after each of that backend's timed runs; +K/V adds the cache the step reads",
                  soft_wrap=True)
    rates = ", ".join(f"{name} {r['matvec_bytes_per_s'] / 1e9:.1f}" for name, r in report["backends"].items())
    console.print(f"weights read per decode step: {report['weight_bytes_per_step'] / 1e6:.1f} MB; "
                  f"matrix-vector streaming rate (GB/s): {rates}", soft_wrap=True)
    for key, value in report["ratios"].items():
        console.print(f"{key}: {value:.2f}x")
    if not report["tokens_agree"]:
        console.print("[red]backends produced different tokens[/]")
    if args.json:
        write_report(report, args.json)
        console.print(f"wrote {args.json}")
    return 0 if report["tokens_agree"] else 1


def cmd_inspect(args: argparse.Namespace) -> int:
    from .caches import CacheSpec, build_cache, default_max_cache_len
    from .checkpoint import load_config, resolve_dtype

    config, dtype = load_config(args.model), resolve_dtype(args.dtype)
    max_cache_len = args.max_cache_len or default_max_cache_len(config, args.cache)
    cache = build_cache(config, CacheSpec(args.cache, args.batch_size, max_cache_len, args.window), dtype, "meta")
    static = build_cache(config, CacheSpec("static", args.batch_size, max_cache_len), dtype, "meta")
    rows = []
    for i, attention in enumerate(config.layer_types):
        key, _ = cache.storage_buffers(i)
        rows.append([i, attention, cache.layer_kind(i), "host" if cache.layer_kind(i) == "offloaded" else "device",
                     "x".join(map(str, key.shape)), f"{2 * key.numel() * key.element_size():,}"])
    title = f"{args.model}: {cache.kind} cache, batch {args.batch_size}, max_cache_len {max_cache_len}"
    if cache.window:
        title += f", window {cache.window}"
    columns = ["layer", "attention", "cache", "held in", "K and V shape [B,H_kv,L,D]", "bytes"]
    console.print(_table(title, columns, rows))
    ours, host, full = cache.device_bytes(), cache.host_bytes(), static.device_bytes()
    console.print(f"device bytes (K/V{', working buffers' if host else ''} and lengths): {ours:,}; host bytes: "
                  f"{host:,}; a static cache of the same length holds {full:,} on the device ({ours / full:.1%} "
                  "of it)", soft_wrap=True)
    return 0


COMMANDS = {"demo": cmd_demo, "run": cmd_run, "export": cmd_export, "bench": cmd_bench, "inspect": cmd_inspect}


# The errors that mean a bad request (printed, exit status 2), by module: a module that was never
# imported raised none, and importing it here would pull torch into a torch-free ONNX run.
USER_ERRORS = (("staticrt.generate", "GenerationError"), ("staticrt.checkpoint", "CheckpointError"),
               ("staticrt.config", "ConfigError"), ("staticrt.caches.base", "CacheError"),
               ("staticrt.bench", "BenchError"), ("staticrt.artifact", "ArtifactError"))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except Exception as err:
        known = tuple(getattr(sys.modules[module], name) for module, name in USER_ERRORS if module in sys.modules)
        if not isinstance(err, known):
            raise
        console.print(f"staticrt {args.command}: {err}", style="red", markup=False, soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
