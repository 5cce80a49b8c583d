"""`tinyvllm serve --api-server-count 2`: two API server processes in front of one engine core, on one port.
Requests through either give the offline engine's greedy text, /metrics counts every API server's requests,
and the launcher stops everything: on SIGTERM with exit 0, and with a non-zero exit when the core dies."""

import concurrent.futures
import os
import re
import signal
import time

import httpx
import pytest

from tests.test_server import _wait_healthy, serve

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The capital of France is", "def main():", "Roses are red,"]
ARGS = ("--api-server-count", "2", "--num-kv-blocks", "256", "--max-num-seqs", "16", "--log-level", "info")


def children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


def api_servers_and_core(launcher: int) -> tuple[list[int], list[int]]:
    """The launcher's children: the API servers lead process groups of their own (they leave the launcher's,
    so that a terminal's Ctrl-C reaches the launcher alone); the engine core does not."""
    kids = [pid for pid in children(launcher) if "spawn_main" in open(f"/proc/{pid}/cmdline").read()]
    return [p for p in kids if os.getpgid(p) == p], [p for p in kids if os.getpgid(p) != p]


def gone(pids: list[int], timeout: float = 15.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.1)
    return not any(os.path.exists(f"/proc/{p}") for p in pids)


def test_two_api_servers_share_one_engine_core(tiny_text_checkpoint, tiny_text_llm, tmp_path):
    from tinyvllm import SamplingParams

    expected = {o.prompt: o.outputs[0].text for o in tiny_text_llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)}
    with serve(tmp_path, "--model", tiny_text_checkpoint, *ARGS) as srv:
        _wait_healthy(srv)
        servers, cores = api_servers_and_core(srv.process.pid)
        assert len(servers) == 2 and len(cores) == 1, (servers, cores)

        def complete(i: int) -> tuple[str, str]:
            prompt = PROMPTS[i % len(PROMPTS)]
            body = {"model": tiny_text_checkpoint, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True, "stream": i % 2 == 0}
            with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as http:  # a connection of its own
                if not body["stream"]:
                    return prompt, http.post("/v1/completions", json=body).json()["choices"][0]["text"]
                text = []
                with http.stream("POST", "/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            text += [c["text"] for c in httpx.Response(200, content=line[6:]).json()["choices"]]
                return prompt, "".join(text)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(complete, range(48)))
        assert all(text == expected[prompt] for prompt, text in results), \
            [(p, t, expected[p]) for p, t in results if t != expected[p]][:3]
        # /metrics, whichever API server answers it, counts the requests of both.
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30, trust_env=False).text
        assert re.search(r'request_success_total\{finished_reason="length",model_name="[^"]*"\} 48\.0', metrics), \
            metrics[-2000:]
        # Both API servers answered requests (the access log names the process).
        pids = set(re.findall(r"\[pid (\d+)\]: 127\.0\.0\.1:\d+ - \"POST /v1/completions", srv.log(None)))
        assert pids == {str(p) for p in servers}, (pids, servers)
        # Tokens stream as they come, not in one piece at the end.
        body = {"model": tiny_text_checkpoint, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as http:
            start, arrivals = time.perf_counter(), []
            with http.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.perf_counter() - start)
        assert len(arrivals) > 10 and arrivals[0] < 0.5 * arrivals[-1], (len(arrivals), arrivals[0], arrivals[-1])
        srv.process.send_signal(signal.SIGTERM)
        assert srv.process.wait(60) == 0, srv.log()
        assert gone(servers + cores), "an API server or the engine core outlived the launcher"


def test_the_launcher_exits_non_zero_when_the_engine_core_dies(tiny_text_checkpoint, tmp_path):
    with serve(tmp_path, "--model", tiny_text_checkpoint, *ARGS) as srv:
        _wait_healthy(srv)
        servers, (core,) = api_servers_and_core(srv.process.pid)
        os.kill(core, signal.SIGKILL)
        assert srv.process.wait(60) != 0, srv.log()
        assert gone(servers), "an API server outlived the engine core and the launcher"
        assert "the engine died" in srv.log(), srv.log()


def test_the_shared_socket_gets_connections_without_nagle():
    """The launcher's listening socket is made as asyncio makes its own, so that asyncio sets TCP_NODELAY on
    each connection (a socket made without TCP's protocol number kept Nagle's algorithm on: small stream
    chunks then waited ~40 ms for the client's delayed ACK)."""
    import asyncio
    import socket

    from tinyvllm.entrypoints.openai.launcher import _listening_socket

    async def nodelay() -> int:
        sock = _listening_socket("127.0.0.1", 0)
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await asyncio.start_server(connected, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        value = await asyncio.wait_for(accepted, 10)
        writer.close()
        server.close()
        return value

    assert asyncio.run(nodelay()) == 1
