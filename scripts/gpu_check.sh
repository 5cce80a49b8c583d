#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and its own CUDA torch (no setup here: run it with the python that has them):
# the GPU tests, then the benchmarks, each part under a time limit so that one that hangs cannot take the rest.
# Parts: tests, latency, throughput, shared-prefix, serve, serve-floor (default: all, in that order), and for the
# float8 KV cache (kv_cache_dtype="fp8"): throughput-fp8 (throughput-256 with it: run it beside throughput to
# compare), tests-fp8 (the GPU tests of its kernels and engine), kernels-fp8 (decode attention on it) and sweep-fp8
# (its decode tiles);
# products-256 (cuBLAS and our Triton tiles at a 128- and 256-sequence step's rows); sampling (the sampling table)
# and tests-sampling (the sampler's GPU tests); for float8 weights: fp8-kernels (their products against bf16 cuBLAS),
# tests-fp8-weights (their GPU tests), latency-fp8 and throughput-fp8-weights (with the fp8 KV cache); the other
# families' shapes: latency-qwen3, latency-gemma2; prompt-logprobs; tests-new (the GPU tests of the newest work), e.g.
#     bash scripts/gpu_check.sh tests latency
# PYTHON picks the interpreter (default python3); LIMIT_S the seconds per part (default 300, and 900 for the tests:
# on an H100 the 209 GPU tests took more than 280 s, and the float8 KV cache's engine tests start six engines more).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
limit=${LIMIT_S:-300}
tests_limit=${LIMIT_S:-900}
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests latency throughput shared-prefix serve serve-floor)
status=0
for part in "${parts[@]}"; do
    case $part in
        tests) command=("$python" -m pytest -q -m cuda -p no:cacheprovider tests/gpu) ;;
        latency) command=("$python" benchmarks/latency.py) ;;
        throughput) command=("$python" benchmarks/throughput.py --trace --no-peer) ;;
        shared-prefix) command=("$python" benchmarks/shared_prefix.py --trace) ;;
        serve) command=("$python" benchmarks/serve.py --concurrency 1,64,256 --num-clients 4 --api-server-count 4) ;;
        serve-floor) command=("$python" benchmarks/serve_floor.py) ;;
        throughput-fp8) command=("$python" benchmarks/throughput.py --trace --no-peer --kv-cache-dtype fp8) ;;
        tests-fp8) command=("$python" -m pytest -q -m cuda -p no:cacheprovider tests/gpu -k fp8) ;;
        kernels-fp8) command=("$python" benchmarks/bench_attention.py --kv-cache-dtype fp8) ;;
        sweep-fp8) command=("$python" benchmarks/bench_attention.py --sweep decode --sweep-only --kv-cache-dtype fp8) ;;
        products-256) command=("$python" benchmarks/bench_gemv.py --sweep --batches 128,256) ;;
        sampling) command=("$python" benchmarks/bench_sampling.py) ;;
        tests-sampling) command=("$python" -m pytest -q -m cuda -p no:cacheprovider tests/gpu -k sample) ;;
        fp8-kernels) command=("$python" benchmarks/bench_fp8.py) ;;
        tests-fp8-weights) command=("$python" -m pytest -q -m cuda -p no:cacheprovider tests/gpu -k fp8_linear) ;;
        prompt-logprobs) command=("$python" benchmarks/prompt_logprobs.py) ;;
        latency-fp8) command=("$python" benchmarks/latency.py --no-peer --quantization fp8) ;;
        throughput-fp8-weights) command=("$python" benchmarks/throughput.py --trace --no-peer --no-static
                                         --kv-cache-dtype fp8 --quantization fp8) ;;
        latency-qwen3|latency-gemma2) command=("$python" benchmarks/latency.py --no-peer
                                               --shape "$([ "$part" = latency-qwen3 ] && echo qwen3-1.7b || echo gemma2-2b)") ;;
        tests-new) command=("$python" -m pytest -q -m cuda -p no:cacheprovider tests/gpu
                            -k "window or softcap or bitmask or prompt_logprobs or token_logprobs or gelu or gemma2 or families or fp8_weights") ;;
        *) echo "unknown part: $part (tests, latency, throughput, shared-prefix, serve, serve-floor," \
                "throughput-fp8, tests-fp8, kernels-fp8, sweep-fp8, products-256," \
                "sampling, tests-sampling, fp8-kernels, tests-fp8-weights, prompt-logprobs, tests-new," \
                "latency-fp8, throughput-fp8-weights, latency-qwen3, latency-gemma2)" >&2
           exit 2 ;;
    esac
    part_limit=$limit
    [ "$part" = tests ] && part_limit=$tests_limit
    echo "=== $part: ${command[*]} (limit ${part_limit} s)"
    start=$(date +%s)
    timeout "$part_limit" "${command[@]}"
    code=$?
    echo "=== $part: exit $code after $(( $(date +%s) - start )) s"
    [ $code -eq 0 ] || status=1
done
exit $status
