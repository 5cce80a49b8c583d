"""The engine core in a process of its own (as vLLM V1's EngineCore), for the server: scheduling and model steps
run there, never waiting on the API process's event loop, and the two processes share no GIL.

EngineCoreClient has the EngineCore methods LLMEngine calls. Requests go to the core as they come (one message
each); the core steps whenever it has work and sends one message per step with every sequence's new token
(contract.EngineCoreOutputs, columns of plain data) and its statistics. step() waits for the next such message
and takes any others already there, as one EngineCoreOutputs. Messages travel over a multiprocessing pipe.

If the core process dies, every call raises EngineCoreDeadError: the server fails what is in flight, answers
503 and exits non-zero."""

from __future__ import annotations

import logging
import multiprocessing
import signal
import traceback
from typing import Any

import torch

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.contract import EngineCoreOutputs
from tinyvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 1800.0  # model load, GGUF conversion, graph capture


class EngineCoreDeadError(RuntimeError):
    """The engine core's process is gone: nothing can be served any more."""


def _core_main(config: EngineConfig, model_config: ModelConfig, model_path: str, device: str, dtype: torch.dtype,
               max_model_len: int, conn: Any) -> None:
    """The core process: build the EngineCore, then take commands and step until told to stop."""
    from tinyvllm.engine.engine_core import EngineCore
    from tinyvllm.worker.tp_worker import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the API process's to handle: it stops the core
    try:
        core = EngineCore(config, model_config, model_path, torch.device(device), dtype, max_model_len)
    except BaseException as e:  # a ValueError is the user's to fix (a bad checkpoint, say): its message suffices
        conn.send(("error", str(e) if isinstance(e, ValueError) else traceback.format_exc(), isinstance(e, ValueError)))
        return
    conn.send(("ready", core.kv_capacity_tokens, core.get_stats()))
    try:
        while True:
            while conn.poll(0):  # every command waiting
                command, *args = conn.recv()
                if command == "stop":
                    core.shutdown()
                    return
                getattr(core, command)(*args)  # add_request, abort_request, finish_sequence
            if core.has_unfinished_requests():
                conn.send(("outputs", core.step(), core.get_stats()))
            else:  # idle (the last requests finished or were aborted): report it, then wait for a command
                conn.send(("outputs", EngineCoreOutputs(), core.get_stats()))
                conn.poll(None)
    except (EOFError, BrokenPipeError):
        return  # the API process is gone
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            core.shutdown()


class EngineCoreClient:
    """EngineCore's interface, with the core in a child process."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: str, device: torch.device,
                 dtype: torch.dtype, max_model_len: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # Not a daemon: the core starts tensor-parallel ranks of its own. It dies with this process (PDEATHSIG).
        self.process = ctx.Process(target=_core_main, name="tinyvllm-engine-core", daemon=False,
                                   args=(config, model_config, model_path, str(device), dtype, max_model_len, child))
        self.process.start()
        child.close()
        self._outputs: EngineCoreOutputs | None = None  # read from the pipe by get_stats(), for the next step()
        kind, *rest = self._recv(_START_TIMEOUT_S)
        if kind != "ready":
            self.process.join(10)
            text, users_error = rest
            raise (ValueError(text) if users_error else RuntimeError(f"the engine core failed to start:\n{text}"))
        self.kv_capacity_tokens, self._stats = rest

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
        """The core's figures as of the last message it sent (reading any that arrived; a dead core's last)."""
        if self.process.is_alive():
            self._drain()
        return dict(self._stats)

    def _drain(self) -> None:
        while self._conn.poll(0):
            self._take(self._recv(None))

    def shutdown(self) -> None:
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
        except (EOFError, OSError) as e:
            raise EngineCoreDeadError(self._death()) from e

    def _check_alive(self) -> None:
        if not self.process.is_alive() and not self._conn.poll(0):
            raise EngineCoreDeadError(self._death())

    def _death(self) -> str:
        self.process.join(1)
        return f"the engine core process exited (exit code {self.process.exitcode})"
