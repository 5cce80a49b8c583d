"""`tinyvllm serve` runs the engine core in a process of its own. If that process dies, the server does not
hang: requests in flight end with an error, /health answers 503, and the server exits non-zero."""

import os
import signal
import time

import httpx

from tests.test_server import _wait_healthy, serve


def core_pid(server_pid: int) -> int:
    """The engine core: the server's child process started by multiprocessing's spawn."""
    children = []
    for task in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{task}/children") as f:
            children += [int(pid) for pid in f.read().split()]
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().decode(errors="replace")
        if "spawn_main" in command:
            return pid
    raise AssertionError(f"no engine core process among the server's children {children}")


def test_the_server_fails_loudly_when_the_engine_process_dies(tiny_text_checkpoint, tmp_path):
    with serve(tmp_path, "--model", tiny_text_checkpoint, "--num-kv-blocks", "64", "--log-level", "warning") as srv:
        _wait_healthy(srv)
        http = httpx.Client(base_url=srv.url, timeout=60, trust_env=False)
        body = {"model": tiny_text_checkpoint, "prompt": "Once upon a time", "max_tokens": 4}
        assert http.post("/v1/completions", json=body).status_code == 200  # served by the core process
        with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 400, "stream": True,
                                                           "ignore_eos": True}) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # it is generating
            os.kill(core_pid(srv.process.pid), signal.SIGKILL)
            rest = "\n".join(lines)
        assert "aborted" in rest and "503" in rest and rest.rstrip().endswith("data: [DONE]"), rest[-500:]
        deadline = time.time() + 30
        health = None
        while time.time() < deadline and srv.process.poll() is None:
            try:
                health = http.get("/health").status_code
            except httpx.HTTPError:
                break
            time.sleep(0.1)
        assert srv.process.wait(30) != 0, srv.log()
        assert health in (None, 503)
        assert "engine" in srv.log() and "exit code" in srv.log()


def test_sigterm_stops_the_server_and_its_engine_process(tiny_text_checkpoint, tmp_path):
    with serve(tmp_path, "--model", tiny_text_checkpoint, "--num-kv-blocks", "64", "--log-level", "warning") as srv:
        _wait_healthy(srv)
        core = core_pid(srv.process.pid)
        srv.process.send_signal(signal.SIGTERM)
        assert srv.process.wait(60) == 0, srv.log()
        deadline = time.time() + 10
        while os.path.exists(f"/proc/{core}") and time.time() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{core}"), "the engine core outlived the server"
