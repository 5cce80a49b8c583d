"""POST /v1/completions: one engine request per prompt, answered whole or streamed as server-sent events.

With `echo` a choice's text starts with its prompt, and with `logprobs` too its logprobs start with the prompt's
(the first token's `null`), as OpenAI's legacy API and vLLM answer: what evaluation harnesses score a text by.
`max_tokens` 0 then echoes the prompt alone. `prompt_logprobs` (vLLM's) returns them in vLLM's own shape."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tinyvllm.engine.async_engine import RequestStream
from tinyvllm.entrypoints.openai.metrics import RequestTracker
from tinyvllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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
from tinyvllm.outputs import Logprob, PromptLogprobs


@dataclass
class Echo:
    """What `echo` puts before a prompt's completions: its text and tokens, and its first token's text (which has
    no logprob to bring its text along)."""

    text: str
    token_ids: list[int]
    first_token: str


class OpenAIServingCompletion(OpenAIServing):
    def prepare(self, body: CompletionRequest) -> Prepared:
        """Checks and tokenizing (on the input thread)."""
        self.check_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported by this server: remove it", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of is not supported (other than best_of == n): use n", "best_of")
        if body.stream and body.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs is not available with stream: remove one (echo with logprobs "
                                "streams the prompt's logprobs in its first chunk)", "prompt_logprobs")
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens must be at least 1, or 0 with echo (the prompt alone)", "max_tokens")
        prompts = self.prompt_token_ids(body.prompt)
        request_id = random_id("cmpl")
        prompt_logprobs = body.prompt_logprobs
        if prompt_logprobs is None and body.echo:
            prompt_logprobs = body.logprobs
        # (max_tokens 0: the engine draws one token, which the answer leaves out)
        params = self.sampling_params(body, 1 if body.max_tokens == 0 else body.max_tokens, body.logprobs,
                                      prompt_logprobs)
        requests = [(f"{request_id}-{i}", self.process(ids, params, body, scoring=body.max_tokens == 0))
                    for i, ids in enumerate(prompts)]
        prepared = Prepared(body, request_id, requests, sum(len(p) for p in prompts), body.logprobs)
        if body.echo:
            texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
            prepared.echo = {rid: self._echo(text if isinstance(text, str) else None, ids)
                             for (rid, _), text, ids in zip(requests, texts, prompts)}
        return prepared

    def _echo(self, text: str | None, ids: list[int]) -> Echo:
        """A prompt's echo: its text as sent, or its ids decoded (on the input thread: the tokenizer's)."""
        if self.tokenizer is None:
            return Echo(text or "", ids, f"token_id:{ids[0]}")
        return Echo(self.tokenizer.decode(ids) if text is None else text, ids, self.tokenizer.decode([ids[0]]))

    async def create_completion(self, prepared: Prepared, raw_request: Request) -> Response:
        body: CompletionRequest = prepared.body
        request_id, prompt_tokens = prepared.request_id, prepared.prompt_tokens
        choice_index = {(rid, k): i * body.n + k for i, (rid, _) in enumerate(prepared.requests)
                        for k in range(body.n)}
        stream, tracker = await self.add(prepared, body.n)
        generates = body.max_tokens != 0
        if body.stream:
            options = body.stream_options
            return EventStream(self._stream_completion(stream, request_id, choice_index, prompt_tokens, tracker,
                                                        body.logprobs, bool(options and options.include_usage),
                                                        bool(options and options.continuous_usage_stats),
                                                        prepared.echo, generates),
                               stream, tracker)
        choices = {key: Choice() for key in choice_index}
        cached = await self.collect(stream, raw_request, tracker, choices)
        result = []
        for key, choice in choices.items():
            if not generates:
                choice.text, choice.token_ids, choice.logprobs = [], [], []
            echo = prepared.echo[key[0]] if prepared.echo else None
            text = "".join(choice.text) if echo is None else echo.text + "".join(choice.text)
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(choice.token_ids, choice.logprobs, 0, echo, choice.prompt_logprobs)
            result.append(CompletionChoice(index=choice_index[key], text=text, logprobs=logprobs,
                                           finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                                           prompt_logprobs=prompt_logprobs_json(choice.prompt_logprobs)
                                           if body.prompt_logprobs is not None else None))
        result.sort(key=lambda c: c.index)
        usage = usage_info(prompt_tokens, sum(len(c.token_ids) for c in choices.values()), sum(cached.values()))
        response = CompletionResponse(id=request_id, model=self.model_name, choices=result, usage=usage)
        return JSONResponse(response.model_dump())

    async def _stream_completion(self, stream: RequestStream, request_id: str,
                                 choice_index: dict[tuple[str, int], int], prompt_tokens: int,
                                 tracker: RequestTracker, logprobs: int | None, include_usage: bool,
                                 continuous_usage: bool, echoes: dict[str, Echo] | None,
                                 generates: bool) -> AsyncIterator[str]:
        """The stream's chunks: each completion's deltas as they come, its echo (text and prompt logprobs) with its
        first; with max_tokens 0 the echo alone, and the finish."""
        completion_tokens = 0
        cached: dict[str, int] = {}
        text_offsets = dict.fromkeys(choice_index.values(), 0)
        echoed: set[int] = set()
        prompt_logprobs: dict[str, PromptLogprobs] = {}
        created = int(time.time())  # (one for every chunk of the stream, as OpenAI's)
        async for output in stream:
            tracker.observe(output)
            check_not_failed(output)
            cached[output.request_id] = output.num_cached_tokens
            if output.prompt_logprobs is not None:  # (in the request's first output)
                prompt_logprobs[output.request_id] = output.prompt_logprobs
            for completion in output.outputs:
                if not generates:
                    completion.text, completion.token_ids, completion.logprobs = "", [], []
                completion_tokens += len(completion.token_ids)
                index = choice_index[(output.request_id, completion.index)]
                echo = echoes[output.request_id] if echoes is not None and index not in echoed else None
                # Nothing to show yet: a partial character, or text held back for `stop`. Without a
                # tokenizer there is never text, and each step's new tokens make a chunk of their own.
                shows = completion.text or (self.tokenizer is None and completion.token_ids)
                if not shows and completion.finish_reason is None and logprobs is None and echo is None:
                    continue
                text = completion.text
                if echo is not None:
                    echoed.add(index)
                    text = echo.text + text
                choice_logprobs = None
                if logprobs is not None:
                    choice_logprobs = completion_logprobs(completion.token_ids, completion.logprobs or [],
                                                           text_offsets[index], echo,
                                                           prompt_logprobs.get(output.request_id))
                    text_offsets[index] += sum(len(t) for t in choice_logprobs.tokens)
                choice = CompletionChoice(index=index, text=text, logprobs=choice_logprobs,
                                          finish_reason=completion.finish_reason,
                                          stop_reason=completion.stop_reason)
                usage = (usage_info(prompt_tokens, completion_tokens, sum(cached.values()))
                         if continuous_usage else None)
                chunk = CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[choice],
                                           usage=usage)
                yield chunk.model_dump_json()
        if include_usage:
            chunk = CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                       usage=usage_info(prompt_tokens, completion_tokens, sum(cached.values())))
            yield chunk.model_dump_json()


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], text_offset: int,
                        echo: Echo | None = None, prompt_logprobs: PromptLogprobs | None = None) -> CompletionLogprobs:
    """OpenAI's legacy shape: per token its text, its logprob, and {text: logprob} of the top ones; with an echo,
    the prompt's tokens first (the first with null logprobs: nothing comes before it)."""
    result = CompletionLogprobs()
    if echo is not None:
        assert prompt_logprobs is not None, "an echo with logprobs needs the prompt's"
        result.tokens.append(echo.first_token)
        result.token_logprobs.append(None)
        result.top_logprobs.append(None)
        result.text_offset.append(text_offset)
        text_offset += len(echo.first_token)
        token_ids, logprobs = echo.token_ids[1:] + token_ids, prompt_logprobs[1:] + logprobs
    for token_id, entry in zip(token_ids, logprobs):
        chosen = entry[token_id]
        text = token_text(token_id, chosen)
        result.tokens.append(text)
        result.token_logprobs.append(chosen.logprob)
        result.text_offset.append(text_offset)
        text_offset += len(text)
        ranked = sorted(entry.items(), key=lambda item: item[1].rank)
        result.top_logprobs.append({token_text(t, lp): lp.logprob for t, lp in ranked})
    return result

