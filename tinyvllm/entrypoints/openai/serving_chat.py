"""POST /v1/chat/completions: the conversation through the model's chat template, n completions, answered
whole or streamed as server-sent events; `response_format` (and vLLM's structured_outputs) constrains the answer
(serving.structured_outputs_of), and `tools` with `tool_choice` give tool calls (tool_calls.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tinyvllm.engine.async_engine import AsyncLLMEngine, RequestStream
from tinyvllm.entrypoints.openai.chat_template import RequestTemplateRenderer
from tinyvllm.entrypoints.openai.metrics import RequestTracker, ServerMetrics
from tinyvllm.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)
from tinyvllm.entrypoints.openai.serving import (
    APIError,
    Choice,
    EventStream,
    OpenAIServing,
    Prepared,
    check_not_failed,
    prompt_logprobs_json,
    token_text,
    usage_info,
)
from tinyvllm.entrypoints.openai.tool_calls import (
    ToolMode,
    calls_of,
    template_tools,
    tool_constraint,
    tool_mode,
    tool_names,
)
from tinyvllm.outputs import Logprob
from tinyvllm.sampling_params import MAX_LOGPROBS


def refuse_unsupported(body: ChatCompletionRequest) -> None:
    """400 for what the server would not honour: OpenAI's older function calling (tools replace it)."""
    if body.functions:
        raise APIError(400, "functions are not supported: send them as tools (with tool_choice); remove functions "
                            "and function_call", "functions")
    if body.function_call not in (None, "none", "auto"):
        raise APIError(400, f"function_call {body.function_call!r} is not supported: use tool_choice; remove "
                            "function_call", "function_call")


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: AsyncLLMEngine, served_model_name: str, metrics: ServerMetrics,
                 request_templates: RequestTemplateRenderer | None = None) -> None:
        """request_templates: renders requests' own chat templates (--trust-request-chat-template); None refuses
        them."""
        super().__init__(engine, served_model_name, metrics)
        self.request_templates = request_templates

    def prepare(self, body: ChatCompletionRequest) -> Prepared:
        """Checks and the chat template (on the input thread)."""
        self.check_model(body.model)
        refuse_unsupported(body)
        if not body.messages:
            raise APIError(400, "messages must not be empty", "messages")
        top_logprobs = None
        if body.logprobs:
            top_logprobs = body.top_logprobs or 0
            if not 0 <= top_logprobs <= MAX_LOGPROBS:
                raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top_logprobs}",
                               "top_logprobs")
        elif body.top_logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        if body.stream and body.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs is not available with stream: remove one", "prompt_logprobs")
        mode = tool_mode(body)
        tools = template_tools(body, mode)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        self.inputs.check_text_length(messages, "messages")
        if body.chat_template is None:
            ids = self.inputs.apply_chat_template(messages, body.add_generation_prompt, None, tools)
        elif self.request_templates is None:
            raise APIError(400, "chat_template is refused: this server renders only the model's own chat template "
                                "(start it with --trust-request-chat-template to allow a request's own); remove it",
                           "chat_template")
        else:
            ids = self.request_templates.render(messages, body.add_generation_prompt, body.chat_template, tools)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = self.sampling_params(body, requested, top_logprobs, body.prompt_logprobs, tool_constraint(body, mode))
        processed = self.process(ids, params, body)
        request_id = random_id("chatcmpl")
        return Prepared(body, request_id, [(request_id, processed)], len(ids), top_logprobs)

    async def create_chat_completion(self, prepared: Prepared, raw_request: Request) -> Response:
        body: ChatCompletionRequest = prepared.body
        request_id, top_logprobs = prepared.request_id, prepared.logprobs
        mode = tool_mode(body)
        stream, tracker = await self.add(prepared, body.n)
        if body.stream:
            options = body.stream_options
            return EventStream(self._stream_chat(stream, request_id, body.n, prepared.prompt_tokens, tracker,
                                                 top_logprobs, bool(options and options.include_usage),
                                                 bool(options and options.continuous_usage_stats), mode,
                                                 tool_names(body)),
                               stream, tracker)
        choices = {(request_id, k): Choice() for k in range(body.n)}
        cached = await self.collect(stream, raw_request, tracker, choices)
        result = []
        for (_, index), choice in choices.items():
            logprobs = None
            if top_logprobs is not None:
                logprobs = ChatChoiceLogprobs(content=chat_logprobs(choice.token_ids, choice.logprobs, top_logprobs))
            content, calls = calls_of(mode, "".join(choice.text), tool_names(body))
            message = ChatResponseMessage(content=content, tool_calls=calls or None)
            result.append(ChatCompletionChoice(index=index, message=message, logprobs=logprobs,
                                               finish_reason=_finish(mode, calls, choice.finish_reason),
                                               stop_reason=choice.stop_reason))
        usage = usage_info(prepared.prompt_tokens, sum(len(c.token_ids) for c in choices.values()),
                           sum(cached.values()))
        prompt_logprobs = None
        if body.prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs_json(choices[(request_id, 0)].prompt_logprobs)
        response = ChatCompletionResponse(id=request_id, model=self.model_name, choices=result, usage=usage,
                                          prompt_logprobs=prompt_logprobs)
        return JSONResponse(response.model_dump())

    async def _stream_chat(self, stream: RequestStream, request_id: str, n: int, prompt_tokens: int,
                           tracker: RequestTracker, top_logprobs: int | None, include_usage: bool,
                           continuous_usage: bool, mode: ToolMode, names: set[str]) -> AsyncIterator[str]:
        """The chunks: each completion's text deltas as they come. A named tool call streams as OpenAI's do: its
        name first, then its arguments as they come; calls that must be read from the whole answer ("required",
        "auto") come with its last chunk, whole, or its text if it holds none."""
        completion_tokens = 0
        cached = 0
        whole = mode.kind in ("required", "auto")  # (the answer is read at its end)
        held: dict[int, Choice] = {index: Choice() for index in range(n)} if whole else {}
        call_ids: dict[int, str] = {}

        created = int(time.time())  # (one for every chunk of the stream, as OpenAI's)

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=choices,
                                       usage=usage).model_dump_json()

        for index in range(n):
            yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        async for output in stream:
            tracker.observe(output)
            check_not_failed(output)
            cached = output.num_cached_tokens
            for completion in output.outputs:
                completion_tokens += len(completion.token_ids)
                index, finish = completion.index, completion.finish_reason
                if whole:
                    kept = held[index]
                    kept.text.append(completion.text)
                    kept.token_ids += completion.token_ids
                    kept.logprobs += completion.logprobs or []
                    if finish is None:
                        continue
                    content, calls = calls_of(mode, "".join(kept.text), names)
                    delta = DeltaMessage(content=content, tool_calls=[
                        DeltaToolCall(index=i, id=call.id, type="function", function=DeltaFunctionCall(
                            name=call.function.name, arguments=call.function.arguments))
                        for i, call in enumerate(calls)] or None)
                    token_ids, token_logprobs, finish = kept.token_ids, kept.logprobs, _finish(mode, calls, finish)
                else:
                    first_call = mode.kind == "named" and index not in call_ids  # (it names the call)
                    if not completion.text and finish is None and top_logprobs is None and not first_call:
                        continue
                    delta = DeltaMessage(content=completion.text)
                    if mode.kind == "named":
                        call_id = call_ids.setdefault(index, random_id("call"))
                        delta = DeltaMessage(tool_calls=[DeltaToolCall(
                            index=0, id=call_id if first_call else None, type="function" if first_call else None,
                            function=DeltaFunctionCall(name=mode.name if first_call else None,
                                                       arguments=completion.text))])
                    token_ids, token_logprobs = completion.token_ids, completion.logprobs or []
                logprobs = None
                if top_logprobs is not None:
                    logprobs = ChatChoiceLogprobs(content=chat_logprobs(token_ids, token_logprobs, top_logprobs))
                choice = ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish,
                                          stop_reason=completion.stop_reason)
                usage = usage_info(prompt_tokens, completion_tokens, cached) if continuous_usage else None
                yield chunk([choice], usage)
        if include_usage:
            yield chunk([], usage_info(prompt_tokens, completion_tokens, cached))


def _finish(mode: ToolMode, calls: list, finish_reason: str | None) -> str | None:
    """OpenAI's finish reason: "tool_calls" where the model chose to call (a named call it was made to is "stop")."""
    return "tool_calls" if calls and mode.kind != "named" and finish_reason == "stop" else finish_reason


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int) -> list[TokenLogprob]:
    """The chat shape: per token its text, logprob and UTF-8 bytes, and the top_n most likely tokens."""
    result = []
    for token_id, entry in zip(token_ids, logprobs):
        chosen = entry[token_id]
        text = token_text(token_id, chosen)
        top = sorted((item for item in entry.items() if item[1].rank <= top_n), key=lambda item: item[1].rank)
        result.append(TokenLogprob(
            token=text, logprob=chosen.logprob, bytes=list(text.encode()),
            top_logprobs=[TopLogprob(token=(s := token_text(t, lp)), logprob=lp.logprob,
                                     bytes=list(s.encode())) for t, lp in top[:top_n]]))
    return result

