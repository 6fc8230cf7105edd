#!/usr/bin/env bash
# staticrt's GPU half, verified and measured on one CUDA machine, in stages of a few minutes each
# (run each as its own command: a lent machine may limit a command's time):
#
#   bench/gpu.sh tests   OUT        the CUDA tests: every family and cache replayed in CUDA graphs,
#                                   verify steps, prefix reuse and a server's rows in them, the
#                                   offloaded cache's prefetch, ONNX Runtime on CUDA
#   bench/gpu.sh ab      OUT [ARGS] bench-1b in bfloat16 on cudagraph, running ahead and the tuned
#                                   matrix-vector reductions each on and off (bench/cudagraph_ab.py)
#   bench/gpu.sh suite   OUT        the whole suite with the GPU present
#   bench/gpu.sh decode  OUT [B..]  bench-1b in bfloat16, batch B (default 1 and 8): cudagraph,
#                                   reduce-overhead and transformers' compiled static cache
#                                   (BACKENDS=cudagraph,compiled,... picks others)
#   bench/gpu.sh offload OUT        bench-1b at prompt 8192: OffloadedStatic against Static (DTYPE=float32
#                                   for tokens that agree; its first call ran past 240 s: give it 600)
#   bench/gpu.sh onnx    OUT        ONNX Runtime's CUDA tests, then bench-1b in float16: ONNX Runtime
#                                   with its CUDA graph beside cudagraph (needs onnxruntime-gpu)
#   bench/gpu.sh profile OUT [B]    a decode step of bench-1b bf16 on cudagraph, kernel by kernel
#                                   (torch's profiler; bench/kernel_profile.py), toward the copy rate
#   bench/gpu.sh placement OUT      where ONNX Runtime's CUDA provider places a tiny Gemma2 graph: the
#                                   host-device copies that keep its CUDA graph off (bench/onnx_placement.py)
#   bench/gpu.sh serve   OUT        bench-serve on bench-llama, cudagraph backend, against transformers
#                                   serve and one request at a time
#
# OUT gets each stage's log, the tests' junit XML and the bench JSON, named for the GPU
# (decode-bench-1b-b1-h100.json); the JSON belongs in bench/results/ with the note that reads it.
# Needs torch's CUDA build and the test and serve extras (README). On an image whose own CUDA torch
# is not staticrt's pinned version, install staticrt with `pip install --no-deps -e .`.
#
# Wall time of each stage on an H100 with 16 CPUs and a cold inductor cache (2026-11-24, torch
# 2.11.0+cu130): tests 285 s; decode at one batch size 290 s when the inductor cache was warm and over
# 400 s cold (transformers' warm-up alone 118 s; `compiled` compiles its prefill graph in 63-109 s on
# CUDA, hence not in the default list). On an H200 (2026-11-26): tests over 250 s with 12 workers and
# `ab` compiling beside them (cut short at 87 of 111), ab 267 s from cold with the tests beside it.
# `tests` alone with 14 workers, cold, on an H200: 225 s (82 passed, 4 failed, 3 skipped). `offload` (cudagraph
# only) 153 s with the prefill graph already compiled. A stage cut short writes no JSON: give each its own command.
# On an H200 (2026-11-27, cold): `onnx` 50 s of tests then 152 s of bench (cudagraph's two graphs 82 s);
# `DTYPE=float32 offload` past 240 s (the 8192-token prefill graph alone 151 s in float32); `serve`
# compiles 14 graphs, 10-23 s each.
# Name `--dist load` (as `tests` does) in any other pytest command there: the project's default,
# loadfile, runs a file on one worker. onnxruntime-gpu is over what a lent machine can be sent in one
# call: bench/ort_parts.py splits it in two (bench/gpu_env.sh installs what was carried: the wheels in
# .whl with part a in .whl/a one call, part b in .whl2/b the next).
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: bench/gpu.sh tests|suite|ab|decode|offload|onnx|profile|placement|serve OUT [BATCH ... | AB ARGS]"
if [ $# -lt 2 ]; then
    echo "$usage" >&2
    exit 2
fi
stage=$1
out=$2
shift 2
py=${PYTHON:-python3}
if ! "$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "bench/gpu.sh: $("$py" -c 'import torch; print("torch", torch.__version__)') sees no CUDA device;" \
        "run it on a machine with a GPU and torch's CUDA build" >&2
    exit 2
fi
# shellcheck source=bench/gpu_env.sh
. bench/gpu_env.sh  # the carried wheels and onnxruntime-gpu's parts, where the image lacks them
mkdir -p "$out"
# the GPU's short name, its first word with a digit: "NVIDIA H100 80GB HBM3" -> h100
gpu=$("$py" -c "import torch; w = torch.cuda.get_device_name().lower().split(); print(next(x for x in w if any(c.isdigit() for c in x)))")
"$py" - >"$out/machine-$gpu.txt" <<'EOF'
import os, torch
p = torch.cuda.get_device_properties(0)
print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, {os.cpu_count()} CPUs")
EOF
bench() {  # NAME ARGS...: staticrt bench on CUDA, its table in NAME.log, its report in NAME-GPU.json
    local name=$1
    shift
    "$py" -m staticrt.cli bench --device cuda "$@" --json "$out/$name-$gpu.json" 2>&1 | tee "$out/$name.log"
}
case $stage in
tests)
    # -v: each result is in the log as it lands, so a stage cut short still says what ran
    "$py" -m pytest -v -n 14 --dist load -p no:cacheprovider --junitxml="$out/cuda-tests.xml" \
        tests/test_cudagraph.py tests/test_offloaded.py tests/test_onnx.py 2>&1 |
        tee "$out/cuda-tests.log"
    ;;
ab)
    "$py" bench/cudagraph_ab.py "$out/ab-bench-1b-$gpu.json" "$@" 2>&1 | tee "$out/ab.log"
    ;;
suite)
    "$py" -m pytest -q -n 12 -p no:cacheprovider --junitxml="$out/suite.xml" 2>&1 | tee "$out/suite.log"
    ;;
decode)
    batches=("$@")
    [ $# -gt 0 ] || batches=(1 8)
    status=0
    for b in "${batches[@]}"; do
        bench "decode-bench-1b-b$b" --model bench-1b --dtype bfloat16 --batch-size "$b" --new-tokens 128 \
            --backends "${BACKENDS:-cudagraph,reduce-overhead,hf}" || status=$?
    done
    exit $status
    ;;
offload)
    dtype=${DTYPE:-bfloat16}
    bench "offload-bench-1b-8192-$dtype" --model bench-1b --dtype "$dtype" --offload --prompt-len 8192 --new-tokens 64 \
        --backends "${BACKENDS:-cudagraph,compiled}"
    ;;
onnx)
    if ! "$py" -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())"; then
        echo "bench/gpu.sh onnx: this onnxruntime has no CUDAExecutionProvider; install onnxruntime-gpu" >&2
        exit 3
    fi
    # first its CUDA test: the capture on a tiny Gemma2 graph, and its tokens against the CPU's
    # (no log capture: torch.onnx's DEBUG records would bury the assertion)
    "$py" -m pytest -v -p no:cacheprovider -p no:logging --tb=short tests/test_onnx.py -k cuda 2>&1 |
        tee "$out/onnx-tests.log"
    bench onnx-bench-1b --model bench-1b --dtype float16 --new-tokens 128 --backends onnx,cudagraph
    ;;
profile)
    "$py" bench/kernel_profile.py "$out/kernels-bench-1b-b${1:-1}-$gpu.json" --batch "${1:-1}" 2>&1 |
        tee "$out/profile.log"
    ;;
placement)
    "$py" -m staticrt.cli export --model tiny-gemma2 --cache hybrid --max-cache-len 128 --format onnx \
        --out /tmp/staticrt-placement >"$out/placement.log" 2>&1
    "$py" bench/onnx_placement.py /tmp/staticrt-placement 2>"$out/placement-ort.log" | tee -a "$out/placement.log"
    ;;
serve)
    "$py" -m staticrt.cli bench-serve --model bench-llama --backend cudagraph --device cuda --requests 192 \
        --stream-interval 16 --json "$out/serve-bench-llama-cudagraph-$gpu.json" 2>&1 | tee "$out/serve.log"
    status=${PIPESTATUS[0]}
    [ "$status" = 0 ] || cp "${TMPDIR:-/tmp}"/staticrt-serve-*.log "$out"/ 2>/dev/null  # a server that died: its whole log
    exit "$status"
    ;;
*)
    echo "$usage" >&2
    exit 2
    ;;
esac
