"""The OpenAI-compatible request and response bodies (pydantic), with vLLM's extra sampling fields.

A request body may carry only the fields below (StrictRequest: extra="forbid"): a field the server would
not act on is refused with a 400 that names it, rather than silently ignored (a client that asked for JSON
output must not get free text). A field sent as null, [] or {} asks for nothing and is dropped. Some
declared fields are accepted only with the values that ask for nothing (response_format, tools,
logit_bias...): the handlers check them. Range checks on sampling values are SamplingParams' job, so that
the offline and HTTP paths refuse the same things."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_INT64 = 2**63


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StrictRequest(OpenAIModel):
    """A request body (or a part of one): unknown fields are errors of type "extra_forbidden", which the
    server turns into a 400 naming them; unknown fields whose value asks for nothing are dropped first."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_empty_unknown(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if k in cls.model_fields or v not in (None, [], {})}
        return data


# ---- errors -----------------------------------------------------------------------------------------
class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# ---- shared -----------------------------------------------------------------------------------------
class StreamOptions(StrictRequest):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False
    include_obfuscation: bool | None = None  # OpenAI's padding of stream chunks: never added here (harmless)


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ResponseFields(OpenAIModel):
    """What every completion response and stream chunk carries around its choices (each subclass names
    its `object` and its kind of choice)."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Any]
    usage: UsageInfo | None = None


class SamplingFields(StrictRequest):
    """The sampling fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-_INT64, lt=_INT64)
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # metadata: accepted, unused
    logit_bias: dict[str, float] | None = None  # refused unless empty
    # vLLM's extra parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # each prompt token's logprob and the top ones at its place
    # Structured output: OpenAI's response_format, vLLM's structured_outputs ({"json": ..., "regex": ...,
    # "choice": [...], "grammar": ..., "json_object": true}) and its older guided_* spellings
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


# ---- /v1/completions --------------------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = 16  # OpenAI's (and vLLM's) default for the legacy completions API
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIModel):
    """vLLM's shape of a prompt logprob: in a list per prompt token (None for the first), by token id."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(ResponseFields):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


# ---- /v1/chat/completions ---------------------------------------------------------------------------
class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # (JSON text)


class ToolCall(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictRequest):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # (an assistant's earlier calls)
    tool_call_id: str | None = None  # (a tool's answer to one)


class FunctionDefinition(StrictRequest):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # (a JSON schema)
    strict: bool | None = None


class ChatTool(StrictRequest):
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: the rest of the context
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # vLLM's chat extras
    add_generation_prompt: bool = True
    chat_template: str | None = None
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none", "auto", "required" or {"type": "function", ...}
    # OpenAI's older function calling: refused unless they ask for nothing (see serving_chat)
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    # Metadata and hints that change nothing in the answer: accepted, unused
    store: bool | None = None  # (OpenAI's stored completions; the official clients send it)
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseFields):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(OpenAIModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIModel):
    """A streamed tool call's piece: the first names it (id, name), the others add to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseFields):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


# ---- /v1/models -------------------------------------------------------------------------------------
class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tinyvllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- /tokenize, /detokenize (vLLM's) ----------------------------------------------------------------
class TokenizeRequest(StrictRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictRequest):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str
