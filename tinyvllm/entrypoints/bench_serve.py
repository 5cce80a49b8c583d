"""`tinyvllm bench serve`: load for any OpenAI-compatible server, measured as `vllm bench serve` does.

Sends `--num-prompts` streamed requests of random prompts (`--input-len` tokens, or words) asking for
`--max-tokens` tokens each (ignore_eos, so every request generates all of them), either all at once,
at most `--concurrency` at a time, or arriving as a Poisson process of `--request-rate` per second;
stops after `--duration-limit` seconds whatever is left. Reports request and token throughput and, at
mean/median/p90/p99: time to first token (TTFT), time per output token after the first (TPOT), the gap
between consecutive streamed chunks (ITL) and end-to-end latency (E2EL). The client is aiohttp, as vLLM's:
on loopback its first token arrives sooner than httpx's (benchmarks/RESULTS.md), time that a measured TTFT holds."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# Common English words: a words prompt of L words is about L tokens for a BPE tokenizer.
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part over new sound take only little work know place year live me back give most very "
    "after thing our just name good sentence man think say great where help through much before line right "
    "too mean old any same tell boy follow came want show also around form three small set put end does "
    "another well large must big even such because turn here why ask went men read need land different home "
    "us move try kind hand picture again change off play spell air away animal house point page letter mother "
    "answer found study still learn should world high every near add food between own below country plant"
).split()


def wait_healthy(process: Any, url: str, timeout: float) -> None:
    """Poll `url`/health until the server `process` (a subprocess.Popen) answers 200; RuntimeError if it
    exits first or the timeout passes."""
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy within {timeout:.0f} s")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server")
    parser.add_argument("--endpoint", default="completions", choices=["completions", "chat"],
                        help="the API to load")
    parser.add_argument("--model", default=None, help="model name to send (none: the server's first model)")
    parser.add_argument("--api-key", default=None, help="bearer key (none: $OPENAI_API_KEY if set)")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests to send")
    parser.add_argument("--concurrency", type=int, default=None, help="at most this many requests in flight")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (inf: all at once)")
    parser.add_argument("--dataset-name", default="random", choices=["random"],
                        help="random prompts of --input-len tokens (or words), as vLLM's random dataset")
    parser.add_argument("--input-len", "--random-input-len", type=int, default=128,
                        help="prompt length, tokens (or words)")
    parser.add_argument("--max-tokens", "--output-len", "--random-output-len", dest="max_tokens", type=int,
                        default=128, help="tokens to generate per request")
    parser.add_argument("--prompt-kind", default=None, choices=["tokens", "words"],
                        help="random token ids (completions only; drawn via the server's /tokenize) or random "
                             "words (none: tokens for completions, words for chat)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="draw token-id prompts from [0, N) instead of through /tokenize (for a server "
                             "started with --skip-tokenizer-init, which has no tokenizer)")
    parser.add_argument("--duration-limit", type=float, default=600.0,
                        help="stop after this many seconds; requests still running then count as cut off")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts and arrivals")
    parser.add_argument("--num-clients", type=int, default=1,
                        help="client processes sharing the requests (and the concurrency): one Python process "
                             "parsing every streamed event can be slower than the server it measures")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results to FILE")


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # seconds since the benchmark began


async def _send(client: Any, url: str, payload: dict[str, Any], headers: dict[str, str], t0: float,
                chat: bool) -> RequestResult:
    import aiohttp

    result = RequestResult(start=time.perf_counter() - t0)
    start = time.perf_counter()
    last = start
    chunks = 0
    usage = None
    try:
        async with client.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                body = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {body[:300]}"
                return result
            # (line by line, to the end of the response, past [DONE]: a response read whole leaves its connection
            # for the next request; one left unread closes it, and the next request waits for a new connection)
            async for raw in response.content:
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    # A completion chunk carries output even when its text is empty (a server without a
                    # tokenizer sends no text); chat's first chunk carries only the role.
                    has_output = bool((choice.get("delta") or {}).get("content")) if chat else "text" in choice
                    if has_output:
                        now = time.perf_counter()
                        if chunks == 0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        chunks += 1
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    if chunks == 0:
        result.error = "no text came back"
        return result
    result.ok = True
    result.output_tokens = usage["completion_tokens"] if usage else chunks
    result.prompt_tokens = usage["prompt_tokens"] if usage else 0
    return result


def _session(connections: int, duration_limit: float) -> Any:
    """An aiohttp session of up to `connections` kept-alive connections. (It ignores proxies from the
    environment by default, as it must for a loopback server.)"""
    import aiohttp

    # read_bufsize: a streamed line may be up to twice this long (aiohttp's default allows 128 KiB, which a
    # chunk with many logprobs can pass).
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections), read_bufsize=2**22,
                                 timeout=aiohttp.ClientTimeout(total=duration_limit + 30.0, connect=10.0))


def random_token_prompts(rng: random.Random, num: int, length: int, pool: Sequence[int]) -> list[list[int]]:
    """`num` prompts of `length` ids drawn from `pool` (benchmarks/serve.py redraws them to replay offline)."""
    return [[rng.choice(pool) for _ in range(length)] for _ in range(num)]


async def _token_prompts(client: Any, base_url: str, model: str, headers: dict[str, str], num: int,
                         length: int, rng: random.Random) -> list[list[int]]:
    """Random prompts of real token ids: words through the server's tokenizer, then drawn at random."""
    text = " ".join(rng.choice(WORDS) for _ in range(400))
    async with client.post(f"{base_url}/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False},
                           headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"{base_url}/tokenize answered {response.status}: give --prompt-kind words, or "
                               "--vocab-size for a server without a tokenizer")
        tokens = (await response.json())["tokens"]
    return random_token_prompts(rng, num, length, sorted(set(tokens)))


async def _model_name(client: Any, base_url: str, headers: dict[str, str]) -> str:
    async with client.get(f"{base_url}/v1/models", headers=headers, raise_for_status=True) as response:
        return (await response.json())["data"][0]["id"]


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    base_url = args.base_url.rstrip("/")
    if base_url.endswith("/v1"):
        base_url = base_url[:-3]
    chat = args.endpoint == "chat"
    kind = args.prompt_kind or ("words" if chat else "tokens")
    if chat and kind == "tokens":
        raise ValueError("the chat endpoint takes text: use --prompt-kind words")
    for name in ("num_prompts", "input_len", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.num_clients < 1:
        raise ValueError("--num-clients must be at least 1")
    if args.num_clients > 1 and args.concurrency is not None and args.concurrency < args.num_clients:
        raise ValueError("--concurrency must be at least --num-clients (each client keeps its share in flight)")
    for name in ("concurrency", "vocab_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(args.seed)
    connections = args.concurrency or args.num_prompts
    async with _session(1, args.duration_limit) as client:
        model = args.model or await _model_name(client, base_url, headers)
        if kind == "tokens" and args.vocab_size:
            prompts: list[Any] = random_token_prompts(rng, args.num_prompts, args.input_len, range(args.vocab_size))
        elif kind == "tokens":
            prompts = await _token_prompts(client, base_url, model, headers, args.num_prompts, args.input_len, rng)
        else:
            prompts = [" ".join(rng.choice(WORDS) for _ in range(args.input_len)) for _ in range(args.num_prompts)]
        url = f"{base_url}/v1/chat/completions" if chat else f"{base_url}/v1/completions"
        common = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature,
                  "ignore_eos": not args.no_ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
        payloads = [{**common, "messages": [{"role": "user", "content": p}]} if chat else {**common, "prompt": p}
                    for p in prompts]

    if args.num_clients == 1:
        results = await _drive(url, payloads, headers, chat, args.concurrency, args.request_rate, args.seed,
                               args.duration_limit, time.perf_counter(), connections)
    else:
        results = await asyncio.to_thread(_drive_in_processes, args, url, payloads, headers, chat)
    duration = max((r.start + r.latency for r in results), default=0.0)
    summary = summarize(results, duration, args.num_prompts)
    summary["config"] = {"base_url": base_url, "endpoint": args.endpoint, "model": model, "prompt_kind": kind,
                         "vocab_size": args.vocab_size,
                         "num_prompts": args.num_prompts, "concurrency": args.concurrency,
                         "num_clients": args.num_clients,
                         "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
                         "input_len": args.input_len, "max_tokens": args.max_tokens,
                         "duration_limit": args.duration_limit, "ignore_eos": not args.no_ignore_eos}
    summary["requests"] = [asdict(r) for r in results]
    return summary


async def _drive(url: str, payloads: list[dict[str, Any]], headers: dict[str, str], chat: bool,
                 concurrency: int | None, request_rate: float, seed: int, duration_limit: float, t0: float,
                 connections: int, progress: bool = True) -> list[RequestResult]:
    """Send `payloads` (at most `concurrency` in flight, Poisson arrivals at `request_rate`) until done or
    `duration_limit` seconds after t0 (a time.perf_counter value); the requests not finished are cut off.
    progress: a bar of the finished requests on stderr."""
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(concurrency) if concurrency else None
    deadline = t0 + duration_limit
    async with _session(connections, duration_limit) as client:

        async def one(payload: dict[str, Any]) -> RequestResult:
            if semaphore is None:
                return await _send(client, url, payload, headers, t0, chat)
            async with semaphore:
                return await _send(client, url, payload, headers, t0, chat)

        tasks: list[asyncio.Task[RequestResult]] = []
        bar = tqdm(total=len(payloads), desc="requests", unit="req", disable=not progress, dynamic_ncols=True)
        for payload in payloads:
            if time.perf_counter() >= deadline:
                break
            tasks.append(asyncio.create_task(one(payload)))
            tasks[-1].add_done_callback(lambda _: bar.update(1))
            if math.isfinite(request_rate):
                await asyncio.sleep(min(rng.expovariate(request_rate), max(0.0, deadline - time.perf_counter())))
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter())) if tasks else (
            set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        bar.close()
    return [t.result() for t in tasks if not t.cancelled()]


def _client_process(job: tuple, ready: Any, go: Any, t0: Any, results: Any) -> None:
    """One process of --num-clients: once every client is up (`ready`) and rank 0 has set the common start
    `t0` (`go`), its share of the requests."""
    index, url, payloads, headers, chat, concurrency, request_rate, seed, duration_limit = job
    ready.wait()
    go.wait()
    time.sleep(max(0.0, t0.value - time.perf_counter()))
    connections = concurrency or len(payloads) or 1
    out = asyncio.run(_drive(url, payloads, headers, chat, concurrency, request_rate, seed, duration_limit,
                             t0.value, connections, progress=index == 0))  # (one bar: client 0's share)
    results.put((index, [asdict(r) for r in out]))


def _drive_in_processes(args: argparse.Namespace, url: str, payloads: list[dict[str, Any]],
                        headers: dict[str, str], chat: bool) -> list[RequestResult]:
    """The requests, the concurrency and the request rate split over args.num_clients processes that start
    together. Their times share one origin: time.perf_counter is the system's monotonic clock on Linux."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    n = args.num_clients
    ready, go, t0, queue = ctx.Barrier(n + 1), ctx.Barrier(n + 1), ctx.Value("d", 0.0), ctx.Queue()
    concurrency = [None if args.concurrency is None else args.concurrency // n + (i < args.concurrency % n)
                   for i in range(n)]
    processes = [ctx.Process(target=_client_process, daemon=True, args=(
        (i, url, payloads[i::n], headers, chat, concurrency[i], args.request_rate / n, args.seed + i,
         args.duration_limit), ready, go, t0, queue)) for i in range(n)]
    for process in processes:
        process.start()
    ready.wait(timeout=120)  # every client has started and imported what it needs
    t0.value = time.perf_counter() + 0.1
    go.wait(timeout=10)
    shares = dict(queue.get(timeout=args.duration_limit + 120) for _ in range(n))
    for process in processes:
        process.join()
    return [RequestResult(**r) for i in range(n) for r in shares[i]]


def _stats(values: list[float]) -> dict[str, float]:
    import numpy as np

    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(values) * 1000.0
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration: float, num_prompts: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    # The last successful request's end, not the cut-off: throughput over the time work was done.
    end = max((r.start + r.latency for r in ok), default=duration)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "cut_off": num_prompts - len(results),
        "duration_s": end,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / end if end > 0 else 0.0,
        "output_throughput": output_tokens / end if end > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / end if end > 0 else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2el_ms": _stats([r.latency for r in ok]),
        "errors": errors[:10],
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<40}{value:<10.2f}" if isinstance(value, float) else f"{label:<40}{value:<10}")

    row("Successful requests:", s["completed"])
    if s["failed"]:
        row("Failed requests:", s["failed"])
    if s["cut_off"]:
        row("Cut off by --duration-limit:", s["cut_off"])
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    for key, title, short in (("ttft_ms", "Time to First Token", "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-token Latency", "ITL"), ("e2el_ms", "End-to-end Latency", "E2EL")):
        lines.append("{s:{c}^50}".format(s=f" {title} ", c="-"))
        values = s[key]
        row(f"Mean {short} (ms):", values["mean"])
        row(f"Median {short} (ms):", values["median"])
        row(f"P90 {short} (ms):", values["p90"])
        row(f"P99 {short} (ms):", values["p99"])
    lines.append("=" * 50)
    for error in s["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import aiohttp

    try:
        summary = asyncio.run(run_benchmark(args))
    except (aiohttp.ClientError, OSError, RuntimeError) as e:
        print(f"error: cannot benchmark {args.base_url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(format_summary(summary), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tinyvllm bench serve", description=__doc__)
    add_cli_args(parser)
    sys.exit(main(parser.parse_args()))
