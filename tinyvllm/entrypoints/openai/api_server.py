"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLMEngine, served by uvicorn.

    POST /v1/completions, /v1/chat/completions  (stream: server-sent events ending in `data: [DONE]`)
    GET  /v1/models, /health, /metrics, /version;  POST /tokenize, /detokenize  (as vLLM's)

A request is validated (pydantic, then SamplingParams, then the engine's own checks) before anything
is streamed, so a bad one gets a 400 and leaves the others alone. Every way a response can end early
(the client went away, the server is shutting down) aborts its engine requests, which frees their KV
blocks. This module imports fastapi, uvicorn and prometheus_client: only `tinyvllm serve` loads it."""

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
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
from tinyvllm.entrypoints.openai.serving import APIError, ClientGone, OpenAIServing, error_response
from tinyvllm.entrypoints.openai.serving_chat import OpenAIServingChat
from tinyvllm.entrypoints.openai.serving_completion import OpenAIServingCompletion

logger = logging.getLogger("tinyvllm.entrypoints.openai")

BodyT = TypeVar("BodyT", bound=BaseModel)

# Paths anyone may read even when the server has an API key (as vLLM: probes and scrapers hold no key).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})


class _ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` (compared in constant time); before anything else runs,
    so that an unauthenticated client learns nothing about its request."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            response = error_response(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _validation_message(errors: list[Any]) -> tuple[str, str | None]:
    if not errors:
        return "invalid request", None
    parts, param = [], None
    for error in errors[:3]:
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = loc[0]
        parts.append(f"{'.'.join(loc) or 'body'}: {error.get('msg', 'invalid')}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(parts) + more, param


async def parse_body(request: Request, model: type[BodyT]) -> BodyT:
    """The JSON body as `model` (whatever the Content-Type says, as OpenAI's clients all send JSON)."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from e
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = _validation_message(e.errors())
        raise APIError(400, message, param) from e


def build_app(engine: AsyncLLMEngine, served_model_name: str, api_key: str | None) -> FastAPI:
    """The FastAPI app. Its lifespan starts the engine thread and stops it on shutdown."""
    metrics = ServerMetrics(engine, served_model_name)
    server = OpenAIServing(engine, served_model_name, metrics)  # /v1/models, /tokenize, /detokenize
    completion = OpenAIServingCompletion(engine, served_model_name, metrics)
    chat = OpenAIServingChat(engine, served_model_name, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="tinyvllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

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
        logger.exception("unexpected error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(503, f"the engine is not running ({engine.dead_reason or 'not started'})")
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

    @app.post("/v1/completions")
    async def completions(raw_request: Request) -> Response:
        return await completion.create_completion(await parse_body(raw_request, CompletionRequest), raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw_request: Request) -> Response:
        return await chat.create_chat_completion(await parse_body(raw_request, ChatCompletionRequest), raw_request)

    @app.post("/tokenize")
    async def tokenize(raw_request: Request) -> JSONResponse:
        return JSONResponse(server.tokenize(await parse_body(raw_request, TokenizeRequest)).model_dump())

    @app.post("/detokenize")
    async def detokenize(raw_request: Request) -> JSONResponse:
        return JSONResponse(server.detokenize(await parse_body(raw_request, DetokenizeRequest)).model_dump())

    return app


class _Server(uvicorn.Server):
    """uvicorn, plus: the first SIGINT/SIGTERM also aborts the requests in flight, so that their
    connections close and the graceful shutdown does not wait for long generations to end."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        self.engine.stop_accepting()


def default_model_name(model: str | None) -> str:
    from tinyvllm.model.loader import EMBEDDED_MODEL_FILE

    return model if model is not None else EMBEDDED_MODEL_FILE.split(".")[0]


def _exit_cleanly(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def run_server(args: argparse.Namespace, config: EngineConfig) -> int:
    """`tinyvllm serve`: load the model, then serve until SIGINT/SIGTERM; returns 0 after a clean stop."""
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or os.environ.get("TINYVLLM_API_KEY") or None
    signal.signal(signal.SIGTERM, _exit_cleanly)  # while the model loads: nothing to shut down yet
    engine = AsyncLLMEngine.from_config(config)
    name = args.served_model_name or default_model_name(args.model)
    app = build_app(engine, name, api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            access_log=args.access_log, timeout_graceful_shutdown=args.shutdown_timeout,
                            lifespan="on")
    server = _Server(config, engine)
    logger.info("serving %s on http://%s:%d%s", name, args.host, args.port, " (API key required)" if api_key else "")
    # uvicorn re-raises the signal that stopped it once it has shut down; with these handlers in place
    # that re-raise does nothing, and a SIGINT/SIGTERM shutdown exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    server.run()
    engine.shutdown()
    return 0 if server.started else 1
