# On the H200 device: the wheels in .whl (carry: [".whl"]) are the server's packages the device lacks:
# fastapi 0.165.0, starlette 1.10.0, uvicorn 0.55.0, httptools 0.9.0 (cp312), pydantic 2.14.4, pydantic_core 2.50.5
# (cp312), annotated-types 0.8.0, annotated-doc 0.0.7, typing-inspection 0.4.5, typing_extensions 4.16.0 (pydantic
# needs >= 4.16), anyio 4.16.0, opentelemetry-api 1.45.2 (fastapi imports it), and py-spy 0.4.3 for --profile;
# click, h11, httpx, aiohttp, uvloop, idna, prometheus_client and numpy are the device's own. The command (COMMIT:
# the commit measured, the tree travels without its .git):
# python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 TINYVLLM_COMMIT=COMMIT python3 benchmarks/serve.py --json $OUT/serve.json --server-log $OUT/server.log  # noqa: E501
"""serve (issue 5): `tinyvllm serve` under load: TTFT, TPOT and ITL at concurrency 1, 16, 64 and 256.

The server runs the random-weight Llama-3.2-1B of docs/benchmarks.md in a subprocess on loopback. That
model has no tokenizer, so the server runs with --skip-tokenizer-init and takes token-id prompts. The load
is `tinyvllm bench serve`'s: streamed /v1/completions of --input-len random token ids asking for
--output-len tokens each (greedy, ignore_eos), at most `concurrency` in flight. Each level starts with an
unmeasured warm-up round (so that Triton has compiled the kernel variants the level meets), and every round
draws prompts of its own, so that no prefix-cache hit helps. Then the server is stopped with SIGINT and
must exit 0.

Peer: vLLM is not installed on the device and cannot be fetched there, so no other server is measured. The
nearest peer is this engine's own offline throughput: LLM.generate on the prompts of the highest level, in
this process once the server has stopped. Serve over offline output tok/s is what the HTTP layer costs.

One client process parsing every streamed event saturated at concurrency 64 on the H200's host (2026-12-03);
--num-clients N splits each level over N processes, to find the server's own ceiling.

    python benchmarks/serve.py [--json FILE]     (H200: about 3 minutes with the model build and start-up)
    python benchmarks/serve.py --small           (CPU: a tiny random Llama, 2 levels, about a minute)

On the H200 the server's packages (fastapi, uvicorn, pydantic, ...) travel as wheels: see the comment above.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from common import commit, gpu_name, random_llama_1b, random_llama_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (None where /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def start_server(path: str, port: int, engine_args: list[str], log: Any) -> subprocess.Popen:
    command = [sys.executable, "-m", "tinyvllm", "serve", "--model", path, "--host", "127.0.0.1",
               "--port", str(port), "--skip-tokenizer-init", "--log-level", "warning", *engine_args]
    return subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def bench(url: str, concurrency: int, num_prompts: int, input_len: int, output_len: int, vocab_size: int,
          seed: int, duration_limit: float, num_clients: int = 1) -> dict[str, Any]:
    """One `tinyvllm bench serve` run, from this process (and num_clients - 1 more, if asked)."""
    from tinyvllm.entrypoints.bench_serve import add_cli_args, run_benchmark

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--base-url", url, "--num-prompts", str(num_prompts), "--concurrency", str(concurrency),
                              "--input-len", str(input_len), "--max-tokens", str(output_len), "--vocab-size",
                              str(vocab_size), "--seed", str(seed), "--duration-limit", str(duration_limit),
                              "--num-clients", str(min(num_clients, concurrency))])
    summary = asyncio.run(run_benchmark(args))
    requests = summary.pop("requests")  # (per-request lists: too long to keep)
    summary["streamed_chunks"] = sum(len(r["itl"]) + 1 for r in requests if r["ok"])
    return summary


def start_profiler(server_pid: int, path: str) -> subprocess.Popen | None:
    """py-spy sampling the server and its engine core (a child process) into `path`, in py-spy's raw
    (collapsed-stack) format, every thread, idle ones too (so that waits show where they are); None if
    py-spy is not installed."""
    import shutil

    exe = shutil.which("py-spy")
    if exe is None:
        print("  (--profile: py-spy is not installed, no profile taken)", flush=True)
        return None
    return subprocess.Popen([exe, "record", "-p", str(server_pid), "--subprocesses", "--nonblocking", "--idle",
                             "--threads", "-r", "200", "--format", "raw", "-o", path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


_SERVER_PARTS = ("time_to_first_token", "request_queue_time", "request_prefill_time")


def server_sums(url: str) -> dict[str, float]:
    """The server's /metrics: sum and count of its time to first token (API process: arrival to first token)
    and of the engine core's queue and prefill times, added over every API server."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.split(":", 1)[-1]
            if name.endswith(("_seconds_sum", "_seconds_count")) and name.rsplit("_seconds_", 1)[0] in _SERVER_PARTS:
                sums[name] = sums.get(name, 0.0) + sample.value
    return sums


def ttft_parts(client_ttft_mean_ms: float, before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Where the client's mean time to first token went (ms), from the server's sums over the level: the HTTP
    request in and the first event out (the client's less the server's), the way between the API process
    and the engine core (the server's less the core's queue and prefill), and those two."""
    mean = {}
    for part in _SERVER_PARTS:
        count = after[f"{part}_seconds_count"] - before.get(f"{part}_seconds_count", 0.0)
        mean[part] = (after[f"{part}_seconds_sum"] - before.get(f"{part}_seconds_sum", 0.0)) / max(count, 1) * 1e3
    server = mean["time_to_first_token"]
    return {"client": client_ttft_mean_ms, "http_and_stream": client_ttft_mean_ms - server,
            "api_core_hops": server - mean["request_queue_time"] - mean["request_prefill_time"],
            "core_queue": mean["request_queue_time"], "core_prefill": mean["request_prefill_time"]}


def run_level(url: str, server_pid: int, concurrency: int, num_prompts: int, args: argparse.Namespace,
              vocab_size: int, seed: int) -> dict[str, Any]:
    clients = min(args.num_clients, concurrency)
    bench(url, concurrency, concurrency, args.input_len, min(args.output_len, 16), vocab_size, seed + 1,
          args.duration_limit, clients)  # warm-up, on prompts of its own
    profiler = None
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        profiler = start_profiler(server_pid, os.path.join(args.profile, f"serve-c{concurrency}.txt"))
    sums = server_sums(url)
    wall, client, server = time.perf_counter(), time.process_time(), cpu_seconds(server_pid)
    summary = bench(url, concurrency, num_prompts, args.input_len, args.output_len, vocab_size, seed,
                    args.duration_limit, clients)
    wall = time.perf_counter() - wall
    summary["ttft_parts_ms"] = ttft_parts(summary["ttft_ms"]["mean"], sums, server_sums(url))
    if profiler is not None:
        profiler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        try:
            profiler.wait(60)
        except subprocess.TimeoutExpired:
            profiler.kill()
    server_end = cpu_seconds(server_pid)
    # With several client processes the wall time holds their start-up (imports), so neither share says
    # how busy a client or the server was while requests ran: not reported.
    several = clients > 1
    summary["client_cpu_per_wall"] = None if several else (time.process_time() - client) / wall
    summary["server_cpu_per_wall"] = (None if several or server is None or server_end is None
                                      else (server_end - server) / wall)
    return summary


def stop_server(process: subprocess.Popen, timeout: float = 60.0) -> int | None:
    """SIGINT, as a user's Ctrl-C; the exit code, or None if it had to be killed."""
    process.send_signal(signal.SIGINT)
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(30)
        return None


def offline(path: str, levels: list[tuple[int, list[list[int]], list[list[int]]]], output_len: int,
            engine_kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """The peer: LLM.generate on each level's prompts (concurrency, prompts, warm-up prompts), with the same
    warm-up the server had. A level below max_num_seqs runs its prompts `concurrency` at a time, so that its
    batch, and so its decode step, is the server's; TTFT and TPOT per request from RequestOutput.metrics, as
    the client measures them (TPOT: (last token - first token) / (tokens - 1)). Where one call holds more prompts
    than seats, a prompt's TTFT counts from when it was seated, not from the call: the server's clients send a
    request only once one of theirs has finished, so their TTFT holds no wait for a seat either."""
    import statistics

    from tinyvllm import LLM, SamplingParams

    llm = LLM(path, skip_tokenizer_init=True, **engine_kwargs)
    results = []
    for concurrency, prompts, warm_prompts in levels:
        llm.generate(warm_prompts, SamplingParams(temperature=0, max_tokens=min(output_len, 16), ignore_eos=True),
                     use_tqdm=False)
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        groups = ([prompts] if concurrency >= engine_kwargs["max_num_seqs"]
                  else [prompts[i:i + concurrency] for i in range(0, len(prompts), concurrency)])
        start = time.perf_counter()
        outputs = [o for group in groups for o in llm.generate(group, params, use_tqdm=False)]
        seconds = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        queued = len(groups[0]) > concurrency
        ttft = [(o.metrics.first_token_time - (o.metrics.first_scheduled_time if queued else o.metrics.arrival_time))
                * 1e3 for o in outputs]
        tpot = [(o.metrics.last_token_time - o.metrics.first_token_time) * 1e3 / (len(o.outputs[0].token_ids) - 1)
                for o in outputs if len(o.outputs[0].token_ids) > 1]
        m = [o.metrics for o in outputs]
        results.append({"concurrency": concurrency, "requests": len(prompts), "output_tokens": generated,
                        "seconds": seconds, "output_tok_per_s": generated / seconds,
                        "ttft_ms_median": statistics.median(ttft), "tpot_ms_median": statistics.median(tpot),
                        "ttft_ms_mean": statistics.mean(ttft),
                        "prefill_ms_mean": statistics.mean((x.first_token_engine_time - x.first_scheduled_time) * 1e3
                                                           for x in m)})
    results[-1]["preemptions"] = llm.llm_engine.get_stats()["num_preemptions"]
    return results


def table(levels: list[dict[str, Any]]) -> str:
    def cpu(value: float | None) -> str:
        return "-" if value is None else f"{value:.0%}"

    lines = ["| concurrency | requests | req/s | output tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p50 "
             "| ITL p99 | client CPU | server CPU |", "| --- " * 12 + "|"]
    for s in levels:
        done = f"{s['completed']}" + (f" ({s['failed']} failed)" if s["failed"] else "")
        cells = [str(s["config"]["concurrency"]), done, f"{s['request_throughput']:,.2f}",
                 f"{s['output_throughput']:,.0f}"]
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            cells += [f"{s[key]['median']:,.2f}", f"{s[key]['p99']:,.2f}"]
        cells += [cpu(s["client_cpu_per_wall"]), cpu(s["server_cpu_per_wall"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ttft_table(levels: list[dict[str, Any]]) -> str:
    lines = ["| concurrency | client TTFT mean | HTTP in + first event out | API process <-> engine core | "
             "core: queue | core: prefill |", "| --- " * 6 + "|"]
    for s in levels:
        p = s["ttft_parts_ms"]
        lines.append(f"| {s['config']['concurrency']} | " + " | ".join(
            f"{p[k]:,.2f}" for k in ("client", "http_and_stream", "api_core_hops", "core_queue", "core_prefill"))
            + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model directory (default: the random-weight 1B shape)")
    parser.add_argument("--small", action="store_true",
                        help="CPU-sized: a tiny random Llama, concurrency 1 and 4, 16 prompt and 8 output tokens")
    parser.add_argument("--concurrency", default=None, help="comma-separated levels (default 1,16,64,256)")
    parser.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 128)")
    parser.add_argument("--output-len", type=int, default=None, help="output tokens per request (default 128)")
    parser.add_argument("--rounds", type=int, default=4, help="requests per level: this many times its concurrency")
    parser.add_argument("--min-requests", type=int, default=None, help="and at least this many (default 32)")
    parser.add_argument("--device", default=None, help="auto (default), cpu or cuda; --small: cpu")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--duration-limit", type=float, default=300.0, help="seconds per bench serve run")
    parser.add_argument("--no-offline", action="store_true", help="skip the offline LLM.generate peer")
    parser.add_argument("--server-log", default=None, help="the server's output (default: a file under /tmp)")
    parser.add_argument("--num-clients", type=int, default=1,
                        help="client processes per level (at most its concurrency): one Python client can be "
                             "slower than the server it measures")
    parser.add_argument("--api-server-count", type=int, default=1,
                        help="API server processes in front of the engine core (the server's --api-server-count)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="sample the server and its engine core with py-spy during each measured level, "
                             "into DIR/serve-c<concurrency>.txt (collapsed stacks; py-spy must be installed)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    small = {"concurrency": "1,4", "input_len": 16, "output_len": 8, "min_requests": 4, "device": "cpu"}
    large = {"concurrency": "1,16,64,256", "input_len": 128, "output_len": 128, "min_requests": 32, "device": "auto"}
    for name, value in (small if args.small else large).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    levels = [int(c) for c in args.concurrency.split(",")]
    path = args.model or (random_llama_tiny() if args.small else random_llama_1b())
    with open(os.path.join(path, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    engine_kwargs = {"device": args.device, "max_model_len": args.max_model_len, "max_num_seqs": max(levels),
                     "enforce_eager": args.enforce_eager}
    engine_args = ["--device", args.device, "--max-model-len", str(args.max_model_len), "--max-num-seqs",
                   str(max(levels)), "--api-server-count", str(args.api_server_count)] + (
                       ["--enforce-eager"] if args.enforce_eager else [])

    result: dict[str, Any] = {"commit": commit(), "gpu": gpu_name(), "model": path, "input_len": args.input_len,
                              "output_len": args.output_len, "engine": engine_kwargs, "levels": []}
    print(f"serve on {result['gpu']} at {result['commit']}: {path} (vocabulary {vocab_size}, no tokenizer), "
          f"{args.input_len} random prompt tokens, {args.output_len} output tokens (greedy, ignore_eos), streamed "
          f"/v1/completions, max_num_seqs {max(levels)}, {args.api_server_count} API server process(es)", flush=True)
    log_path = args.server_log or f"/tmp/tinyvllm-serve-{os.getpid()}.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    failed = False
    with open(log_path, "w") as log:
        start = time.perf_counter()
        process = start_server(path, port, engine_args, log)
        try:
            from tinyvllm.entrypoints.bench_serve import wait_healthy

            wait_healthy(process, url, timeout=600)
            result["server_ready_s"] = time.perf_counter() - start
            print(f"server healthy after {result['server_ready_s']:.1f} s (imports, model load, KV cache sizing "
                  f"and, on CUDA, graph capture); log: {log_path}", flush=True)
            for i, concurrency in enumerate(levels):
                num_prompts = max(args.min_requests, args.rounds * concurrency)
                summary = run_level(url, process.pid, concurrency, num_prompts, args, vocab_size, seed=2 * i)
                summary["seed"] = 2 * i
                result["levels"].append(summary)
                failed |= summary["failed"] > 0 or summary["cut_off"] > 0
                print(f"  concurrency {concurrency}: {summary['completed']} requests in {summary['duration_s']:.1f} s"
                      + "".join(f"; error: {e}" for e in summary["errors"]), flush=True)
        except Exception as e:  # the server died, or a request could not be sent: report, stop, show the log
            print(f"error: {type(e).__name__}: {e}", flush=True)
            failed = True
        finally:
            exit_code = stop_server(process) if process.poll() is None else process.returncode
    result["server_exit_code"] = exit_code
    if result["levels"]:
        print(table(result["levels"]))
        print("(ms; TPOT: per request, (end - first token) / (tokens - 1); ITL: between streamed chunks; CPU: "
              "the process's CPU time over the level's wall time; '-' with --num-clients > 1)")
        print("Where the time to first token went (means, ms; from the server's /metrics over each level):")
        print(ttft_table(result["levels"]))
        print("(HTTP in + first event out: the client's TTFT less the API server's, arrival to first token; API "
              "process <-> engine core: the API server's less the core's queue and prefill, so the pipe there and "
              "back and the output processing)")
    print(f"server stopped with SIGINT: exit code {exit_code}" + ("" if exit_code == 0 else " (expected 0)"))
    failed |= exit_code != 0
    if exit_code != 0 or not result["levels"]:
        with open(log_path, errors="replace") as f:
            print(f"server log (last lines):\n{f.read()[-3000:]}")

    print("peer: vLLM is not installed on the device (nothing can be fetched there), so no serving peer was "
          "measured; the nearest is this engine's offline LLM.generate on the same prompts.")
    if result["levels"] and not args.no_offline:
        from tinyvllm.entrypoints.bench_serve import random_token_prompts

        levels = []
        for level in result["levels"]:
            concurrency, n, seed = level["config"]["concurrency"], level["config"]["num_prompts"], level["seed"]
            levels.append((concurrency, random_token_prompts(random.Random(seed), n, args.input_len, range(vocab_size)),
                           random_token_prompts(random.Random(seed + 1), concurrency, args.input_len,
                                                range(vocab_size))))
        result["offline"] = offline(path, levels, args.output_len, engine_kwargs)
        print("  offline LLM.generate on the same prompts, and serve / offline (tok/s: higher is better; TTFT, "
              "TPOT: offline / serve, higher is better):")
        print("  | concurrency | offline tok/s | serve / offline | offline TTFT p50 | ratio | offline TPOT p50 "
              "| ratio |")
        print("  | --- | --- | --- | --- | --- | --- | --- |")
        for level, peer in zip(result["levels"], result["offline"]):
            peer["serve_over_offline"] = level["output_throughput"] / peer["output_tok_per_s"]
            peer["ttft_ratio"] = peer["ttft_ms_median"] / level["ttft_ms"]["median"]
            peer["tpot_ratio"] = peer["tpot_ms_median"] / level["tpot_ms"]["median"]
            print(f"  | {peer['concurrency']} | {peer['output_tok_per_s']:,.0f} | {peer['serve_over_offline']:.2f}x | "
                  f"{peer['ttft_ms_median']:.2f} ms | {peer['ttft_ratio']:.2f}x | {peer['tpot_ms_median']:.3f} ms | "
                  f"{peer['tpot_ratio']:.2f}x |")
        print("  offline TTFT mean / its prefill (first scheduled to first token): " + ", ".join(
            f"{p['concurrency']}: {p['ttft_ms_mean']:.2f} / {p['prefill_ms_mean']:.2f} ms" for p in result["offline"]))
        result["serve_over_offline"] = result["offline"][-1]["serve_over_offline"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
