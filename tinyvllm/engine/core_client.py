"""The engine core in a process of its own (as vLLM V1's EngineCore), for the server: scheduling and model steps
run there, never waiting on the API process's event loop, and the two processes share no GIL.

EngineCoreClient has the EngineCore methods LLMEngine calls. Requests go to the core as they come (one message
each); the core steps whenever it has work and sends one message per step with every sequence's new token
(contract.EngineCoreOutputs, columns of plain data) and its statistics. step() waits for the next such message
and takes any others already there, as one EngineCoreOutputs. Messages travel over a multiprocessing pipe.

If the core process dies, every call raises EngineCoreDeadError: the server fails what is in flight, answers
503 and exits non-zero."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import multiprocessing.connection
import signal
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from tinyvllm.config import Config
from tinyvllm.contract import EngineCoreOutputs
from tinyvllm.heap import frozen_heap
from tinyvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 1800.0  # model load, GGUF conversion, graph capture
_GC_YOUNG_THRESHOLD = 10_000  # the core process's allocations between young-generation collections (Python: 700)
T = TypeVar("T")


class EngineCoreDeadError(RuntimeError):
    """The engine core's process is gone: nothing can be served any more."""


def _core_main(config: Config, conns: list[Connection]) -> None:
    """The core process: build the EngineCore, then take commands and step until told to stop. Each of `conns`
    leads to one API process (several with --api-server-count): a request's outputs go back to the one that
    added it. The core stops on "stop", or once every connection has closed."""
    from tinyvllm.engine.engine_core import EngineCore
    from tinyvllm.worker.tp_worker import die_with_parent

    die_with_parent()
    # Signals are the API processes' (or the launcher's) to handle: they stop the core through its connections,
    # and it dies with its parent. (A SIGTERM to the whole group, as a service manager sends, would otherwise
    # kill it before the API servers have shut down.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server = _CoreServer(conns)
    try:
        core = EngineCore(config)
    except BaseException as e:  # a ValueError is the user's to fix (a bad checkpoint, say): its message suffices
        message = str(e) if isinstance(e, ValueError) else traceback.format_exc()
        server.broadcast(("error", message, isinstance(e, ValueError)))
        return
    # The young generation is collected every _GC_YOUNG_THRESHOLD allocations instead of 700: the requests' token
    # lists, alive for a whole request, were walked again at each of the many small collections
    # (benchmarks/RESULTS.md has both measurements).
    with frozen_heap():
        gc.set_threshold(_GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        try:
            server.broadcast(("ready", core.kv_capacity_tokens, core.get_stats()))
            server.run(core)
        except BaseException:
            server.broadcast(("error", traceback.format_exc()))
        finally:
            core.shutdown()


class _CoreServer:
    """The core process's side of its connections: commands in, each step's outputs out to the API process
    that owns them. An API process that goes away (EOF, or a broken pipe on a send) loses its requests, and
    the others go on."""

    def __init__(self, conns: list[Connection]) -> None:
        self.live = list(conns)
        self.owners: dict[str, Connection] = {}  # request id -> the connection that added it
        self.last_sent: dict[Connection, float] = {}

    def run(self, core: Any) -> None:
        idle_reported = True  # (the ready message carried the figures)
        while self.live:
            busy = core.has_unfinished_requests() or not idle_reported
            for conn in multiprocessing.connection.wait(self.live, timeout=0 if busy else None):
                if self._take_commands(core, conn):
                    return
            if core.has_unfinished_requests():
                self._send_outputs(core, core.step())
                idle_reported = False
            elif not idle_reported:  # the last requests finished or were aborted: every API process hears it
                self.broadcast(("outputs", EngineCoreOutputs(), core.get_stats()))
                idle_reported = True

    def _take_commands(self, core: Any, conn: Connection) -> bool:
        """Every command waiting on `conn`; True on "stop"."""
        try:
            while conn.poll(0):
                command, *args = conn.recv()
                if command == "stop":
                    return True
                if command == "add_request":
                    self.owners[args[0]] = conn
                try:
                    getattr(core, command)(*args)  # add_request, abort_request, finish_sequence
                except Exception as e:  # one request's trouble: it fails, the core serves the others
                    logger.exception("the engine core failed on %s of request %r", command, args[0])
                    core.fail_request(args[0], f"{type(e).__name__}: {e}")
                if command != "add_request" and args[0] not in core.requests:  # aborted, or finished
                    self.owners.pop(args[0], None)
        except (EOFError, OSError):
            self._drop(core, conn)
        return False

    def _send_outputs(self, core: Any, outputs: EngineCoreOutputs) -> None:
        """One step's outputs to the API processes whose requests they are (one message each, empty for one
        whose requests got no token, so that it never waits long to pass on its next commands), with the
        figures; a process with no request in the core gets the figures alone, at most every 0.1 s (so that
        its /metrics stays current, and a process that reads only between requests cannot fill its pipe)."""
        stats = core.get_stats()
        if len(self.live) == 1:
            self._send(core, self.live[0], ("outputs", outputs, stats))
        else:
            shares: dict[Connection, list[int]] = {conn: [] for conn in set(self.owners.values())}
            for entry, request_id in enumerate(outputs.request_ids):
                owner = self.owners.get(request_id)
                if owner is not None:
                    shares[owner].append(entry)
            errors, prompt_logprobs = self._by_owner(outputs.errors), self._by_owner(outputs.prompt_logprobs)
            now = time.monotonic()
            for conn in list(self.live):
                if conn in shares:
                    share = outputs.select(shares[conn], errors.get(conn, {}), prompt_logprobs.get(conn, {}))
                    self._send(core, conn, ("outputs", share, stats))
                elif now - self.last_sent.get(conn, 0.0) >= 0.1:
                    self._send(core, conn, ("outputs", EngineCoreOutputs(), stats))
                else:
                    continue
                self.last_sent[conn] = now
        for entry in outputs.finished:
            request_id = outputs.request_ids[entry]
            if request_id not in core.requests:  # (all its completions are done)
                self.owners.pop(request_id, None)
        for request_id in outputs.errors:
            self.owners.pop(request_id, None)

    def _by_owner(self, by_request: dict[str, T]) -> dict[Connection, dict[str, T]]:
        """A column keyed by request id, split by the API process that owns each request."""
        split: dict[Connection, dict[str, T]] = {}
        for request_id, value in by_request.items():
            if request_id in self.owners:
                split.setdefault(self.owners[request_id], {})[request_id] = value
        return split

    def _send(self, core: Any, conn: Connection, message: tuple) -> None:
        try:
            conn.send(message)
        except OSError:  # (a broken pipe: that API process is gone)
            self._drop(core, conn)

    def _drop(self, core: Any, conn: Connection) -> None:
        """An API process went away: abort its requests, which frees their blocks."""
        if conn in self.live:
            self.live.remove(conn)
        for request_id in [r for r, owner in self.owners.items() if owner is conn]:
            core.abort_request(request_id)
            del self.owners[request_id]

    def broadcast(self, message: tuple) -> None:
        for conn in list(self.live):
            try:
                conn.send(message)
            except OSError:
                self.live.remove(conn)


def start_engine_core(config: Config,
                      num_clients: int = 1) -> tuple[multiprocessing.process.BaseProcess, list[Connection]]:
    """Start the core process; its process and one connection per client (an EngineCoreClient each)."""
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(num_clients)]
    # Not a daemon: the core starts tensor-parallel ranks of its own. It dies with this process (PDEATHSIG).
    process = ctx.Process(target=_core_main, name="tinyvllm-engine-core", daemon=False,
                          args=(config, [core_end for _, core_end in pipes]))
    process.start()
    for _, core_end in pipes:
        core_end.close()  # (only the core holds these now: it sees EOF when a client goes, a client when it goes)
    return process, [client_end for client_end, _ in pipes]


class EngineCoreClient:
    """EngineCore's interface, with the core in another process: one it starts and owns (`start`), or one that
    another process started for several clients (the API servers of --api-server-count), given its connection."""

    def __init__(self, conn: Connection, process: multiprocessing.process.BaseProcess | None = None) -> None:
        self._conn = conn
        self.process = process  # None: not ours (the core's death shows as the end of the pipe)
        self._outputs: EngineCoreOutputs | None = None  # read from the pipe by get_stats(), for the next step()
        kind, *rest = self._recv(_START_TIMEOUT_S)
        if kind != "ready":
            if process is not None:
                process.join(10)
            text, users_error = rest
            raise (ValueError(text) if users_error else RuntimeError(f"the engine core failed to start:\n{text}"))
        self.kv_capacity_tokens, self._stats = rest

    @classmethod
    def start(cls, config: Config) -> EngineCoreClient:
        process, (conn,) = start_engine_core(config)
        return cls(conn, process)

    # ---- the EngineCore interface ------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._send("add_request", request_id, prompt_token_ids, params)

    def abort_request(self, request_id: str) -> None:
        self._send("abort_request", request_id)

    def finish_sequence(self, request_id: str, index: int, reason: str, stop_reason: int | str | None) -> None:
        self._send("finish_sequence", request_id, index, reason, stop_reason)

    def step(self) -> EngineCoreOutputs:
        """The outputs of the core's next step, and of any later steps already sent. (LLMEngine steps only while
        it has unfinished requests, which the core has too, or has in a message on its way: so a step comes.)"""
        if not self._outputs:  # (None, or only an idle report's empty outputs)
            self._take(self._recv(None))
        self._drain()
        outputs, self._outputs = self._outputs, None
        assert outputs is not None
        return outputs

    def get_stats(self) -> dict[str, float]:
        """The core's figures as of the last message it sent (reading any that arrived). EngineCoreDeadError
        once the core is gone."""
        self._drain()
        return dict(self._stats)

    # ---- for an event loop that reads the pipe when it is readable (AsyncLLMEngine) ------------------
    def fileno(self) -> int:
        return self._conn.fileno()

    def take_outputs(self) -> EngineCoreOutputs:
        """Every message waiting, without blocking: the outputs of the steps among them, concatenated (empty if
        they held figures only). EngineCoreDeadError at the end of the pipe (the core is gone)."""
        self._drain()
        outputs, self._outputs = self._outputs, None
        return outputs if outputs is not None else EngineCoreOutputs()

    @property
    def stats(self) -> dict[str, float]:
        """The figures of the last message read, without reading the pipe."""
        return dict(self._stats)

    def _drain(self) -> None:
        while not self._conn.closed and self._conn.poll(0):  # (closed: by our own shutdown)
            self._take(self._recv(None))

    def shutdown(self) -> None:
        """Stop the core if it is ours; a shared one stops once its last client has closed its connection."""
        if self.process is None:
            self._conn.close()
            return
        if self.process.is_alive():
            try:
                self._conn.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    # ---- the pipe -----------------------------------------------------------------------------------
    def _take(self, message: tuple) -> None:
        """Keep a step's outputs (after any not yet taken by step()) and its figures."""
        kind, *rest = message
        if kind == "error":
            raise EngineCoreDeadError(f"the engine core failed:\n{rest[0]}")
        outputs, self._stats = rest
        if self._outputs is None:
            self._outputs = outputs
        else:
            self._outputs.extend(outputs)

    def _send(self, *message: Any) -> None:
        self._check_alive()
        try:
            self._conn.send(message)
        except (OSError, BrokenPipeError) as e:
            raise EngineCoreDeadError(self._death()) from e

    def _recv(self, timeout: float | None) -> tuple:
        """The next message; waits (checking every second that the core lives) up to `timeout` seconds."""
        waited = 0.0
        while not self._conn.poll(1.0):
            self._check_alive()
            waited += 1.0
            if timeout is not None and waited >= timeout:
                raise EngineCoreDeadError(f"the engine core sent nothing for {timeout:.0f} s")
        try:
            return self._conn.recv()
        except EOFError as e:
            raise EngineCoreDeadError(self._death()) from e
        except OSError as e:
            raise EngineCoreDeadError(f"reading from the engine core failed: {e!r}") from e

    def _check_alive(self) -> None:
        dead = self._conn.closed or (self.process is not None and not self.process.is_alive())
        if dead and (self._conn.closed or not self._conn.poll(0)):
            raise EngineCoreDeadError(self._death())

    def _death(self) -> str:
        if self.process is None:
            return "the engine core process exited (its connection closed)"
        self.process.join(1)
        return f"the engine core process exited (exit code {self.process.exitcode})"
