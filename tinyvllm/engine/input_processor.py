"""The input processor: from what a caller gives (text, token ids, a prompt dict, or a chat conversation)
to the token ids and parameters the engine core takes, with every check a request must pass first. Each
rule lives here once; LLM, the CLI and the server all go through it, so they refuse the same requests
with the same messages."""

from __future__ import annotations

import array
import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from tinyvllm.engine.structured_output import check_structured_outputs
from tinyvllm.sampling_params import SamplingParams

# A prompt as callers give it: text, token ids, or {"prompt": text} / {"prompt_token_ids": ids}
PromptType = str | list[int] | dict[str, Any]
Message = dict[str, Any]


class InputError(ValueError):
    """A request the engine cannot take, with a message that says why; `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ProcessedInput:
    prompt: str | None  # the prompt's text (decoded from the ids when it came as ids and there is a tokenizer)
    prompt_token_ids: list[int]
    params: SamplingParams  # max_tokens filled in


class InputProcessor:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, kv_capacity_tokens: int,
                 max_n: int = 128) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv_capacity_tokens = kv_capacity_tokens
        self.max_n = max_n

    def need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise InputError(f"{what} needs a tokenizer, and this engine runs with skip_tokenizer_init: "
                             "give prompts as token ids")
        return self.tokenizer

    # ---- prompts ----------------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and its token ids, checked."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InputError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise InputError("the prompt is empty", "prompt")
            tokenizer = self.need_tokenizer("a text prompt")
            try:
                token_ids = list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
            except (TypeError, UnicodeError) as e:  # (a lone surrogate: not Unicode text)
                raise InputError(f"the prompt is not valid Unicode text: {e}", "prompt") from None
            if not token_ids:
                raise InputError("the prompt encodes to no tokens", "prompt")
            return prompt, token_ids
        if isinstance(prompt, (list, tuple)) and not prompt:
            raise InputError("the prompt is empty", "prompt")
        return None, self.check_token_ids(prompt, "prompt")

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: its vocabulary's longest entry (added tokens included).
        Byte-level BPE spells each byte as one character and SentencePiece each character as itself (its
        byte-fallback entries spell one byte in six), so no token decodes to more characters than its entry
        has, as long as the tokenizer's normalizer drops no characters (theirs do not)."""
        vocab = self.need_tokenizer("counting a text's tokens").get_vocab()
        return max(map(len, vocab), default=1) or 1

    def check_text_length(self, text: str | list[Message], param: str = "prompt") -> None:
        """Refuse, before tokenizing it, a text that cannot fit the context: of more characters than
        max_model_len tokens of the longest kind can spell (tokenizing megabytes only to refuse them takes
        seconds). `text`: a prompt, or a conversation (its messages' text counts). Without a tokenizer
        there is nothing to check: a text is refused as such where it is tokenized."""
        if self.tokenizer is None:
            return
        if isinstance(text, str):
            num_chars, what = len(text), "the prompt"
        else:
            num_chars, what = 0, "the messages' text"
            for message in text:
                content = message.get("content") if isinstance(message, dict) else None
                if isinstance(content, str):
                    num_chars += len(content)
                elif isinstance(content, list):
                    num_chars += sum(len(part["text"]) for part in content
                                     if isinstance(part, dict) and isinstance(part.get("text"), str))
        limit = self.max_model_len * self.max_token_chars
        if num_chars > limit:
            raise InputError(f"{what} has {num_chars:,} characters: more than the {limit:,} that could fit in the "
                             f"model's context of {self.max_model_len} tokens (of at most {self.max_token_chars} "
                             "characters each); shorten the text", param)

    def check_token_ids(self, token_ids: Any, param: str) -> list[int]:
        """The ids as a list of Python ints; refuses anything but a list (or tuple) of ints in [0, vocab_size).
        array.array does the type check and numpy the range check, each in C: a batch of long prompts is hundreds
        of thousands of ids, too many for a Python loop over them (benchmarks/RESULTS.md)."""
        try:
            ids = array.array("q", token_ids) if isinstance(token_ids, (list, tuple)) else None
        except (TypeError, OverflowError):  # (not an int, or not one of 64 bits)
            ids = None
        if ids is None:
            raise InputError("a prompt is a string or a list of token ids" if param == "prompt" else
                             f"{param} must be a list of token ids", param)
        values = np.frombuffer(ids, dtype=np.int64)
        if values.size and (values.min() < 0 or values.max() >= self.vocab_size):
            bad = values[(values < 0) | (values >= self.vocab_size)]
            raise InputError(f"token ids must be in [0, {self.vocab_size}); got {bad[:5].tolist()}", param)
        return ids.tolist()

    def apply_chat_template(self, conversation: list[Message], add_generation_prompt: bool = True,
                            chat_template: str | None = None, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """A conversation ({"role", "content"} messages; content a string or a list of text parts) as the
        token ids of the model's chat template (or of `chat_template`), which also receives the tools."""
        return apply_chat_template(self.need_tokenizer("a chat conversation"), conversation, add_generation_prompt,
                                   chat_template, tools)

    # ---- whole requests ---------------------------------------------------------------------------
    def process(self, prompt: PromptType, params: SamplingParams, decode_prompt: bool = True,
                scoring: bool = False) -> ProcessedInput:
        """Everything a request needs checked before the engine takes it; raises InputError. decode_prompt:
        give a prompt of token ids its text too (as RequestOutput.prompt), when there is a tokenizer. scoring: the
        request keeps no token it draws (an echo of the prompt alone, to score it), so the prompt may fill the
        whole context."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, not {type(params).__name__}")
        if params.n > self.max_n:
            raise InputError(f"n is {params.n}: this engine gives one request at most {self.max_n} completions "
                             "(its max_n)", "n")
        if params.stop_token_ids:
            self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        text, token_ids = self.tokenize(prompt)
        if self.tokenizer is None and params.stop_strings:
            raise InputError("stop strings need a tokenizer, and this engine runs with skip_tokenizer_init", "stop")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise InputError("structured output needs a tokenizer, and this engine runs with skip_tokenizer_init",
                                 "structured_outputs")
            try:
                check_structured_outputs(params.structured_outputs)
            except ValueError as e:
                raise InputError(str(e), "structured_outputs") from None
        max_tokens = self.check_length(len(token_ids), params.max_tokens, scoring)
        if params.min_tokens > max_tokens:
            raise InputError(f"min_tokens is {params.min_tokens}, but the prompt's {len(token_ids)} tokens leave room "
                             f"for {max_tokens} within the model's context of {self.max_model_len}: lower min_tokens",
                             "min_tokens")
        if params.max_tokens is None:
            fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
            params = SamplingParams(**{**fields, "max_tokens": max_tokens})
        if text is None and decode_prompt and self.tokenizer is not None:
            text = self.tokenizer.decode(token_ids)
        return ProcessedInput(text, token_ids, params)

    def check_length(self, prompt_len: int, max_tokens: int | None, scoring: bool = False) -> int:
        """max_tokens (the rest of the context when None), if prompt and completion fit the context and
        the KV cache (scoring: the one token drawn after a prompt that fills the context is dropped, not stored)."""
        limit = self.max_model_len
        if scoring and prompt_len == limit and max_tokens == 1:
            limit += 1
        if prompt_len >= limit:
            raise InputError(f"the prompt has {prompt_len} tokens, which leaves no room to generate within the "
                             f"model's context of {limit} tokens: shorten the prompt", "prompt")
        if max_tokens is None:
            max_tokens = limit - prompt_len
        elif prompt_len + max_tokens > limit:
            raise InputError(f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}: together "
                             f"{prompt_len + max_tokens}, beyond the model's context of {limit} tokens; reduce "
                             "the prompt or max_tokens", "max_tokens")
        if prompt_len + max_tokens > self.kv_capacity_tokens:
            raise InputError(f"the request needs up to {prompt_len + max_tokens} tokens of KV cache, but the whole "
                             f"cache holds {self.kv_capacity_tokens}: lower max_tokens or give the cache more memory",
                             "max_tokens")
        return max_tokens


def apply_chat_template(tokenizer: Any, conversation: list[Message], add_generation_prompt: bool = True,
                        chat_template: str | None = None, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """InputProcessor.apply_chat_template's work, for a tokenizer (also run apart, in a process of its own, by the
    server for a request's own template: entrypoints/openai/chat_template.py)."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InputError("this model has no chat template: send a plain prompt, or give a chat_template",
                         "messages")
    if not conversation:
        raise InputError("messages must not be empty", "messages")
    messages = []
    for message in conversation:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"),
                                                                                               str):
                    raise InputError("only text content parts are supported", "messages")
                parts.append(part["text"])
            content = "\n".join(parts)
        message = {**message, "content": content or ""}
        if message.get("tool_calls"):  # (templates read a call's arguments as a mapping: OpenAI sends JSON text)
            message["tool_calls"] = [_with_parsed_arguments(call) for call in message["tool_calls"]]
        messages.append(message)
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            tokenize=True, chat_template=chat_template, tools=tools)
    except MemoryError:
        raise
    except Exception as e:  # jinja2 errors: a template, or messages the template refuses
        raise InputError(f"cannot apply the chat template: {e or type(e).__name__}", "messages") from e
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _with_parsed_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
        except ValueError:
            pass
    return call
