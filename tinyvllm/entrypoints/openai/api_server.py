"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLMEngine, served by uvicorn.

    POST /v1/completions, /v1/chat/completions  (stream: server-sent events ending in `data: [DONE]`)
    GET  /v1/models, /health, /metrics, /version, /tokenizer_info;  POST /tokenize, /detokenize  (as vLLM's)
    GET  /  a chat page (static/: plain HTML, JS and CSS, no build step), unless --no-ui

A request is validated (pydantic, then SamplingParams, then the engine's own checks) before anything
is streamed, so a bad one gets a 400 and leaves the others alone. Its body is capped (413 beyond
--max-request-body-mb), and what costs time in proportion to it (JSON parsing, validation, tokenizing, chat
templates) runs on one input thread of the app's own, so that the event loop keeps answering the other
requests meanwhile: one thread, because the server's copy of the tokenizer must not be used by two at
once. (A small body is handled on the loop itself when that thread is idle: the hand-offs would cost more.)
Every way a response can end early (the client went away, the server is shutting down) aborts its engine
requests, which frees their KV blocks. Each request is logged (method, path, status, milliseconds) unless
--no-access-log. This module imports fastapi, uvicorn and prometheus_client: only `tinyvllm serve`
loads it."""

import argparse
import asyncio
import hmac
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinyvllm.config import EngineConfig
from tinyvllm.engine.async_engine import AsyncLLMEngine
from tinyvllm.engine.input_processor import InputError
from tinyvllm.entrypoints.openai.metrics import ServerMetrics
from tinyvllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tinyvllm.entrypoints.openai.serving import (
    APIError,
    ClientGone,
    OpenAIServing,
    constraint_fields,
    error_response,
)
from tinyvllm.entrypoints.openai.serving_chat import OpenAIServingChat
from tinyvllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tinyvllm.heap import frozen_heap

logger = logging.getLogger("tinyvllm.entrypoints.openai")
access_logger = logging.getLogger("tinyvllm.access")

BodyT = TypeVar("BodyT", bound=BaseModel)
T = TypeVar("T")

# A body up to this size is parsed and handled on the event loop when the input thread is idle (see prepare).
INLINE_BODY_BYTES = 4096

# Paths anyone may read even when the server has an API key (as vLLM: probes and scrapers hold no key).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})

# The chat page's files: path -> (file in static/, media type). Open too: the page asks for the key itself, and
# sends it with the API calls it makes.
STATIC_DIR = Path(__file__).parent / "static"
UI_FILES = {"/": ("index.html", "text/html; charset=utf-8"),
            "/static/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
            "/static/chat.css": ("chat.css", "text/css; charset=utf-8")}
# The page loads nothing but its own files and talks to nothing but this server: a script slipped into it (which
# its renderer must never let through anyway) could not run inline, nor load or send anything elsewhere.
UI_HEADERS = {"Content-Security-Policy": "default-src 'self'; base-uri 'none'; frame-ancestors 'none'",
              "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


class _ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` (compared in constant time); before anything else runs,
    so that an unauthenticated client learns nothing about its request."""

    def __init__(self, app: Any, api_key: str, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            response = error_response(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyTooLarge(Exception):
    """A request body (sent without a Content-Length) grew past the cap while it was read."""


def _too_large_message(max_bytes: int) -> str:
    return (f"the request body is larger than this server's limit of {max_bytes / 2**20:g} MB: send a smaller "
            "request (the server's --max-request-body-mb sets the limit)")


class _BodyLimitMiddleware:
    """413 for a body over `max_bytes`: at once if its Content-Length says so (nothing of it is read), else
    as soon as the bytes read pass the cap (BodyTooLarge, raised where the route reads the body)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await error_response(413, _too_large_message(self.max_bytes))(scope, receive, send)
            return
        received = 0

        async def receive_capped() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge()
            return message

        await self.app(scope, receive_capped, send)


class _AccessLogMiddleware:
    """One line per request once its response has ended (a stream's included): client, method, path,
    HTTP version, status and duration, as uvicorn's access log plus the milliseconds."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # unless a response starts

        async def send_logged(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        finally:
            client = scope.get("client")
            path = scope.get("root_path", "") + scope["path"]
            if scope.get("query_string"):
                path += "?" + scope["query_string"].decode("latin-1")
            access_logger.info('%s - "%s %s HTTP/%s" %d %.1f ms', f"{client[0]}:{client[1]}" if client else "-",
                               scope["method"], path, scope.get("http_version", "1.1"), status,
                               (time.perf_counter() - start) * 1000)


def _validation_message(errors: list[Any]) -> tuple[str, str | None]:
    if not errors:
        return "invalid request", None
    unknown = [".".join(str(x) for x in e.get("loc", ()) if x != "body") for e in errors
               if e.get("type") == "extra_forbidden"]
    if unknown:
        names = ", ".join(f"`{name}`" for name in unknown[:10]) + (" ..." if len(unknown) > 10 else "")
        one = len(unknown) == 1
        return (f"unsupported field{'' if one else 's'} {names}: this server does not act on "
                f"{'it' if one else 'them'}, and refuses a request rather than ignore what it asks; remove "
                f"{'it' if one else 'them'}"), unknown[0]
    parts, param = [], None
    for error in errors[:3]:
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = loc[0]
        parts.append(f"{'.'.join(loc) or 'body'}: {error.get('msg', 'invalid')}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(parts) + more, param


# A JSON escape of a UTF-16 surrogate (\ud800-\udfff): a pair decodes to one character, a lone one to a string
# that is not Unicode text (no tokenizer, and no UTF-8 encoder, takes it).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class _NotJSONNumber(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NotJSONNumber(f"{name} is not a JSON number")


def _check_strings(data: Any) -> None:
    """APIError unless every string (and key) in `data` is Unicode text: no lone surrogate."""
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError as e:
                raise APIError(400, f"the body holds a lone UTF-16 surrogate ({value[e.start]!a}) in a string: "
                                    "that is not Unicode text") from None
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def parse_body(raw: bytes, model: type[BodyT]) -> BodyT:
    """The JSON body as `model` (whatever the Content-Type says, as OpenAI's clients all send JSON). Whatever the
    body holds, the answer is the parsed request or an APIError (400): UTF-8 only (as JSON between systems is),
    no NaN or Infinity, no number of more digits than Python converts, no nesting deeper than the parser's
    recursion allows (about a thousand levels), no lone surrogate in a string."""
    try:
        data = json.loads(raw.decode(), parse_constant=_refuse_constant)
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not UTF-8 text (byte {e.start}): send JSON in UTF-8") from None
    except RecursionError:
        raise APIError(400, "the body's JSON is nested too deeply") from None
    except ValueError as e:  # (json.JSONDecodeError, and a number too long to convert)
        message = str(e) if isinstance(e, (json.JSONDecodeError, _NotJSONNumber)) else "a number has too many digits"
        raise APIError(400, f"the body is not valid JSON: {message}") from None
    if _SURROGATE_ESCAPE.search(raw):
        _check_strings(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = _validation_message(e.errors())
        raise APIError(400, message, param) from e


def _slow_to_prepare(body: Any) -> bool:
    """Whether a request's checks may take long, whatever its size, and so go to the input thread: its own chat
    template renders there (up to its time limit), and a constraint on its output builds a grammar (xgrammar is
    imported at the first)."""
    return getattr(body, "chat_template", None) is not None or bool(constraint_fields(body))


def build_app(engine: AsyncLLMEngine, served_model_name: str, api_key: str | None, *, max_body_mb: float,
              access_log: bool = True, trust_request_chat_template: bool = False, ui: bool = True) -> FastAPI:
    """The FastAPI app (with the chat page at / if `ui`). Its lifespan starts reading the engine core's outputs and
    stops the engine on shutdown."""
    metrics = ServerMetrics(engine, served_model_name)
    server = OpenAIServing(engine, served_model_name, metrics)  # /v1/models, /tokenize, /detokenize
    completion = OpenAIServingCompletion(engine, served_model_name, metrics)
    templates = None
    if trust_request_chat_template and engine.tokenizer is not None:
        from tinyvllm.entrypoints.openai.chat_template import RequestTemplateRenderer

        templates = RequestTemplateRenderer(engine.tokenizer)
    chat = OpenAIServingChat(engine, served_model_name, metrics, templates)
    # The input thread: parsing, checks, tokenizing and chat templates, off the event loop (one thread:
    # the server's tokenizer is not safe to use from two at once).
    inputs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyvllm-inputs")
    max_body_bytes = int(max_body_mb * 2**20)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            inputs.shutdown(wait=False, cancel_futures=True)
            if templates is not None:
                templates.close()
            await asyncio.to_thread(engine.shutdown)

    handling = threading.Lock()  # held while a handler runs (they share the server's tokenizer)

    async def prepare(raw_request: Request, model: type[BodyT], handle: Callable[[BodyT], T]) -> T:
        """`handle(body)` for the request's body as `model`, parsed and handled on the input thread; or right
        here on the event loop, for a small body while no handler runs: such work takes less time than the
        two hand-offs between threads would (each a wake-up, and a wait for the GIL)."""
        raw = await raw_request.body()
        body = None
        if len(raw) <= INLINE_BODY_BYTES and handling.acquire(blocking=False):
            try:
                body = parse_body(raw, model)
                if not _slow_to_prepare(body):
                    return handle(body)
            finally:
                handling.release()

        def job() -> T:
            with handling:
                return handle(parse_body(raw, model) if body is None else body)

        return await asyncio.get_running_loop().run_in_executor(inputs, job)

    app = FastAPI(title="tinyvllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    # (the last added runs first: the access log sees every request, the API key is checked before the body)
    app.add_middleware(_BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        open_paths = OPEN_PATHS | frozenset(UI_FILES) if ui else OPEN_PATHS
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key, open_paths=open_paths)
    if access_log:
        app.add_middleware(_AccessLogMiddleware)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(BodyTooLarge)
    async def _body_too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
        return error_response(413, _too_large_message(max_body_bytes))

    @app.exception_handler(InputError)
    async def _input_error(request: Request, exc: InputError) -> JSONResponse:
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(exc.errors()))
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        # (what went wrong goes to the log alone: a body says nothing of the server's insides)
        logger.exception("unexpected error on %s", request.url.path)
        return error_response(500, "internal error: the server could not handle this request (its log has the "
                                   "details); other requests are not affected")

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(503, "the engine is not running" if engine.dead_reason else
                                  "the engine has not started")
        return Response(status_code=200)

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        from tinyvllm import __version__

        return {"version": __version__}

    @app.get("/metrics")
    async def render_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(server.models().model_dump())

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(server.tokenizer_info())

    # The routes that take a body are plain Starlette routes: each reads and checks its body itself (prepare),
    # so FastAPI's per-request dependency solving would only add to every request's time to first token.
    async def completions(raw_request: Request) -> Response:
        prepared = await prepare(raw_request, CompletionRequest, completion.prepare)
        return await completion.create_completion(prepared, raw_request)

    async def chat_completions(raw_request: Request) -> Response:
        prepared = await prepare(raw_request, ChatCompletionRequest, chat.prepare)
        return await chat.create_chat_completion(prepared, raw_request)

    async def tokenize(raw_request: Request) -> JSONResponse:
        return JSONResponse((await prepare(raw_request, TokenizeRequest, server.tokenize)).model_dump())

    async def detokenize(raw_request: Request) -> JSONResponse:
        return JSONResponse((await prepare(raw_request, DetokenizeRequest, server.detokenize)).model_dump())

    for path, endpoint in (("/v1/completions", completions), ("/v1/chat/completions", chat_completions),
                           ("/tokenize", tokenize), ("/detokenize", detokenize)):
        app.add_route(path, endpoint, methods=["POST"])
    if ui:
        for path, (name, media_type) in UI_FILES.items():
            app.add_route(path, _static_file((STATIC_DIR / name).read_bytes(), media_type), methods=["GET"])
    return app


def _static_file(body: bytes, media_type: str) -> Callable[[Request], Any]:
    """A route that answers with `body` (the chat page's files are small: read once, when the app is built)."""

    async def endpoint(request: Request) -> Response:
        return Response(body, media_type=media_type, headers=UI_HEADERS)

    return endpoint


class _Server(uvicorn.Server):
    """uvicorn, plus: the first SIGINT/SIGTERM also aborts the requests in flight, so that their
    connections close and the graceful shutdown does not wait for long generations to end."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine) -> None:
        super().__init__(config)
        self.engine = engine

        self.engine_failed = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        self.engine.stop_accepting()

    async def on_tick(self, counter: int) -> bool:
        """Also stop when the engine has died (its core process crashed, say): open requests have had their
        503; a server that can serve nothing exits non-zero rather than answering 503 forever."""
        if self.started and not self.should_exit and self.engine.dead_reason is not None and \
                self.engine.accepting:
            if not self.engine_failed:
                logger.error("the engine died (%s): stopping the server", self.engine.dead_reason)
                self.engine_failed, self._failed_at = True, time.monotonic()
            # Once the open streams have sent their error (or after a few seconds), stop.
            if self.engine.num_active_requests == 0 or time.monotonic() - self._failed_at > 5.0:
                self.should_exit = True
        return await super().on_tick(counter)


def default_model_name(model: str | None) -> str:
    from tinyvllm.model.loader import EMBEDDED_MODEL_FILE

    return model if model is not None else EMBEDDED_MODEL_FILE.split(".")[0]


def _exit_cleanly(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def check_server_args(args: argparse.Namespace) -> None:
    if not args.max_request_body_mb > 0:
        raise ValueError(f"--max-request-body-mb must be > 0, not {args.max_request_body_mb}")
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be at least 1, not {args.api_server_count}")


def run_server(args: argparse.Namespace, config: EngineConfig, core_connection: Any = None,
               sock: socket.socket | None = None) -> int:
    """`tinyvllm serve`: load the model, then serve until SIGINT/SIGTERM; returns 0 after a clean stop. With
    --api-server-count N > 1 the launcher (launcher.py) starts the engine core and N processes that each run
    this with the core's connection and the listening socket."""
    pid = " [pid %(process)d]" if args.api_server_count > 1 else ""  # (which of the API servers says it)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format=f"%(levelname)s %(name)s{pid}: %(message)s")
    api_key = args.api_key or os.environ.get("TINYVLLM_API_KEY") or None
    check_server_args(args)
    signal.signal(signal.SIGTERM, _exit_cleanly)  # while the model loads: nothing to shut down yet
    engine = AsyncLLMEngine.from_config(config, core_connection=core_connection)
    name = args.served_model_name or default_model_name(args.model)
    app = build_app(engine, name, api_key, max_body_mb=args.max_request_body_mb, access_log=args.access_log,
                    trust_request_chat_template=args.trust_request_chat_template, ui=args.ui)
    # (uvicorn's own access log stays off: the app's logs the same requests, with their duration)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            access_log=False, timeout_graceful_shutdown=args.shutdown_timeout, lifespan="on")
    server = _Server(config, engine)
    logger.info("serving %s on http://%s:%d%s", name, args.host, args.port, " (API key required)" if api_key else "")
    # uvicorn re-raises the signal that stopped it once it has shut down; with these handlers in place
    # that re-raise does nothing, and a SIGINT/SIGTERM shutdown exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    with frozen_heap():
        server.run(sockets=None if sock is None else [sock])
    engine.shutdown()
    return 0 if server.started and not server.engine_failed else 1
