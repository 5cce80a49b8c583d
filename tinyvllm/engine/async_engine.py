"""AsyncLLMEngine: the engine behind an asyncio server, driven by the event loop itself (as vLLM V1's AsyncLLM).

The engine core (scheduler and model steps) runs in a process of its own (engine/core_client.py); this process
keeps the input and output processing. Requests go to the core from the event loop as they come (a pipe
message each), and the loop reads the core's pipe whenever it is readable (add_reader): a message is one step's
tokens for every request, which the output processor turns into RequestOutputs (detokenized, stop strings
checked); each lands in the RequestStream that asked for it, merged with any earlier one its reader has not
taken yet. No thread stands between the loop and the core: a hand-off between two threads of one process
waits for the GIL (benchmarks/RESULTS.md has what a hop costs).

    add_requests() --pipe--> engine core process --pipe--> _on_core_output(): OutputProcessor -> RequestStream
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

from tinyvllm.config import EngineConfig
from tinyvllm.engine.core_client import EngineCoreClient, EngineCoreDeadError
from tinyvllm.engine.input_processor import InputProcessor, ProcessedInput, PromptType
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine has stopped (shut down, or its core process died): no request can be served."""


class RequestAbortedError(RuntimeError):
    """The server aborted the request (it is shutting down, or the engine failed) before it finished."""


# What clients are told when the engine cannot serve them (the details, a traceback perhaps, go to the log only)
ENGINE_DIED = "the engine failed and the server is stopping (the server's log has the details)"
ENGINE_STOPPED = "the engine has stopped"


class RequestStream:
    """The outputs of one or more engine requests (one per prompt of an HTTP request); iteration ends when all
    have finished. Outputs that arrive while the reader is busy are merged, per request, into one (so a reader
    slower than the engine gets fewer, larger deltas, and never a backlog of one output per step). `abort()`
    stops whatever is unfinished: call it in a `finally`, it does nothing once everything has finished.
    (Touched on the event loop only.)"""

    def __init__(self, engine: AsyncLLMEngine, request_ids: list[str]) -> None:
        self._engine = engine
        self.request_ids = request_ids
        self._pending: dict[str, RequestOutput] = {}  # not read yet, one merged output per request
        self._failures: dict[str, BaseException] = {}  # raised once the request's pending output is read
        self._waiter: asyncio.Future[None] | None = None
        self._unfinished = set(request_ids)

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while self._unfinished:
            if self._pending:
                request_id = next(iter(self._pending))
                output = self._pending.pop(request_id)
                if output.finished:
                    self._unfinished.discard(request_id)
                    self._engine._forget([request_id])
                return output
            if self._failures:
                request_id, error = self._failures.popitem()
                self._unfinished.discard(request_id)  # the engine has already dropped it
                self.abort()
                raise error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        raise StopAsyncIteration

    def abort(self) -> None:
        if self._unfinished:
            ids = list(self._unfinished)
            self._unfinished.clear()
            self._engine._forget(ids)
            self._engine._abort(ids)

    def _put(self, output: RequestOutput) -> None:
        pending = self._pending.get(output.request_id)
        if pending is None:
            self._pending[output.request_id] = output
        else:
            pending.add(output)
        self._wake()

    def _fail(self, request_id: str, error: BaseException) -> None:
        self._failures.setdefault(request_id, error)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class AsyncLLMEngine:
    """Streams RequestOutputs with output_kind="delta" (each carries only what is new) to asyncio code. Everything
    but shutdown() runs on the event loop that start() was called from."""

    def __init__(self, engine: LLMEngine) -> None:
        if not isinstance(engine.engine_core, EngineCoreClient):
            raise ValueError("AsyncLLMEngine needs the engine core in a process of its own (core_process=True)")
        self.engine = engine
        self._core: EngineCoreClient = engine.engine_core
        # A private copy for the server's input thread, which tokenizes and renders chat templates while the
        # event loop detokenizes with the engine's own (a fast tokenizer is not safe to share).
        self.tokenizer: Any = copy.deepcopy(engine.tokenizer)
        ip = engine.input_processor
        self.input_processor = InputProcessor(self.tokenizer, ip.vocab_size, ip.max_model_len, ip.kv_capacity_tokens,
                                              ip.max_n)
        self.model_path = engine.model_path
        self.max_model_len = engine.max_model_len
        self.model_config = engine.model_config
        self._streams: dict[str, RequestStream] = {}  # whose outputs go where
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._accepting = True
        self._closed = False
        self.dead_reason: str | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, core_connection: Any = None) -> AsyncLLMEngine:
        """Start the engine core in a process of its own, or (core_connection) use one that another process
        started for several API servers."""
        return cls(LLMEngine(config, core_process=True, core_connection=core_connection))

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Read the engine core's outputs on the running event loop, and deliver them there."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        fd = self._core.fileno()
        self._loop.add_reader(fd, self._on_core_output)
        # uvloop's add_reader makes the descriptor non-blocking; a message is read whole once its first bytes
        # are there, so a large one that arrives in pieces must block until its last, not fail.
        os.set_blocking(fd, True)

    @property
    def accepting(self) -> bool:
        """False once the server has begun shutting down."""
        return self._accepting

    @property
    def is_running(self) -> bool:
        return self._loop is not None and not self._closed and self.dead_reason is None

    def stop_accepting(self, reason: str = "the server is shutting down") -> None:
        """Refuse new requests and abort those in flight. Safe in a signal handler: it sets a flag and leaves
        the aborts to the event loop."""
        self._accepting = False
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._abort_all, reason)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything and stop the engine core (once its last API server has gone, if it is shared).
        Callable from any thread: the event loop's part runs on the loop."""
        self._accepting = False
        loop = self._loop
        if loop is not None and loop.is_running() and threading.get_ident() != self._loop_thread:
            try:
                asyncio.run_coroutine_threadsafe(self._close_on_loop(), loop).result(timeout)
            except Exception:  # (the loop stopped meanwhile, or took too long: the core stops regardless)
                logger.exception("closing the engine on its event loop failed")
        else:
            self._close()
        self.engine.shutdown()

    async def _close_on_loop(self) -> None:
        self._close()

    def _close(self) -> None:
        """Fail what is in flight and stop reading the core (on the event loop, or with none running)."""
        if self._closed:
            return
        self._closed = True
        if self.dead_reason is None:
            self._abort_all("the server is shutting down")
        self.dead_reason = self.dead_reason or ENGINE_STOPPED
        self._stop_reading()
        self._fail(list(self._streams), EngineDeadError(ENGINE_STOPPED))

    def _stop_reading(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.remove_reader(self._core.fileno())
            except (OSError, ValueError):  # (the connection is closed already)
                pass

    def _die(self, error: EngineCoreDeadError) -> None:
        """The engine core is gone: fail everything; the server answers 503 and exits (api_server.py)."""
        if self.dead_reason is not None:
            return
        self.dead_reason = f"{type(error).__name__}: {error}"
        logger.error("the engine core died: %s", error)
        self._stop_reading()
        self._fail(list(self._streams), EngineDeadError(ENGINE_DIED))

    # ---- requests ---------------------------------------------------------------------------------
    async def add_requests(self, requests: Sequence[tuple[str, ProcessedInput]]) -> RequestStream:
        """Send requests (request_id, input checked by self.input_processor) to the engine core and return the
        stream of their outputs. If the engine refuses any of them (ValueError), none is kept and the error is
        raised here, before any output."""
        if not self._accepting:
            raise EngineDeadError("the server is shutting down")
        if not self.is_running:
            raise EngineDeadError(ENGINE_DIED if self.dead_reason else "the engine has not started")
        ids = [request_id for request_id, _ in requests]
        if len(set(ids)) != len(ids) or any(i in self._streams for i in ids):
            raise ValueError("request ids must be unique")
        stream = RequestStream(self, ids)
        added: list[str] = []
        try:
            for request_id, processed in requests:
                self.engine.add_processed_request(request_id, processed, output_kind="delta")
                added.append(request_id)
                self._streams[request_id] = stream
                if len(added) % 64 == 0:  # (a request of many prompts lets the loop serve the others meanwhile)
                    await asyncio.sleep(0)
        except EngineCoreDeadError as e:
            self._die(e)
            raise EngineDeadError(ENGINE_DIED) from e
        except BaseException:
            self._forget(added)
            self._abort(added)
            raise
        return stream

    async def generate(self, request_id: str, prompt: PromptType,
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """One request's outputs as the engine produces them; leaving the loop early aborts it."""
        processed = self.input_processor.process(prompt, params, decode_prompt=False)
        stream = await self.add_requests([(request_id, processed)])
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (nothing happens if it is unknown or already finished)."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.abort()
        else:
            self._abort([request_id])

    def get_stats(self) -> dict[str, float]:
        """The engine's counters and gauges as of the core's latest message."""
        return self._core.stats

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    def _forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._streams.pop(request_id, None)

    def _abort(self, request_ids: list[str]) -> None:
        if self.dead_reason is not None:
            return  # (nothing runs any more)
        try:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
        except EngineCoreDeadError as e:
            self._die(e)

    def _abort_all(self, reason: str) -> None:
        ids = list(self.engine.output_processor.requests)
        self._abort(ids)
        if ids:
            self._fail(ids, RequestAbortedError(reason))

    # ---- outputs, on the event loop ---------------------------------------------------------------
    def _on_core_output(self) -> None:
        """The core's pipe is readable: every message there, through the output processor, to the streams."""
        try:
            outputs = self.engine.process_outputs(self._core.take_outputs())
        except EngineCoreDeadError as e:
            self._die(e)
            return
        except Exception:  # an engine bug: fail what is in flight, keep serving
            logger.exception("processing the engine's outputs failed")
            self._abort_all("processing the engine's outputs failed (the server's log has the details)")
            return
        streams = self._streams
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is not None:
                if output.metrics is not None:  # (freeze the timings: later steps update the request's own)
                    output.metrics = copy.copy(output.metrics)
                stream._put(output)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream._fail(request_id, error)


