"""`tinyvllm serve --api-server-count N`: one engine core process and N API server processes in front of it, as
vLLM's. Each API server is a whole `run_server` (its own event loop, tokenizer, input and output processing)
on one listening socket that this process binds and hands to all of them, so the kernel spreads the
connections; the core sends each step's tokens to the API server whose requests they are. One API process
is the limit when a single event loop and its GIL cannot take the requests and stream the tokens that the
engine produces.

This process only supervises: SIGINT or SIGTERM stops the API servers (each aborts what it serves) and then
the core; if an API server exits unasked, or the core dies (every API server then fails its requests with a
503 and exits non-zero), the rest are stopped and the exit code is non-zero."""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import Any

from tinyvllm.config import EngineConfig
from tinyvllm.engine.core_client import start_engine_core
from tinyvllm.engine.llm_engine import resolve_config

logger = logging.getLogger("tinyvllm.entrypoints.openai")


def _api_server_main(args: argparse.Namespace, config: EngineConfig, core_connection: Any,
                     sock: socket.socket) -> None:
    """One API server process."""
    from tinyvllm.entrypoints.openai.api_server import run_server
    from tinyvllm.worker.tp_worker import die_with_parent

    die_with_parent()
    os.setpgrp()  # a terminal's Ctrl-C reaches the launcher alone, which stops each API server once
    try:
        code = run_server(args, config, core_connection, sock)
    except ValueError as e:  # the user's to fix (the core could not load the model, say): one line
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    sys.exit(code)


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port, made as asyncio makes its own (from getaddrinfo, so its protocol is
    TCP's: asyncio sets TCP_NODELAY only on connections whose socket says so, and without it Nagle's
    algorithm held small stream chunks back by ~40 ms)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(4096)
    return sock


def run_api_servers(args: argparse.Namespace, config: EngineConfig) -> int:
    from tinyvllm.entrypoints.openai.api_server import check_server_args

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    check_server_args(args)
    n = args.api_server_count
    resolved, _ = resolve_config(config)  # (a bad model path or config is refused here, before anything starts)
    sock = _listening_socket(args.host, args.port)
    metrics_dir = tempfile.mkdtemp(prefix="tinyvllm-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # (read by the API servers: metrics.py)
    stopping = False

    def stop(signum: int = signal.SIGTERM, frame: Any = None) -> None:
        nonlocal stopping
        stopping = True
        for server in servers:
            if server.is_alive():
                os.kill(server.pid, signal.SIGTERM)

    servers: list[multiprocessing.process.BaseProcess] = []
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    core, connections = start_engine_core(resolved, num_clients=n)
    try:
        ctx = multiprocessing.get_context("spawn")
        for i in range(n):
            if stopping:  # (a signal while they start: start no more)
                break
            servers.append(ctx.Process(target=_api_server_main, name=f"tinyvllm-api-server-{i}",
                                       args=(args, config, connections[i], sock)))
            servers[-1].start()
        for connection in connections:
            connection.close()  # (the API servers hold theirs: the core sees EOF once they all have gone)
        sock.close()
        logger.info("%d API servers on http://%s:%d in front of one engine core", n, args.host, args.port)
        exit_code = 0
        running = list(servers)
        while running:
            multiprocessing.connection.wait([s.sentinel for s in running])
            for server in [s for s in running if not s.is_alive()]:
                running.remove(server)
                if server.exitcode != 0 or not stopping:  # (an API server that stops unasked is a failure too)
                    exit_code = exit_code or server.exitcode or 1
                if not stopping:
                    logger.error("API server %s exited with %s: stopping the others", server.name, server.exitcode)
                    stop()
        core.join(30)  # it stops once every API server has closed its connection
        return exit_code
    finally:
        for process in [*servers, core]:
            if process.is_alive():
                process.kill()
                process.join()
        shutil.rmtree(metrics_dir, ignore_errors=True)
