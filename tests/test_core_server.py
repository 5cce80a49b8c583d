"""The engine core process's side of its connections (core_client._CoreServer), over real pipes with a stand-in
core: each API process gets its own requests' tokens and nothing of the others', everyone hears when the core
goes idle, nothing is kept of finished requests, one API process going away leaves the others served, and a
request the core fails on fails alone, reported to the API process that sent it."""

import multiprocessing
import threading
import time

from tinyvllm.contract import EngineCoreOutputs
from tinyvllm.engine.core_client import _CoreServer


class StandInCore:
    """EngineCore's interface: every request gets one token per step and finishes after `params` tokens."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}
        self.errors: dict[str, str] = {}
        self.steps = 0

    def get_stats(self) -> dict[str, float]:
        return {"num_requests_running": float(len(self.requests)), "steps": float(self.steps)}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.errors)

    def add_request(self, request_id: str, prompt: list[int], params: int) -> None:
        if params < 0:
            raise ValueError("a request the stand-in cannot take")
        self.requests[request_id] = params

    def fail_request(self, request_id: str, message: str) -> None:
        self.requests.pop(request_id, None)
        self.errors[request_id] = message

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def finish_sequence(self, request_id: str, *args: object) -> None:
        self.requests.pop(request_id, None)

    def step(self) -> EngineCoreOutputs:
        time.sleep(0.002)
        self.steps += 1
        out, self.errors = EngineCoreOutputs(errors=self.errors), {}
        for request_id in list(self.requests):
            entry = out.add(request_id, 0, self.steps)
            self.requests[request_id] -= 1
            if not self.requests[request_id]:
                out.finished[entry] = ("length", None)
                del self.requests[request_id]
        return out


def start(*commands: list[tuple]) -> tuple[_CoreServer, StandInCore, threading.Thread, list]:
    """A core with one connection per list of commands, each sent before it starts (so that the first step
    finds them all)."""
    pipes = [multiprocessing.Pipe() for _ in commands]
    for (client_end, _), sent in zip(pipes, commands):
        for command in sent:
            client_end.send(command)
    server, core = _CoreServer([core_end for _, core_end in pipes]), StandInCore()
    thread = threading.Thread(target=server.run, args=(core,), daemon=True)
    thread.start()
    return server, core, thread, [client_end for client_end, _ in pipes]


def read_until_idle(conn, timeout: float = 10.0, errors: dict[str, str] | None = None
                    ) -> tuple[dict[str, list[int]], dict[str, float]]:
    """Tokens per request from `conn`'s messages, until one reports an idle core; and that report's figures. The
    messages' errors go into `errors`."""
    tokens: dict[str, list[int]] = {}
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert conn.poll(deadline - time.time()), "no message from the core"
        kind, outputs, stats = conn.recv()
        assert kind == "outputs"
        for request_id, token in zip(outputs.request_ids, outputs.token_ids):
            tokens.setdefault(request_id, []).append(token)
        if errors is not None:
            errors.update(outputs.errors)
        if not stats["num_requests_running"]:
            return tokens, stats
    raise AssertionError("the core never reported idle")


def test_one_api_process_gets_every_token_and_nothing_is_kept():
    server, core, thread, (conn,) = start([("add_request", f"r{i}", [1, 2], 3) for i in range(20)])
    tokens, stats = read_until_idle(conn)
    assert sorted(tokens) == sorted(f"r{i}" for i in range(20)) and all(len(t) == 3 for t in tokens.values())
    conn.send(("stop",))
    thread.join(5)
    assert not thread.is_alive()
    assert server.owners == {}  # (finished requests are forgotten)


def test_two_api_processes_get_their_own_tokens_and_both_hear_the_core_go_idle():
    server, core, thread, (a, b) = start([("add_request", f"a{i}", [1], 4) for i in range(5)], [])
    tokens_a, stats_a = read_until_idle(a)
    tokens_b, stats_b = read_until_idle(b)  # b had no request: it gets the figures, and the idle report
    assert sorted(tokens_a) == [f"a{i}" for i in range(5)] and not tokens_b
    assert stats_a == stats_b and stats_b["steps"] == core.steps
    a.close()
    b.close()
    thread.join(5)
    assert not thread.is_alive()  # (every connection closed: the core stops)
    assert server.owners == {}


def test_an_api_process_that_goes_away_loses_its_requests_and_the_others_go_on():
    server, core, thread, (a, b) = start([("add_request", "long", [1], 10_000)], [("add_request", "b0", [1], 50)])
    assert a.poll(5)
    a.close()  # gone mid-run, with its request unfinished
    tokens, _ = read_until_idle(b)
    assert tokens == {"b0": tokens["b0"]} and len(tokens["b0"]) == 50
    assert thread.is_alive()
    b.send(("stop",))
    thread.join(5)
    assert "long" not in core.requests and server.owners == {}


def test_a_request_the_core_fails_on_fails_alone_and_its_sender_hears_it():
    server, core, thread, (a, b) = start([("add_request", "a0", [1], 5), ("add_request", "bad", [1], -1)],
                                         [("add_request", "b0", [1], 5)])
    errors_a: dict[str, str] = {}
    errors_b: dict[str, str] = {}
    tokens_a, _ = read_until_idle(a, errors=errors_a)
    tokens_b, _ = read_until_idle(b, errors=errors_b)
    assert tokens_a == {"a0": [1, 2, 3, 4, 5]} and tokens_b == {"b0": [1, 2, 3, 4, 5]}
    assert list(errors_a) == ["bad"] and "cannot take" in errors_a["bad"] and not errors_b
    assert thread.is_alive()
    a.send(("stop",))
    thread.join(5)
    assert server.owners == {}
