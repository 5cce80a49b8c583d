"""Reading tool calls out of a model's answer (tool_choice "auto", "required", named), in the syntaxes chat
templates teach: Hermes' <tool_call> tags and Llama 3's bare JSON."""

from __future__ import annotations

import json

from tinyvllm.entrypoints.openai.tool_calls import ToolMode, calls_of

AUTO = ToolMode("auto")
NAMES = {"get_weather", "get_time", "f", "a", "b", "run_sql"}


def _calls(text: str, mode: ToolMode = AUTO) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = calls_of(mode, text, NAMES)
    return content, [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_hermes_tags() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"timezone": "CET"}}</tool_call>')
    assert _calls(text) == ("Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "CET"})])
    assert _calls('<tool_call>{"name": "f", "arguments": {}}') == (None, [("f", {})])  # (cut before the tag closed)
    assert _calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert _calls('<tool_call>{"name": "nope", "arguments": {}}</tool_call>')[1] == []


def test_llama3_json() -> None:
    assert _calls('{"name": "get_weather", "parameters": {"city": "Oslo"}}') == (None, [("get_weather",
                                                                                       {"city": "Oslo"})])
    assert _calls('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}') == (
        None, [("a", {}), ("b", {"x": 1})])
    assert _calls('{"not": "a call"}') == ('{"not": "a call"}', [])
    # (an answer in JSON that names no tool is an answer; a ";" inside the arguments is theirs)
    assert _calls('{"name": "Alice", "age": 30}') == ('{"name": "Alice", "age": 30}', [])
    assert _calls('{"name": "run_sql", "parameters": {"q": "SELECT 1; SELECT 2"}}') == (
        None, [("run_sql", {"q": "SELECT 1; SELECT 2"})])
    assert _calls("The weather is fine.") == ("The weather is fine.", [])


def test_named_and_required() -> None:
    assert _calls('{"city": "Rome"}', ToolMode("named", "get_weather")) == (None, [("get_weather", {"city": "Rome"})])
    text = '[{"name": "get_time", "parameters": {"timezone": "UTC"}}]'
    assert _calls(text, ToolMode("required")) == (None, [("get_time", {"timezone": "UTC"})])
    assert _calls('[{"name": "get_ti', ToolMode("required")) == ('[{"name": "get_ti', [])  # (cut by max_tokens)
    assert _calls("plain", ToolMode("none")) == ("plain", [])
