"""AsyncLLMEngine: the engine behind an asyncio server.

One thread owns the LLMEngine. Between steps it takes the commands that have arrived (add, abort) from a
queue, then runs the blocking `step()`; so the engine is never touched by two threads at once, and the
event loop never waits on a forward pass (with the server's engine core in a process of its own, step()
waits for that process's next step and turns its tokens into RequestOutputs). Outputs go back to the event
loop once per step (one `call_soon_threadsafe`), where each lands in the RequestStream that asked for it,
merged with any earlier one its reader has not taken yet.

    add_requests() --_Add--> command queue --> engine thread: add_request / abort_request / step()
         ^                                                         |
         +-- RequestStream (merged deltas) <-- call_soon_threadsafe(deliver, outputs) --+
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

from tinyvllm.config import EngineConfig
from tinyvllm.engine.core_client import EngineCoreDeadError
from tinyvllm.engine.input_processor import InputProcessor, ProcessedInput, PromptType
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or crashed): no request can be served."""


class RequestAbortedError(RuntimeError):
    """The server aborted the request (it is shutting down, or the engine failed) before it finished."""


@dataclasses.dataclass
class _Add:
    request_id: str
    processed: ProcessedInput
    future: asyncio.Future[None]


@dataclasses.dataclass
class _Abort:
    request_ids: list[str]


@dataclasses.dataclass
class _AbortAll:
    reason: str


class _Stop:
    pass


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
            self._engine._commands.put(_Abort(ids))

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
    """Streams RequestOutputs with output_kind="delta" (each carries only what is new) to asyncio code."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # A private copy, so that the server can tokenize and render chat templates on its side while the
        # engine thread detokenizes with its own (a fast tokenizer is not safe to share).
        self.tokenizer: Any = copy.deepcopy(engine.tokenizer)
        ip = engine.input_processor
        self.input_processor = InputProcessor(self.tokenizer, ip.vocab_size, ip.max_model_len, ip.kv_capacity_tokens)
        self.model_path = engine.model_path
        self.max_model_len = engine.max_model_len
        self.model_config = engine.model_config
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Touched on the event loop only: whose outputs go where, and the adds not yet confirmed.
        self._streams: dict[str, RequestStream] = {}
        self._pending_adds: dict[str, asyncio.Future[None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stats: dict[str, float] = engine.get_stats()
        self._accepting = True
        self.dead_reason: str | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, core_process: bool = True,
                    core_connection: Any = None) -> AsyncLLMEngine:
        """core_process: the engine core in a process of its own (engine/core_client.py), so that model steps
        never wait for this process's event loop; False keeps it on the engine thread. core_connection: a core
        that another process started, shared with other API servers."""
        return cls(LLMEngine(config, core_process=core_process, core_connection=core_connection))

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; outputs are delivered on the event loop this is called from."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tinyvllm-engine", daemon=True)
        self._thread.start()

    @property
    def accepting(self) -> bool:
        """False once the server has begun shutting down."""
        return self._accepting

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_reason is None

    def stop_accepting(self, reason: str = "the server is shutting down") -> None:
        """Refuse new requests and abort those in flight. Safe in a signal handler: it only sets a flag
        and puts a command on a queue."""
        self._accepting = False
        self._commands.put(_AbortAll(reason))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything and stop the engine thread (after the step it is in, if any)."""
        self._accepting = False
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._commands.put(_AbortAll("the server is shutting down"))
        self._commands.put(_Stop())
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("the engine thread did not stop within %.0f s", timeout)

    # ---- requests ---------------------------------------------------------------------------------
    async def add_requests(self, requests: Sequence[tuple[str, ProcessedInput]]) -> RequestStream:
        """Queue requests (request_id, input checked by self.input_processor) and return the stream of their
        outputs. If the engine refuses any of them (ValueError), none is kept and the error is raised here,
        before any output."""
        if not self._accepting:
            raise EngineDeadError("the server is shutting down")
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self.dead_reason or 'not started'})")
        ids = [request_id for request_id, _ in requests]
        if len(set(ids)) != len(ids) or any(i in self._streams for i in ids):
            raise ValueError("request ids must be unique")
        assert self._loop is not None
        stream = RequestStream(self, ids)
        futures = []
        for request_id, processed in requests:  # no await in this loop: see _fail_all
            future = self._loop.create_future()
            self._streams[request_id] = stream
            self._pending_adds[request_id] = future
            futures.append(future)
            self._commands.put(_Add(request_id, processed, future))
        try:
            results = await asyncio.gather(*futures, return_exceptions=True)
        except BaseException:  # cancelled: the client went away while we waited
            stream.abort()
            raise
        finally:
            for request_id in ids:
                self._pending_adds.pop(request_id, None)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            stream.abort()
            raise errors[0]
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
            self._commands.put(_Abort([request_id]))

    def get_stats(self) -> dict[str, float]:
        """The engine's counters and gauges as of its latest step."""
        return dict(self._stats)

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    def _forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._streams.pop(request_id, None)

    # ---- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                block = not engine.has_unfinished_requests()  # idle: sleep until a command arrives
                while True:
                    try:
                        command = self._commands.get(block=block, timeout=0.25 if block else None)
                    except queue.Empty:
                        self._stats = engine.get_stats()  # (idle: the figures of the last step may move on)
                        break
                    if isinstance(command, _Stop):
                        self._abort_all("the engine stopped")
                        return
                    self._handle(command)
                    block = False
                if not engine.has_unfinished_requests():
                    continue
                try:
                    outputs = engine.step()
                except EngineCoreDeadError:
                    raise  # nothing can be served any more: the thread ends, the server answers 503 and exits
                except Exception as e:  # an engine bug: fail what is in flight, keep serving
                    logger.exception("engine step failed")
                    self._abort_all(f"the engine failed: {type(e).__name__}: {e}")
                    continue
                for output in outputs:  # freeze the timings that the event loop will read
                    if output.metrics is not None:
                        output.metrics = copy.copy(output.metrics)
                self._stats = engine.get_stats()
                if outputs:
                    self._post(self._deliver, outputs)
        except BaseException as e:
            self.dead_reason = f"{type(e).__name__}: {e}"
            logger.exception("the engine thread died")
        finally:
            self.dead_reason = self.dead_reason or "the engine stopped"
            self._post(self._fail_all, EngineDeadError(self.dead_reason))
            try:
                self._stats = engine.get_stats()
            except EngineCoreDeadError:
                pass  # (the figures of its last message stay)
            except Exception:
                logger.exception("reading the engine's last figures failed")
            try:
                engine.shutdown()  # (tensor-parallel workers)
            except Exception:
                logger.exception("stopping the tensor-parallel workers failed")

    def _handle(self, command: Any) -> None:
        engine = self.engine
        if isinstance(command, _Add):
            try:
                engine.add_processed_request(command.request_id, command.processed, output_kind="delta")
            except EngineCoreDeadError:
                raise
            except Exception as e:
                self._post(_set_exception, command.future, e)
            else:
                self._post(_set_result, command.future)
        elif isinstance(command, _Abort):
            for request_id in command.request_ids:
                engine.abort_request(request_id)
        elif isinstance(command, _AbortAll):
            self._abort_all(command.reason)
        self._stats = engine.get_stats()

    def _abort_all(self, reason: str) -> None:
        ids = list(self.engine.output_processor.requests)
        for request_id in ids:
            self.engine.abort_request(request_id)
        if ids:
            self._post(self._fail, ids, RequestAbortedError(reason))

    def _post(self, callback: Any, *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop closed meanwhile
            pass

    # ---- on the event loop ------------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        streams = self._streams
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is not None:
                stream._put(output)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream._fail(request_id, error)

    def _fail_all(self, error: BaseException) -> None:
        """The engine thread is gone: fail every add still waiting and every stream still open. (An add
        registered after this ran sees is_running False first, since both run on the event loop.)"""
        for future in self._pending_adds.values():
            _set_exception(future, error)
        self._fail(list(self._streams), error)


def _set_result(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _set_exception(future: asyncio.Future[None], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
