"""What the OpenAI routes share: errors in OpenAI's shape, server-sent events, and OpenAIServing, the base
of the completion and chat handlers (model check, prompts through the engine's input processor, sampling
parameters, running a request to its end), which also answers /v1/models, /tokenize and /detokenize.

A handler works in two halves: `prepare(body)` does everything that takes CPU time in proportion to the
request (checks, tokenizing, the chat template) and runs on the server's one input thread (or, for a small
body while that thread is idle, on the event loop); the async half queues the engine requests and answers, on
the event loop."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tinyvllm.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestAbortedError, RequestStream
from tinyvllm.engine.input_processor import InputError, ProcessedInput
from tinyvllm.entrypoints.openai.metrics import RequestTracker, ServerMetrics
from tinyvllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    SamplingFields,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
)
from tinyvllm.outputs import Logprob, RequestOutput
from tinyvllm.sampling_params import SamplingParams, StructuredOutputsParams

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 413: "RequestTooLargeError", 422: "BadRequestError",
                500: "InternalServerError", 503: "ServiceUnavailableError"}


class RequestFailedError(Exception):
    """The engine failed on this request alone (finish_reason "error"): a 500, or an error event in a stream."""


REQUEST_FAILED = ("an internal error ended this request (the server's log has the details); the server goes on "
                  "serving others")


def check_not_failed(output: RequestOutput) -> None:
    """RequestFailedError if the engine failed on the request of `output` (which it then finished)."""
    if output.finished and any(c.finish_reason == "error" for c in output.outputs):
        raise RequestFailedError(REQUEST_FAILED)


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


_DONE_FRAME = "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """Server-sent events: each payload `events` yields, then `data: [DONE]`. If the engine aborts the
    request midway, an error event ends it instead. However the response ends (finished, failed, or the
    client gone before the first byte, when the generator never even starts), the engine requests are
    aborted, which frees their KV blocks, and the tracker counts the unfinished completions as aborted.

    `data: [DONE]` and the end of the body go out in one write: a client that stops reading at [DONE] (many
    do) then finds the connection's response complete and can reuse it; sent apart, the end often came after
    the client had given up on the connection, and its next request paid for a new one."""

    def __init__(self, events: AsyncIterator[str], stream: RequestStream, tracker: RequestTracker) -> None:
        super().__init__(self._frames(events, stream, tracker), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream = stream
        self._tracker = tracker

    @staticmethod
    async def _frames(events: AsyncIterator[str], stream: RequestStream,
                      tracker: RequestTracker) -> AsyncIterator[str]:
        try:
            async for payload in events:
                yield f"data: {payload}\n\n"
        except (RequestAbortedError, EngineDeadError) as e:
            yield f"data: {json.dumps(error_body(503, f'the request was aborted: {e}'))}\n\n"
        except RequestFailedError as e:
            yield f"data: {json.dumps(error_body(500, str(e)))}\n\n"
        finally:
            stream.abort()
            tracker.close()
        yield _DONE_FRAME

    async def stream_response(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for frame in self.body_iterator:  # (_frames: [DONE] is its last)
            await send({"type": "http.response.body", "body": frame.encode(), "more_body": frame is not _DONE_FRAME})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.abort()
            self._tracker.close()


@dataclass
class Prepared:
    """A request through its checks, tokenized (what a handler's `prepare` returns): its engine requests,
    each (request id, checked input)."""

    body: Any
    request_id: str
    requests: list[tuple[str, ProcessedInput]]
    prompt_tokens: int
    logprobs: int | None = None
    echo: dict[str, Any] | None = None  # (completions' echo) engine request id -> what its choices start with


class Choice:
    """One completion (of one prompt) as its deltas arrive."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # (its request's)


class OpenAIServing:
    """The handlers' common ground, over one engine and one served model name."""

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.tokenizer = engine.tokenizer
        self.inputs = engine.input_processor  # (it tokenizes with the server's own copy of the tokenizer)
        self.max_model_len = engine.max_model_len
        self.metrics = metrics

    # ---- checks and conversions -------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist: this server serves `{self.model_name}`.",
                           "model")

    def prompt_token_ids(self, prompt: Any) -> list[list[int]]:
        """A completion request's prompt (text, token ids, or a list of either) as token-id lists; a text
        too long to fit is refused before any is tokenized."""
        # (one prompt of token ids by its first item: the input processor checks every id, in C)
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        for p in prompt:
            if isinstance(p, str):
                self.inputs.check_text_length(p)
        return [self.inputs.tokenize(p)[1] for p in prompt]

    def process(self, token_ids: list[int], params: SamplingParams, body: SamplingFields | None = None,
                scoring: bool = False) -> ProcessedInput:
        """The input processor's checks (scoring: InputProcessor.process's); a constraint on the output that does
        not compile is the fault of the field that gave it."""
        try:
            return self.inputs.process(token_ids, params, decode_prompt=False, scoring=scoring)
        except InputError as e:
            if e.param == "structured_outputs" and body is not None:
                field = next(iter(constraint_fields(body)), e.param)
                raise InputError(re.sub(r"^structured_outputs\.\w+", field, str(e)), field) from None
            raise

    @staticmethod
    def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        tool_constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        """The request's SamplingParams; tool_constraint: what a named or required tool_choice holds the answer to
        (it and the request's own constraint cannot both hold)."""
        if body.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server: remove it", "logit_bias")
        structured_outputs = structured_outputs_of(body)
        if tool_constraint is not None:
            if structured_outputs is not None:
                raise APIError(400, "a named or \"required\" tool_choice holds the answer to a tool call, and so "
                                    "would response_format (or structured_outputs): send one of them", "tool_choice")
            structured_outputs = tool_constraint
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
                prompt_logprobs=prompt_logprobs,
                structured_outputs=structured_outputs,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                skip_special_tokens=body.skip_special_tokens,
                include_stop_str_in_output=body.include_stop_str_in_output,
            )
        except ValueError as e:
            raise APIError(400, str(e), param_of(str(e), body)) from e

    async def add(self, prepared: Prepared, n: int) -> tuple[RequestStream, RequestTracker]:
        """Queue the engine requests; their stream, and the tracker of their completions (n each)."""
        try:
            stream = await self.engine.add_requests(prepared.requests)
        except ValueError as e:
            raise APIError(400, str(e)) from e
        except EngineDeadError as e:
            raise APIError(503, str(e)) from e
        return stream, self.metrics.tracker([request_id for request_id, _ in prepared.requests], n)

    async def collect(self, stream: RequestStream, raw_request: Request, tracker: RequestTracker,
                      choices: dict[tuple[str, int], Choice]) -> dict[str, int]:
        """Run a non-streamed request to its end, accumulating each completion's deltas; returns the
        cached prompt tokens per engine request. A client that goes away aborts it."""
        cached: dict[str, int] = {}

        async def consume() -> None:
            async for output in stream:
                tracker.observe(output)
                check_not_failed(output)
                cached[output.request_id] = output.num_cached_tokens
                for completion in output.outputs:
                    choice = choices[(output.request_id, completion.index)]
                    if output.prompt_logprobs is not None:
                        choice.prompt_logprobs = output.prompt_logprobs
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
                    raise ClientGone()
            task.result()
        except (RequestAbortedError, EngineDeadError) as e:
            raise APIError(503, f"the request was aborted: {e}") from e
        except RequestFailedError as e:
            raise APIError(500, str(e)) from e
        finally:
            if not task.done():
                task.cancel()
            stream.abort()
            tracker.close()
        return cached

    # ---- the rest ---------------------------------------------------------------------------------
    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, root=self.engine.model_path,
                                         max_model_len=self.max_model_len)])

    def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """(On the input thread.)"""
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        self.inputs.need_tokenizer("/tokenize")
        if body.prompt is not None:
            self.inputs.check_text_length(body.prompt)
            ids = self.inputs.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)[1]
        else:
            messages = [m.model_dump(exclude_none=True) for m in body.messages or []]
            self.inputs.check_text_length(messages, "messages")
            ids = self.inputs.apply_chat_template(messages, body.add_generation_prompt, None)
        strs = list(self.tokenizer.convert_ids_to_tokens(ids)) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: what a client needs to tokenize and template as the server does (evaluation
        harnesses ask it instead of looking for the model's tokenizer elsewhere)."""
        tokenizer = self.inputs.need_tokenizer("/tokenizer_info")
        info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__, "model_max_length": self.max_model_len,
                                "chat_template": getattr(tokenizer, "chat_template", None)}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            token = getattr(tokenizer, name, None)
            info[name] = token if isinstance(token, str) else None
        return info

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """(On the input thread.)"""
        self.check_model(body.model)
        self.inputs.check_token_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=self.inputs.need_tokenizer("/detokenize").decode(body.tokens))


class ClientGone(Exception):
    """The client closed the connection before its (non-streamed) response was ready."""


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def token_text(token_id: int, logprob: Logprob) -> str:
    """A logprob's token as text (the engine decodes it when it has a tokenizer: the server's copy is for
    the input thread only)."""
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def constraint_fields(body: Any) -> list[str]:
    """The request's fields that constrain its output: response_format (OpenAI's json_object and json_schema, not
    plain text), structured_outputs (vLLM's) or a guided_* field (vLLM's older spellings), and (chat) tools, whose
    named or required tool_choice is held to a schema."""
    fmt = getattr(body, "response_format", None)
    given = [name for name in ("structured_outputs", *_GUIDED, "tools") if getattr(body, name, None) is not None]
    return (["response_format"] if fmt is not None and fmt.get("type", "text") != "text" else []) + given


def structured_outputs_of(body: SamplingFields) -> StructuredOutputsParams | None:
    """The request's own constraint on its output, from whichever one field gives it (constraint_fields, tools
    aside: tool_calls.py holds calls to theirs)."""
    given = [name for name in constraint_fields(body) if name != "tools"]
    fmt = body.response_format
    if not given:
        return None
    if len(given) > 1:
        raise APIError(400, f"{' and '.join(given)} each constrain the output: send one of them", given[1])
    field = given[0]
    try:
        if field == "response_format":
            kind = fmt.get("type")
            if kind == "json_object":
                return StructuredOutputsParams(json_object=True)
            if kind != "json_schema":
                raise APIError(400, f"response_format of type {kind!r} is not supported: use \"text\", "
                                    "\"json_object\" or \"json_schema\"", field)
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise APIError(400, "response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                                    "{...}}}", field)
            return StructuredOutputsParams(json=schema)
        if field == "structured_outputs":
            unknown = set(body.structured_outputs) - {"json", "regex", "choice", "grammar", "json_object"}
            if unknown:
                raise APIError(400, f"structured_outputs has no field {sorted(unknown)[0]!r}: give one of json, "
                                    "regex, choice, grammar and json_object", field)
            return StructuredOutputsParams(**body.structured_outputs)
        return StructuredOutputsParams(**{_GUIDED[field]: getattr(body, field)})
    except ValueError as e:
        raise APIError(400, str(e), field) from e


def prompt_logprobs_json(prompt_logprobs: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
    """vLLM's response shape of prompt logprobs: per prompt token, by token id, its logprob, rank and text."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else {str(t): PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                                               decoded_token=lp.decoded_token)
                                        for t, lp in entry.items()} for entry in prompt_logprobs]


def param_of(message: str, body: Any) -> str | None:
    """The request field a SamplingParams message is about (its messages start with the field's name)."""
    word = message.split(" ", 1)[0]
    return word if word in type(body).model_fields else None

