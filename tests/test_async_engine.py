"""The server's streaming plumbing without a model: the engine core's per-step outputs (columns, concatenated
when several steps are read at once) and RequestStream, which merges the deltas its reader has not taken yet."""

import asyncio

import pytest

from tinyvllm.contract import EngineCoreOutputs
from tinyvllm.engine.async_engine import RequestStream
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import SamplingParams


class _Engine:
    """What a RequestStream asks of its AsyncLLMEngine."""

    def __init__(self) -> None:
        self.forgotten: list[str] = []
        self.aborted: list[str] = []

    def _forget(self, request_ids: list[str]) -> None:
        self.forgotten += request_ids

    def _abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids


def _delta(request_id: str, tokens: list[int], text: str, finish: str | None = None) -> RequestOutput:
    return RequestOutput(request_id, None, [7], [CompletionOutput(0, text, tokens, finish)], finish is not None,
                         RequestMetrics(arrival_time=1.0, last_token_time=float(len(tokens))))


def test_outputs_that_arrive_while_the_reader_is_busy_are_merged():
    async def run() -> list[RequestOutput]:
        stream = RequestStream(_Engine(), ["a", "b"])
        stream._put(_delta("a", [1], "x"))
        stream._put(_delta("b", [5], "p"))
        stream._put(_delta("a", [2, 3], "yz"))
        stream._put(_delta("b", [6], "q", "length"))
        stream._put(_delta("a", [4], "!", "stop"))
        return [output async for output in stream]

    outputs = asyncio.run(run())
    assert [(o.request_id, o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.finished)
            for o in outputs] == [("a", [1, 2, 3, 4], "xyz!", "stop", True), ("b", [5, 6], "pq", "length", True)]


def test_a_reader_that_keeps_up_gets_every_step_on_its_own():
    async def run() -> list[list[int]]:
        stream = RequestStream(_Engine(), ["a"])
        loop = asyncio.get_running_loop()
        for i, token in enumerate([1, 2, 3]):
            loop.call_later(0.01 * (i + 1), stream._put, _delta("a", [token], str(token), "length" if i == 2 else None))
        return [output.outputs[0].token_ids async for output in stream]

    assert asyncio.run(run()) == [[1], [2], [3]]


def test_a_failure_comes_after_the_output_already_there():
    async def run() -> tuple[list[int], BaseException | None]:
        engine = _Engine()
        stream = RequestStream(engine, ["a"])
        stream._put(_delta("a", [1], "x"))
        stream._fail("a", RuntimeError("core died"))
        first = await stream.__anext__()
        with pytest.raises(RuntimeError, match="core died"):
            await stream.__anext__()
        assert stream.finished
        return first.outputs[0].token_ids

    assert asyncio.run(run()) == [1]


def test_engine_core_outputs_concatenate_with_their_sparse_columns():
    first = EngineCoreOutputs()
    first.add("a", 0, 10)
    first.first[first.add("b", 0, 20)] = (16, 2.0, 3.0, 4.0)
    second = EngineCoreOutputs()
    entry = second.add("a", 0, 11)
    second.finished[entry] = ("length", None)
    second.logprobs[entry] = {11: Logprob(-0.5, 1)}
    first.extend(second)
    assert (first.request_ids, first.token_ids, len(first)) == (["a", "b", "a"], [10, 20, 11], 3)
    assert first.finished == {2: ("length", None)} and first.first == {1: (16, 2.0, 3.0, 4.0)}
    assert list(first.logprobs) == [2]


def test_the_output_processor_gives_one_delta_per_request_for_several_steps():
    processor = OutputProcessor(None)
    for request_id in ("a", "b"):
        processor.add_request(request_id, None, [1, 2], SamplingParams(max_tokens=3, logprobs=0), "delta", 0.0)
    outputs = EngineCoreOutputs()
    for step in range(3):
        for request_id in ("a", "b"):
            entry = outputs.add(request_id, 0, 100 * step + ord(request_id))
            outputs.logprobs[entry] = {100 * step + ord(request_id): Logprob(-1.0, 1)}
            if step == 0:
                outputs.first[entry] = (0, 0.25, 0.5, 0.75)
            if step == 2:
                outputs.finished[entry] = ("length", None)
    results, stopped = processor.process(outputs)
    assert not stopped and not processor.requests
    assert [(r.request_id, r.outputs[0].token_ids, r.outputs[0].finish_reason, r.finished) for r in results] == [
        ("a", [97, 197, 297], "length", True), ("b", [98, 198, 298], "length", True)]
    assert results[0].outputs[0].cumulative_logprob == -3.0 and results[0].metrics.first_scheduled_time == 0.5
    m = results[0].metrics
    assert (m.queued_time, m.first_token_engine_time) == (0.25, 0.75) and m.first_token_time is not None


def test_a_large_core_message_that_arrives_in_pieces_is_read_whole_on_uvloop(tiny_text_checkpoint):
    """The event loop reads the core's pipe when it is readable; uvloop makes that descriptor non-blocking, so a
    message whose first bytes are there and whose rest comes later must still be read whole, not taken for the
    core's death. Here the test plays the core: it answers a request with a ~1 MB message sent in two parts."""
    import multiprocessing
    import pickle
    import socket
    import struct
    import threading
    import time

    import uvloop

    from tinyvllm.config import EngineConfig
    from tinyvllm.engine.async_engine import AsyncLLMEngine
    from tinyvllm.engine.llm_engine import LLMEngine

    server_end, core_end = multiprocessing.Pipe()
    stats = {"num_requests_running": 0.0}

    def core() -> None:
        core_end.send(("ready", 4096, stats))
        command, request_id, *_ = core_end.recv()
        assert command == "add_request"
        outputs = EngineCoreOutputs()
        outputs.finished[outputs.add(request_id, 0, 42)] = ("length", None)
        payload = pickle.dumps(("outputs", outputs, {**stats, **{f"padding{i}": 0.0 for i in range(40_000)}}))
        wire = struct.pack("!i", len(payload)) + payload  # (multiprocessing.Connection's framing)
        sock = socket.socket(fileno=core_end.fileno())
        try:
            sock.sendall(wire[: len(wire) // 2])
            time.sleep(0.3)
            sock.sendall(wire[len(wire) // 2:])
        finally:
            sock.detach()
        try:
            core_end.recv()  # until the API side stops the core or closes its end
        except EOFError:
            pass

    thread = threading.Thread(target=core, daemon=True)
    thread.start()
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=tiny_text_checkpoint, device="cpu"),
                                      core_connection=server_end))

    async def run() -> list[int]:
        engine.start()
        processed = engine.input_processor.process([1, 2, 3], SamplingParams(max_tokens=1), decode_prompt=False)
        stream = await engine.add_requests([("big", processed)])
        return [token for output in [o async for o in stream] for token in output.outputs[0].token_ids]

    try:
        assert uvloop.run(run()) == [42]
        assert engine.dead_reason is None and len(engine.get_stats()) > 40_000
    finally:
        engine.shutdown()
        thread.join(5)
