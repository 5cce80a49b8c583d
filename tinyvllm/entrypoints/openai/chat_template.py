"""A request's own chat template (`chat_template` in a chat request), rendered where it can harm no one else.

The server refuses such a template unless it was started with --trust-request-chat-template (vLLM's flag). Even
then a template is a program that the client wrote: Jinja's sandbox (which transformers renders in) keeps it from
the server's insides, but not from looping for minutes or building a string of gigabytes. So it runs in a process
of its own, with a memory limit, and is given RENDER_TIMEOUT_S: past that the process is killed (and a new one
started for the next request) and the request gets a 400. The model's own template runs in the server's process,
as always: it is the operator's choice, and its time grows with the messages alone."""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import threading
from multiprocessing.connection import Connection
from typing import Any

from tinyvllm.engine.input_processor import InputError, Message

logger = logging.getLogger(__name__)

RENDER_TIMEOUT_S = 2.0  # a chat template renders in milliseconds: this is for one that never ends
MEMORY_HEADROOM_BYTES = 2 << 30  # what the renderer's process may allocate beyond what it holds once started
_START_TIMEOUT_S = 120.0


def _render_loop(conn: Connection, tokenizer_bytes: bytes) -> None:
    """The renderer's process: (messages, add_generation_prompt, template, tools) in, token ids or an error message
    out."""
    import resource

    from tinyvllm.engine.input_processor import apply_chat_template

    tokenizer = pickle.loads(tokenizer_bytes)
    apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}], True, "{{ messages[0].content }}")  # warm
    with open("/proc/self/statm") as f:
        held = int(f.read().split()[0]) * resource.getpagesize()
    limit = held + MEMORY_HEADROOM_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send(("ready",))
    while True:
        try:
            messages, add_generation_prompt, template, tools = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ids", apply_chat_template(tokenizer, messages, add_generation_prompt, template, tools)))
        except InputError as e:
            conn.send(("error", str(e)))
        except MemoryError:
            conn.send(("error", f"the chat template needs more than {MEMORY_HEADROOM_BYTES >> 20} MiB"))
        except Exception as e:  # (whatever the template raises is the request's own error)
            conn.send(("error", f"cannot apply the chat template: {type(e).__name__}: {e}"))


class RequestTemplateRenderer:
    """Renders requests' own chat templates in a process of its own (started at once, and again after a kill).
    One request at a time: the server calls it from its one input thread."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer_bytes = pickle.dumps(tokenizer)
        self._lock = threading.Lock()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._ready = False
        self._closed = False
        self._start()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        process = ctx.Process(target=_render_loop, args=(child_conn, self._tokenizer_bytes), daemon=True,
                              name="tinyvllm-chat-template")
        process.start()
        child_conn.close()
        self._process, self._conn, self._ready = process, conn, False

    def _connection(self) -> Connection:
        """The renderer's connection, once it has said it is ready (it imports transformers first)."""
        if self._process is None or not self._process.is_alive():
            self._kill()
            self._start()
        assert self._conn is not None
        if not self._ready:
            try:
                ready = self._conn.poll(_START_TIMEOUT_S) and self._conn.recv() == ("ready",)
            except (EOFError, OSError):
                ready = False
            if not ready:
                self._kill()
                raise RuntimeError("the chat template renderer did not start")
            self._ready = True
        return self._conn

    def render(self, messages: list[Message], add_generation_prompt: bool, template: str,
               tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The conversation's token ids under `template`; InputError if it fails, or takes too long or too much."""
        with self._lock:
            conn = self._connection()
            try:
                conn.send((messages, add_generation_prompt, template, tools))
                if conn.poll(RENDER_TIMEOUT_S):
                    kind, value = conn.recv()
                    if kind == "ids":
                        return value
                    raise InputError(value, "chat_template")
            except (EOFError, OSError):
                pass
            logger.warning("a request's chat_template did not render within %g s: its renderer is restarted",
                           RENDER_TIMEOUT_S)
            self._kill()
            # (a new renderer takes a second or more to start: not on this request's time)
            threading.Thread(target=self._restart, daemon=True).start()
            raise InputError(f"the request's chat_template did not render within {RENDER_TIMEOUT_S:g} s: it is "
                             "refused", "chat_template")

    def _restart(self) -> None:
        with self._lock:
            if self._process is None and not self._closed:
                self._start()

    def _kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn, self._ready = None, None, False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._kill()
