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
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinyvllm.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestAbortedError, RequestStream
from tinyvllm.engine.input_processor import InputError, ProcessedInput
from tinyvllm.outputs import Logprob
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.server.metrics import RequestTracker, ServerMetrics
from tinyvllm.server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SamplingFields,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)

logger = logging.getLogger("tinyvllm.server")

BodyT = TypeVar("BodyT", bound=BaseModel)

# Paths anyone may read even when the server has an API key (as vLLM: probes and scrapers hold no key).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 422: "BadRequestError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


class APIError(Exception):
    """An error the client caused or should know about, sent as OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    info = ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "Error"), param=param, code=status)
    return ErrorResponse(error=info).model_dump()


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


class _EventStream(StreamingResponse):
    """Server-sent events whose `on_close` runs however the response ends: finished, failed, or the
    client gone before the first byte (when the body generator never even starts)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


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


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class _Choice:
    """One completion (of one prompt) as its deltas arrive."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None


class OpenAIServer:
    """The routes' logic, over one engine and one served model name."""

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.tokenizer = engine.tokenizer
        self.inputs = engine.input_processor  # (it tokenizes with the server's own copy of the tokenizer)
        self.max_model_len = engine.max_model_len
        self.metrics = ServerMetrics(engine, served_model_name)

    # ---- checks and conversions -------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist: this server serves `{self.model_name}`.",
                           "model")

    def prompt_token_ids(self, prompt: Any) -> list[list[int]]:
        """A completion request's prompt (text, token ids, or a list of either) as token-id lists."""
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        return [self.inputs.tokenize(p)[1] for p in prompt]

    def process(self, token_ids: list[int], params: SamplingParams) -> ProcessedInput:
        return self.inputs.process(token_ids, params, decode_prompt=False)

    @staticmethod
    def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                n=body.n,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=-1 if body.top_k is None else body.top_k,
                min_p=0.0 if body.min_p is None else body.min_p,
                seed=body.seed,
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,
                stop=body.stop,
                stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                skip_special_tokens=body.skip_special_tokens,
                include_stop_str_in_output=body.include_stop_str_in_output,
            )
        except ValueError as e:
            raise APIError(400, str(e), _param_of(str(e), body)) from e

    async def add(self, requests: list[tuple[str, ProcessedInput]]) -> RequestStream:
        try:
            return await self.engine.add_requests(requests)
        except ValueError as e:
            raise APIError(400, str(e)) from e
        except EngineDeadError as e:
            raise APIError(503, str(e)) from e

    async def collect(self, stream: RequestStream, raw_request: Request, tracker: RequestTracker,
                      choices: dict[tuple[str, int], _Choice]) -> dict[str, int]:
        """Run a non-streamed request to its end, accumulating each completion's deltas; returns the
        cached prompt tokens per engine request. A client that goes away aborts it."""
        cached: dict[str, int] = {}

        async def consume() -> None:
            async for output in stream:
                tracker.observe(output)
                cached[output.request_id] = output.num_cached_tokens
                for completion in output.outputs:
                    choice = choices[(output.request_id, completion.index)]
                    choice.text.append(completion.text)
                    choice.token_ids.extend(completion.token_ids)
                    choice.logprobs.extend(completion.logprobs or [])
                    if completion.finish_reason is not None:
                        choice.finish_reason, choice.stop_reason = completion.finish_reason, completion.stop_reason

        task = asyncio.create_task(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await raw_request.is_disconnected():
                    raise _ClientGone()
            task.result()
        except (RequestAbortedError, EngineDeadError) as e:
            raise APIError(503, f"the request was aborted: {e}") from e
        finally:
            if not task.done():
                task.cancel()
            stream.abort()
        return cached

    # ---- /v1/completions --------------------------------------------------------------------------
    async def create_completion(self, body: CompletionRequest, raw_request: Request) -> Response:
        self.check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        if body.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of is not supported (other than best_of == n)", "best_of")
        prompts = self.prompt_token_ids(body.prompt)
        request_id = random_id("cmpl")
        params = self.sampling_params(body, body.max_tokens, body.logprobs)
        requests = [(f"{request_id}-{i}", self.process(ids, params)) for i, ids in enumerate(prompts)]
        choice_index = {(rid, k): i * body.n + k for i, (rid, _) in enumerate(requests) for k in range(body.n)}
        prompt_tokens = sum(len(p) for p in prompts)
        tracker = self.metrics.tracker()
        stream = await self.add(requests)
        if body.stream:
            options = body.stream_options
            return _EventStream(self._stream_completion(stream, request_id, choice_index, prompt_tokens, tracker,
                                                        body.logprobs, bool(options and options.include_usage),
                                                        bool(options and options.continuous_usage_stats)),
                                stream.abort)
        choices = {key: _Choice() for key in choice_index}
        cached = await self.collect(stream, raw_request, tracker, choices)
        result = []
        for key, choice in choices.items():
            logprobs = None
            if body.logprobs is not None:
                logprobs = _completion_logprobs(choice.token_ids, choice.logprobs, 0, self.tokenizer)
            result.append(CompletionChoice(index=choice_index[key], text="".join(choice.text), logprobs=logprobs,
                                           finish_reason=choice.finish_reason, stop_reason=choice.stop_reason))
        result.sort(key=lambda c: c.index)
        usage = _usage(prompt_tokens, sum(len(c.token_ids) for c in choices.values()), sum(cached.values()))
        response = CompletionResponse(id=request_id, model=self.model_name, choices=result, usage=usage)
        return JSONResponse(response.model_dump())

    async def _stream_completion(self, stream: RequestStream, request_id: str,
                                 choice_index: dict[tuple[str, int], int], prompt_tokens: int,
                                 tracker: RequestTracker, logprobs: int | None, include_usage: bool,
                                 continuous_usage: bool) -> AsyncIterator[str]:
        completion_tokens = 0
        cached: dict[str, int] = {}
        text_offsets = dict.fromkeys(choice_index.values(), 0)
        try:
            async for output in stream:
                tracker.observe(output)
                cached[output.request_id] = output.num_cached_tokens
                for completion in output.outputs:
                    completion_tokens += len(completion.token_ids)
                    # Nothing to show yet: a partial character, or text held back for `stop`. Without a
                    # tokenizer there is never text, and each step's new tokens make a chunk of their own.
                    shows = completion.text or (self.tokenizer is None and completion.token_ids)
                    if not shows and completion.finish_reason is None and logprobs is None:
                        continue
                    index = choice_index[(output.request_id, completion.index)]
                    choice_logprobs = None
                    if logprobs is not None:
                        choice_logprobs = _completion_logprobs(completion.token_ids, completion.logprobs or [],
                                                               text_offsets[index], self.tokenizer)
                        text_offsets[index] += sum(len(t) for t in choice_logprobs.tokens)
                    choice = CompletionChoice(index=index, text=completion.text, logprobs=choice_logprobs,
                                              finish_reason=completion.finish_reason,
                                              stop_reason=completion.stop_reason)
                    usage = (_usage(prompt_tokens, completion_tokens, sum(cached.values()))
                             if continuous_usage else None)
                    chunk = CompletionResponse(id=request_id, model=self.model_name, choices=[choice], usage=usage)
                    yield _sse(chunk.model_dump_json())
            if include_usage:
                chunk = CompletionResponse(id=request_id, model=self.model_name, choices=[],
                                           usage=_usage(prompt_tokens, completion_tokens, sum(cached.values())))
                yield _sse(chunk.model_dump_json())
        except (RequestAbortedError, EngineDeadError) as e:
            yield _sse(_json(error_body(503, f"the request was aborted: {e}")))
        finally:
            stream.abort()
        yield _sse("[DONE]")

    # ---- /v1/chat/completions ---------------------------------------------------------------------
    async def create_chat_completion(self, body: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_model(body.model)
        if not body.messages:
            raise APIError(400, "messages must not be empty", "messages")
        top_logprobs = None
        if body.logprobs:
            top_logprobs = body.top_logprobs or 0
        elif body.top_logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        ids = self.inputs.apply_chat_template(messages, body.add_generation_prompt, body.chat_template)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        processed = self.process(ids, self.sampling_params(body, requested, top_logprobs))
        request_id = random_id("chatcmpl")
        tracker = self.metrics.tracker()
        stream = await self.add([(request_id, processed)])
        if body.stream:
            options = body.stream_options
            return _EventStream(self._stream_chat(stream, request_id, body.n, len(ids), tracker, top_logprobs,
                                                  bool(options and options.include_usage),
                                                  bool(options and options.continuous_usage_stats)),
                                stream.abort)
        choices = {(request_id, k): _Choice() for k in range(body.n)}
        cached = await self.collect(stream, raw_request, tracker, choices)
        result = []
        for (_, index), choice in choices.items():
            logprobs = None
            if top_logprobs is not None:
                logprobs = ChatChoiceLogprobs(content=_chat_logprobs(choice.token_ids, choice.logprobs, top_logprobs,
                                                                     self.tokenizer))
            result.append(ChatCompletionChoice(index=index, message=ChatResponseMessage(content="".join(choice.text)),
                                               logprobs=logprobs, finish_reason=choice.finish_reason,
                                               stop_reason=choice.stop_reason))
        usage = _usage(len(ids), sum(len(c.token_ids) for c in choices.values()), sum(cached.values()))
        response = ChatCompletionResponse(id=request_id, model=self.model_name, choices=result, usage=usage)
        return JSONResponse(response.model_dump())

    async def _stream_chat(self, stream: RequestStream, request_id: str, n: int, prompt_tokens: int,
                           tracker: RequestTracker, top_logprobs: int | None, include_usage: bool,
                           continuous_usage: bool) -> AsyncIterator[str]:
        completion_tokens = 0
        cached = 0

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return _sse(ChatCompletionChunk(id=request_id, model=self.model_name, choices=choices,
                                            usage=usage).model_dump_json())

        try:
            for index in range(n):
                yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
            async for output in stream:
                tracker.observe(output)
                cached = output.num_cached_tokens
                for completion in output.outputs:
                    completion_tokens += len(completion.token_ids)
                    if not completion.text and completion.finish_reason is None and top_logprobs is None:
                        continue
                    logprobs = None
                    if top_logprobs is not None:
                        logprobs = ChatChoiceLogprobs(content=_chat_logprobs(
                            completion.token_ids, completion.logprobs or [], top_logprobs, self.tokenizer))
                    choice = ChatStreamChoice(index=completion.index, delta=DeltaMessage(content=completion.text),
                                              logprobs=logprobs, finish_reason=completion.finish_reason,
                                              stop_reason=completion.stop_reason)
                    usage = _usage(prompt_tokens, completion_tokens, cached) if continuous_usage else None
                    yield chunk([choice], usage)
            if include_usage:
                yield chunk([], _usage(prompt_tokens, completion_tokens, cached))
        except (RequestAbortedError, EngineDeadError) as e:
            yield _sse(_json(error_body(503, f"the request was aborted: {e}")))
        finally:
            stream.abort()
        yield _sse("[DONE]")

    # ---- the rest ---------------------------------------------------------------------------------
    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, root=self.engine.model_path,
                                         max_model_len=self.max_model_len)])

    def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        self.inputs.need_tokenizer("/tokenize")
        if body.prompt is not None:
            ids = self.inputs.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)[1]
        else:
            ids = self.inputs.apply_chat_template([m.model_dump(exclude_none=True) for m in body.messages or []],
                                                  body.add_generation_prompt, None)
        strs = list(self.tokenizer.convert_ids_to_tokens(ids)) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(body.model)
        self.inputs.check_token_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=self.inputs.need_tokenizer("/detokenize").decode(body.tokens))


class _ClientGone(Exception):
    """The client closed the connection before its (non-streamed) response was ready."""


def _json(body: dict[str, Any]) -> str:
    return json.dumps(body)


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def _token_text(token_id: int, logprob: Logprob, tokenizer: Any) -> str:
    if logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def _completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], text_offset: int,
                         tokenizer: Any) -> CompletionLogprobs:
    """OpenAI's legacy shape: per token its text, its logprob, and {text: logprob} of the top ones."""
    result = CompletionLogprobs()
    for token_id, entry in zip(token_ids, logprobs):
        chosen = entry[token_id]
        text = _token_text(token_id, chosen, tokenizer)
        result.tokens.append(text)
        result.token_logprobs.append(chosen.logprob)
        result.text_offset.append(text_offset)
        text_offset += len(text)
        ranked = sorted(entry.items(), key=lambda item: item[1].rank)
        result.top_logprobs.append({_token_text(t, lp, tokenizer): lp.logprob for t, lp in ranked})
    return result


def _chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int,
                   tokenizer: Any) -> list[TokenLogprob]:
    """The chat shape: per token its text, logprob and UTF-8 bytes, and the top_n most likely tokens."""
    result = []
    for token_id, entry in zip(token_ids, logprobs):
        chosen = entry[token_id]
        text = _token_text(token_id, chosen, tokenizer)
        top = sorted((item for item in entry.items() if item[1].rank <= top_n), key=lambda item: item[1].rank)
        result.append(TokenLogprob(
            token=text, logprob=chosen.logprob, bytes=list(text.encode()),
            top_logprobs=[TopLogprob(token=(s := _token_text(t, lp, tokenizer)), logprob=lp.logprob,
                                     bytes=list(s.encode())) for t, lp in top[:top_n]]))
    return result


def _param_of(message: str, body: Any) -> str | None:
    """The request field a SamplingParams message is about (its messages start with the field's name)."""
    word = message.split(" ", 1)[0]
    return word if word in type(body).model_fields else None


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
    server = OpenAIServer(engine, served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="tinyvllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
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

    @app.exception_handler(_ClientGone)
    async def _client_gone(request: Request, exc: _ClientGone) -> Response:
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
    async def metrics() -> Response:
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(server.models().model_dump())

    @app.post("/v1/completions")
    async def completions(raw_request: Request) -> Response:
        return await server.create_completion(await parse_body(raw_request, CompletionRequest), raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw_request: Request) -> Response:
        return await server.create_chat_completion(await parse_body(raw_request, ChatCompletionRequest),
                                                   raw_request)

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


def run_server(args: argparse.Namespace) -> int:
    """`tinyvllm serve`: load the model, then serve until SIGINT/SIGTERM; returns 0 after a clean stop."""
    from tinyvllm.cli import engine_kwargs
    from tinyvllm.config import EngineConfig

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or os.environ.get("TINYVLLM_API_KEY") or None
    signal.signal(signal.SIGTERM, _exit_cleanly)  # while the model loads: nothing to shut down yet
    engine = AsyncLLMEngine.from_config(EngineConfig(**engine_kwargs(args),
                                                     skip_tokenizer_init=args.skip_tokenizer_init))
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
