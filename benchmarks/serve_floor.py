"""serve_floor (issue 17): the least time to first token that a server of `tinyvllm serve`'s design can give
at concurrency 1, with no engine at all, so that serve.py's figure can be read against it.

Two stand-in servers, each under uvicorn as `tinyvllm serve` runs it (httptools, uvloop when installed, no
access log), answer POST /v1/completions with one server-sent event and `data: [DONE]`:
- `http`: a bare ASGI app: the body is read and parsed (json), the event goes out. The floor of HTTP alone.
- `http+process`: the same, and between the parse and the event the request (its token ids) makes one round
  trip through a multiprocessing pipe to a second process that sends it straight back, read on the event loop
  with add_reader as AsyncLLMEngine reads its engine core. The floor of HTTP plus the engine process that
  issue 17 asks for, with a model that takes no time.
The client is serve.py's (`tinyvllm bench serve`, aiohttp, one process, streamed, 128-token prompts).

Peer: `benchmarks/latency.py`'s TTFT, in the same call (issue 17 asks for serve's TTFT within 10% of it).

    python benchmarks/serve_floor.py [--requests 400] [--json FILE]      (CPU or GPU host; needs uvicorn, aiohttp)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import time
from typing import Any

from common import commit
from serve import bench, free_port

_EVENT = b'data: {"id":"floor","object":"text_completion","choices":[{"index":0,"text":"a"}]}\n\n'
_DONE = b"data: [DONE]\n\n"
_MODELS = b'{"object":"list","data":[{"id":"floor","object":"model"}]}'


def _echo(conn: Any) -> None:
    """The stand-in engine process: every message straight back."""
    while True:
        try:
            conn.send(conn.recv())
        except (EOFError, OSError):
            return


def make_app(conn: Any | None) -> Any:
    """The stand-in server's ASGI app; with `conn`, each request makes a round trip through it first."""
    waiting: dict[str, asyncio.Future] = {}
    reader_added = False

    def on_readable() -> None:
        while conn.poll(0):
            request_id, _ = conn.recv()
            future = waiting.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result(None)

    async def app(scope: dict, receive: Any, send: Any) -> None:
        nonlocal reader_added
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        if scope["path"] == "/v1/models":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": _MODELS})
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        request = json.loads(body)
        if conn is not None:
            loop = asyncio.get_running_loop()
            if not reader_added:
                loop.add_reader(conn.fileno(), on_readable)
                os.set_blocking(conn.fileno(), True)
                reader_added = True
            request_id = str(id(request))
            waiting[request_id] = future = loop.create_future()
            conn.send((request_id, request["prompt"]))
            await future
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        await send({"type": "http.response.body", "body": _EVENT, "more_body": True})
        await send({"type": "http.response.body", "body": _DONE, "more_body": False})

    return app


def serve(mode: str, port: int) -> None:
    """Run one stand-in server until killed (in a subprocess of this script)."""
    import uvicorn

    conn = None
    if mode == "http+process":
        ctx = multiprocessing.get_context("spawn")
        conn, far = ctx.Pipe()
        ctx.Process(target=_echo, args=(far,), daemon=True).start()
        far.close()
    uvicorn.run(make_app(conn), host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="on")


def measure(mode: str, requests: int, input_len: int) -> dict[str, Any]:
    import httpx

    port = free_port()
    server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--server", mode, "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(f"{url}/v1/models", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError(f"the {mode} stand-in server did not start") from None
                time.sleep(0.2)
        bench(url, 1, 32, input_len, 1, 10_000, 1, 60.0)  # warm-up
        summary = bench(url, 1, requests, input_len, 1, 10_000, 0, 120.0)
    finally:
        server.kill()
        server.wait()
    ttft = summary["ttft_ms"]
    print(f"  {mode:<13} TTFT p50 {ttft['median']:.3f} ms, mean {ttft['mean']:.3f} ms, p90 {ttft['p90']:.3f} ms "
          f"({summary['completed']} requests)", flush=True)
    return {"mode": mode, "ttft_ms": ttft, "completed": summary["completed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each stand-in, alternated")
    parser.add_argument("--json", default=None)
    parser.add_argument("--server", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.server:
        serve(args.server, args.port)
        return
    print(f"serve_floor at {commit()}: concurrency 1, {args.requests} streamed requests of {args.input_len} tokens",
          flush=True)
    runs = [measure(mode, args.requests, args.input_len) for _ in range(args.repeat)
            for mode in ("http", "http+process")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": commit(), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
