"""Tensor parallelism's other ranks: one process each (torch.multiprocessing, spawned), holding its shard
of the model and of the KV cache, running the steps rank 0 (the engine's process) broadcasts.

Rank 0 sends each step's packed inputs (staging.broadcast_step); the ranks here run them
(ModelRunner.serve_steps).

Rank 0 checks before every step that the workers are alive, so a worker that died fails the engine with
its exit code instead of leaving rank 0 waiting in a collective; a worker whose parent dies is killed."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import signal
import socket
import sys
import traceback
from typing import Any

import torch.multiprocessing as mp

from tinyvllm.config import Config

logger = logging.getLogger(__name__)

def free_tcp_init_method() -> str:
    """A rendezvous address on loopback: a port the OS says is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def die_with_parent() -> None:
    """Linux: have the kernel kill this process when its parent dies, so no rank outlives the engine."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def worker_main(rank: int, config: Config, init_method: str, errors: Any) -> None:
    """A rank > 0: join the group, build this rank's shard and runner, then run steps until told to stop."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops the ranks
    from tinyvllm.distributed import destroy_tensor_parallel, init_tensor_parallel, rank_device
    from tinyvllm.model.loader import build_model
    from tinyvllm.worker.model_runner import ModelRunner

    try:
        config = dataclasses.replace(config, device=rank_device(rank, config.device))
        tp = init_tensor_parallel(rank, config.engine.tensor_parallel_size, init_method, config.device)
        model = build_model(config.model, config.model_path, config.device, config.dtype, config.max_model_len, tp=tp,
                            quantization=config.quantization)
        runner = ModelRunner(model, config, tp)
        runner.serve_steps()
        destroy_tensor_parallel()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise


class TensorParallelWorkers:
    """Ranks 1..N-1 of a tensor-parallel engine."""

    def __init__(self, config: Config, init_method: str) -> None:
        ctx = mp.get_context("spawn")
        self._errors = ctx.Queue()
        self.processes = [
            ctx.Process(target=worker_main, name=f"tinyvllm-tp-rank{rank}", daemon=True,
                        args=(rank, config, init_method, self._errors))
            for rank in range(1, config.engine.tensor_parallel_size)
        ]
        for process in self.processes:
            process.start()

    def all_alive(self) -> bool:
        return all(p.exitcode is None for p in self.processes)

    def check_alive(self) -> None:
        """Raise if a worker has exited: its rank 0 would otherwise wait for it in the next collective."""
        dead = [(rank, p.exitcode) for rank, p in enumerate(self.processes, start=1) if p.exitcode is not None]
        if dead:
            details = []
            while not self._errors.empty():
                rank, text = self._errors.get_nowait()
                details.append(f"rank {rank}:\n{text}")
            ranks = ", ".join(f"rank {rank} (exit code {code})" for rank, code in dead)
            raise RuntimeError(f"tensor-parallel worker {ranks} died; the engine cannot go on"
                               + ("\n" + "\n".join(details) if details else ""))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        for process in self.processes:
            process.join(timeout_s)
            if process.is_alive():
                process.kill()
                process.join()
