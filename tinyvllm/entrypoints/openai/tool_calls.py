"""Tool calls on /v1/chat/completions, as OpenAI's API and vLLM's server give them.

`tool_choice` picks how (ToolMode): "none" answers in text; a named function, or "required" (at least one call to
any of the tools), holds the answer to a JSON schema (structured output), so the call is always well formed; "auto"
lets the model answer freely and reads the calls it writes in either syntax chat templates teach: Hermes'
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen, Hermes, SmolLM) or Llama 3's bare
`{"name": ..., "parameters": {...}}` (after an optional `<|python_tag|>`, several separated by `;`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tinyvllm.entrypoints.openai.protocol import ChatCompletionRequest, FunctionCall, ToolCall
from tinyvllm.entrypoints.openai.serving import APIError
from tinyvllm.sampling_params import StructuredOutputsParams

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolMode:
    kind: str  # "none", "auto", "required" or "named"
    name: str | None = None  # (named) the function


def tool_mode(body: ChatCompletionRequest) -> ToolMode:
    """The request's tool_choice, checked against its tools (OpenAI's default: "auto" with tools, else "none")."""
    choice, tools = body.tool_choice, body.tools or []
    names = [tool.function.name for tool in tools]
    if choice is None:
        return ToolMode("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice must be \"none\", \"auto\", \"required\" or a named function, not "
                                f"{choice!r}", "tool_choice")
        if choice == "required" and not tools:
            raise APIError(400, "tool_choice \"required\" needs tools: send the functions in tools", "tool_choice")
        return ToolMode(choice if tools else "none")  # ("auto" with nothing to call asks for nothing)
    name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise APIError(400, "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                       "tool_choice")
    if name not in names:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools ({', '.join(names) or 'none'}):"
                            " name one of them", "tool_choice")
    return ToolMode("named", name)


def _parameters(body: ChatCompletionRequest, name: str) -> dict[str, Any]:
    function = next(tool.function for tool in body.tools or [] if tool.function.name == name)
    return function.parameters or {"type": "object"}


def tool_constraint(body: ChatCompletionRequest, mode: ToolMode) -> StructuredOutputsParams | None:
    """What holds the answer to a well-formed call: the named function's parameters, or (required) a list of calls,
    each {"name": one of the tools, "parameters": its parameters} (vLLM's schema for it)."""
    if mode.kind == "named":
        return StructuredOutputsParams(json=_parameters(body, mode.name))
    if mode.kind == "required":
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                                   "parameters": tool.function.parameters or {"type": "object"}},
                  "required": ["name", "parameters"]} for tool in body.tools or []]
        return StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": {"anyOf": calls}})
    return None


def template_tools(body: ChatCompletionRequest, mode: ToolMode) -> list[dict[str, Any]] | None:
    """The tools as the chat template receives them (none with tool_choice "none")."""
    if mode.kind == "none" or not body.tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in body.tools]


def _call(name: Any, arguments: Any, names: set[str]) -> ToolCall | None:
    """A call to one of the tools (`names`), or None: a JSON object whose "name" is no tool is an answer."""
    if not isinstance(name, str) or name not in names:
        return None
    text = arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {})
    return ToolCall(function=FunctionCall(name=name, arguments=text))


def _json_objects(text: str) -> list[Any] | None:
    """The JSON values of `text`, separated by whitespace or ";" (Llama 3's several calls), or None if it holds
    anything else."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


def calls_of(mode: ToolMode, text: str, names: set[str] | None = None) -> tuple[str | None, list[ToolCall]]:
    """The answer's text and tool calls: (content, calls). A named call is the whole text (its arguments); a
    required one a JSON list of {"name", "parameters"}; an automatic one the calls to the tools (`names`) that the
    text holds, the rest its content (an answer that names no tool is all content)."""
    names = names or set()
    if mode.kind == "named":
        return None, [ToolCall(function=FunctionCall(name=mode.name, arguments=text))]
    if mode.kind == "required":
        items = _json_objects(text)
        if not items or not isinstance(items[0], list):
            return text, []  # (cut short by max_tokens)
        calls = [_call(item.get("name"), item.get("parameters"), names) for item in items[0] if isinstance(item, dict)]
        return None, [c for c in calls if c is not None]
    if mode.kind != "auto":
        return text, []
    if "<tool_call>" in text:
        calls = []
        for match in _HERMES.finditer(text):
            items = _json_objects(match.group(1))
            item = items[0] if items and len(items) == 1 else None
            if isinstance(item, dict) and (call := _call(item.get("name"), item.get("arguments"), names)):
                calls.append(call)
        if not calls:
            return text, []
        return _HERMES.sub("", text).strip() or None, calls
    items = _json_objects(text.strip().removeprefix(_PYTHON_TAG))
    if not items or not all(isinstance(item, dict) for item in items):
        return text, []
    calls = [_call(item.get("name"), item.get("parameters", item.get("arguments")), names) for item in items]
    if any(call is None for call in calls):
        return text, []
    return None, [call for call in calls if call is not None]


def tool_names(body: ChatCompletionRequest) -> set[str]:
    """The names a call may have."""
    return {tool.function.name for tool in body.tools or []}
