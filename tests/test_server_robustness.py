"""The server under one bad request (issue 14): a huge body is refused without stalling the others (the body
is capped, and parsing, tokenizing and chat templates run on an input thread, off the event loop; a text too
long to fit is refused before it is tokenized), aborted requests are counted, and requests are logged.

One `tinyvllm serve` of the embedded model (as tests/test_server.py's, with its helpers, at the default log
level so that the access log shows), a small one of a random-weight model with --no-access-log, and an
in-process app for the shutdown that aborts requests in flight."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.test_server import API_KEY, _assert_error, _wait_healthy, finished_counts, httpx, serve

pytestmark = pytest.mark.slow

BIG = 10 * 2**20  # the 10 MB body of the issue: under the default 16 MB cap, far over what fits the context
CAP = 16 * 2**20  # the default --max-request-body-mb


@pytest.fixture(scope="module")
def robust(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("robust"), "--api-key", API_KEY, "--num-kv-blocks", "256",
               "--max-num-seqs", "16") as srv:
        _wait_healthy(srv)
        yield srv


def _head(path: str, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {API_KEY}",
             "Content-Type: application/json", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status(sock: socket.socket) -> int:
    """The status of the response the server sent (the socket has a timeout: a server that waits for more
    of the body fails the test)."""
    first = sock.recv(65536).split(b"\r\n", 1)[0]
    return int(first.split()[1])


# ---- one huge request, and the others meanwhile -------------------------------------------------------------
@contextlib.contextmanager
def _repeating(fn: Callable[[], Any]) -> Iterator[list[Any]]:
    """Calls fn() over and over on a thread of its own while the block runs: yields the list of its results
    so far. An exception in fn fails the test once the block ends."""
    results: list[Any] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def loop() -> None:
        try:
            while not stop.is_set():
                results.append(fn())
        except BaseException as e:
            failures.append(e)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        yield results
    finally:
        stop.set()
        thread.join(60)
    if failures:
        raise failures[0]


def test_10mb_body_leaves_health_and_streams_alone(robust):
    """While a 10 MB body is in flight and refused (one after another, each uploaded over ~0.5 s, as over a
    fast network), /health (polled throughout) and normal streaming requests answer within twice their usual
    time (plus a little): before the input thread, parsing and tokenizing such a body held the event loop for
    13 s, and /health waited 11 s. (Bodies sent back to back as fast as loopback goes, ~50 a second, would
    measure the CPU the two cores have left instead.)"""
    big = b'{"model": "%s", "max_tokens": 4, "prompt": "' % robust.model.encode() + b"x" * BIG + b'"}'
    stream_body = {"model": robust.model, "prompt": "The capital of France is", "max_tokens": 8,
                   "temperature": 0, "ignore_eos": True, "stream": True}
    health_client, stream_client, big_client = robust.http(), robust.http(), robust.http()

    def health() -> float:
        time.sleep(0.05)
        start = time.perf_counter()
        assert health_client.get("/health").status_code == 200
        return time.perf_counter() - start

    def stream() -> float:
        start = time.perf_counter()
        with stream_client.stream("POST", "/v1/completions", json=stream_body) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 2
        return time.perf_counter() - start

    def measure() -> tuple[list[float], list[float]]:
        with _repeating(health) as healths:
            streams = [stream() for _ in range(4)]
        return healths, streams

    def paced() -> Iterator[bytes]:  # 64 KiB every ~3 ms: about half a second for the 10 MB
        for offset in range(0, len(big), 2**16):
            yield big[offset:offset + 2**16]
            time.sleep(0.003)

    def refuse_big_body() -> float:
        start = time.perf_counter()
        response = big_client.post("/v1/completions", content=paced())
        _assert_error(response, 400, "prompt")
        assert "10,485,760 characters" in response.json()["error"]["message"]
        return time.perf_counter() - start

    stream()  # warm up
    base_health, base_stream = measure()
    with _repeating(refuse_big_body) as refusals:
        deadline = time.time() + 60
        while not refusals and time.time() < deadline:  # the first one through: they are coming in
            time.sleep(0.01)
        loaded_health, loaded_stream = measure()
        measured = len(refusals)
    for client in (health_client, stream_client, big_client):
        client.close()
    report = (f"/health {max(base_health) * 1000:.1f} ms alone, {max(loaded_health) * 1000:.1f} ms under load "
              f"(max of {len(base_health)} and {len(loaded_health)}); stream {max(base_stream) * 1000:.0f} ms alone, "
              f"{max(loaded_stream) * 1000:.0f} ms under load (max of 4); {len(refusals)} 10 MB bodies refused "
              f"({measured - 1} during the measurement), each in {min(refusals) * 1000:.0f}-"
              f"{max(refusals) * 1000:.0f} ms from its first byte sent")
    print(report)
    assert max(loaded_health) <= 2 * max(base_health) + 0.25, report
    assert max(loaded_stream) <= 2 * max(base_stream) + 0.5, report
    assert measured >= 2 and max(refusals) < 5.0, report  # refused from its length, never tokenized (~13 s)


def test_body_cap(robust):
    """Over --max-request-body-mb (16 by default): 413 before reading a body whose Content-Length says so,
    and as soon as a chunked one passes the cap; an unauthenticated client gets 401 first."""
    with socket.create_connection(("127.0.0.1", robust.port), timeout=10) as sock:
        sock.sendall(_head("/v1/completions", f"Content-Length: {10**12}"))  # and not a byte of the body
        assert _status(sock) == 413
    with socket.create_connection(("127.0.0.1", robust.port), timeout=10) as sock:
        sock.sendall(_head("/v1/completions", f"Content-Length: {10**12}").replace(API_KEY.encode(), b"wrong"))
        assert _status(sock) == 401
    with socket.create_connection(("127.0.0.1", robust.port), timeout=10) as sock:
        sock.sendall(_head("/v1/completions", "Transfer-Encoding: chunked"))
        chunk = b"x" * 2**20
        for _ in range(CAP // len(chunk) + 1):  # one MB past the cap, and no end of the body
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        assert _status(sock) == 413
    response = robust.http().post("/v1/completions", content=b" " * (CAP + 1))  # a client reads the answer
    _assert_error(response, 413, None)
    assert "16 MB" in response.json()["error"]["message"]
    # the cap is on the bytes: a body just under it is parsed (and refused for what it says)
    _assert_error(robust.http().post("/v1/completions", content=b" " * (CAP - 10) + b"[]"), 400, "any")


def test_too_long_text_refused_before_tokenizing(robust):
    """A text longer than the context could hold, at the longest token's length, is a 400 that says the
    limit, for completions, chat and /tokenize alike; a long text under it goes through the tokenizer."""
    http = robust.http()
    max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    long = "word " * 200_000  # 1,000,000 characters
    cases = [("/v1/completions", {"prompt": long}, "prompt"),
             ("/v1/completions", {"prompt": ["Hi", long]}, "prompt"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}, "messages"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": long}]}]},
              "messages"),
             ("/tokenize", {"prompt": long}, "prompt")]
    for path, body, param in cases:
        response = http.post(path, json={"model": robust.model, **body})
        _assert_error(response, 400, param)
        message = response.json()["error"]["message"]
        assert "1,000,000 characters" in message and f"context of {max_model_len} tokens" in message, message
        limit = int(re.search(r"more than the ([\d,]+) that could fit", message).group(1).replace(",", ""))
    assert max_model_len * 10 < limit < 1_000_000
    # under the character limit, the tokens decide: counted, then refused as too many
    under = "word " * (max_model_len + 10)
    response = http.post("/v1/completions", json={"model": robust.model, "prompt": under, "max_tokens": 1})
    _assert_error(response, 400, "prompt")
    assert "tokens" in response.json()["error"]["message"] and "characters" not in response.json()["error"]["message"]
    assert http.post("/tokenize", json={"prompt": under}).json()["count"] > max_model_len


def test_access_log(robust):
    """Each request is one line of the server's log (client, method, path, status, duration in ms), on by
    default; the errors and the refused bodies included."""
    http = robust.http()
    http.get("/health").raise_for_status()
    http.get("/v1/models").raise_for_status()
    http.post("/v1/completions", json={"model": robust.model, "prompt": "Hi", "max_tokens": 1}).raise_for_status()
    _assert_error(http.post("/v1/completions", content=b"{"), 400)
    _assert_error(robust.http(key=None).post("/v1/completions", json={"prompt": "Hi"}), 401)
    with socket.create_connection(("127.0.0.1", robust.port), timeout=10) as sock:
        sock.sendall(_head("/v1/completions", f"Content-Length: {10**12}"))
        assert _status(sock) == 413
    time.sleep(0.2)
    log = robust.log(tail=None)
    line = r'INFO tinyvllm\.access: 127\.0\.0\.1:\d+ - "{} {} HTTP/1\.1" {} \d+\.\d ms'
    for method, path, status in (("GET", "/health", 200), ("POST", "/v1/completions", 401),
                                 ("POST", "/v1/completions", 413), ("POST", "/v1/completions", 400),
                                 ("POST", "/v1/completions", 200), ("GET", "/v1/models", 200)):
        assert re.search(line.format(method, re.escape(path), status), log), (method, path, status, log[-2000:])


# ---- a small server, without the access log -----------------------------------------------------------------
def test_no_access_log_flag(tiny_text_checkpoint, tmp_path):
    with serve(tmp_path, tiny_text_checkpoint, "--device", "cpu", "--num-kv-blocks", "64", "--log-level", "info",
               "--no-access-log") as srv:
        _wait_healthy(srv)
        with httpx.Client(base_url=srv.url, trust_env=False, timeout=60) as http:
            assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
            assert http.get("/health").status_code == 200
        srv.process.send_signal(signal.SIGINT)
        assert srv.process.wait(30) == 0
        log = srv.log(tail=None)
    assert "Application startup complete" in log, log  # info lines are logged: just not the requests
    assert "tinyvllm.access" not in log and "/v1/completions" not in log, log
    assert "nanobind" not in log, log  # (the engine core's frozen objects are collected at exit: no leak report)


# ---- shutdown aborts, counted -------------------------------------------------------------------------------
def test_shutdown_aborts_are_counted(tiny_text_checkpoint):
    """The server's shutdown aborts the requests in flight (a stream and a request of n=2 here): three
    completions under request_success_total{finished_reason="abort"}."""
    from tinyvllm.config import EngineConfig
    from tinyvllm.engine.async_engine import AsyncLLMEngine
    from tinyvllm.entrypoints.openai.api_server import build_app

    engine = AsyncLLMEngine.from_config(EngineConfig.from_kwargs(model=tiny_text_checkpoint, device="cpu",
                                                                 num_kv_blocks=128))
    app = build_app(engine, "tiny", None, max_body_mb=1)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}

    async def run() -> tuple[Any, Any, str]:
        engine.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tiny") as client:
                plain = asyncio.create_task(client.post("/v1/completions", json={**body, "n": 2}))
                streamed = asyncio.create_task(client.post("/v1/completions", json={**body, "stream": True}))
                deadline = time.time() + 60
                while engine.num_active_requests < 2 or not engine.get_stats().get("generation_tokens"):
                    assert time.time() < deadline
                    await asyncio.sleep(0.01)
                engine.stop_accepting()  # what SIGINT/SIGTERM does
                return await plain, await streamed, (await client.get("/metrics")).text
        finally:
            await asyncio.to_thread(engine.shutdown)

    plain, streamed, metrics = asyncio.run(run())
    _assert_error(plain, 503, None)
    assert "aborted" in plain.json()["error"]["message"]
    events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert "aborted" in events[-2] and events[-1] == "data: [DONE]"
    assert finished_counts(metrics) == {"abort": 3.0}


# ---- the character limit itself -----------------------------------------------------------------------------
def test_check_text_length(smol_tokenizer_dir):
    from transformers import AutoTokenizer

    from tinyvllm.engine.input_processor import InputError, InputProcessor

    tokenizer = AutoTokenizer.from_pretrained(smol_tokenizer_dir)
    inputs = InputProcessor(tokenizer, len(tokenizer), max_model_len=4, kv_capacity_tokens=10**6)
    longest = max(len(token) for token in tokenizer.get_vocab())
    assert inputs.max_token_chars == longest
    limit = 4 * longest
    inputs.check_text_length("x" * limit)  # could still be 4 tokens
    with pytest.raises(InputError, match=f"{limit + 1:,} characters: more than the {limit:,}") as caught:
        inputs.check_text_length("x" * (limit + 1))
    assert caught.value.param == "prompt"
    conversation = [{"role": "system", "content": "x" * limit},
                    {"role": "user", "content": [{"type": "text", "text": "y"}]}]
    with pytest.raises(InputError) as caught:
        inputs.check_text_length(conversation, "messages")
    assert caught.value.param == "messages"
    inputs.check_text_length(conversation[:1], "messages")
    # as before: a text the length rule lets through is tokenized, and its tokens decide
    assert len(inputs.tokenize("x" * limit)[1]) > 4
    InputProcessor(None, 100, 4, 100).check_text_length("x" * 10**6)  # no tokenizer: tokenize refuses text
