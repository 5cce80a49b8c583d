"""POST /v1/completions: one engine request per prompt, answered whole or streamed as server-sent events."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

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
    token_text,
    usage_info,
)
from tinyvllm.outputs import Logprob


class OpenAIServingCompletion(OpenAIServing):
    def prepare(self, body: CompletionRequest) -> Prepared:
        """Checks and tokenizing (on the input thread)."""
        self.check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported by this server: remove it", "echo")
        if body.suffix:
            raise APIError(400, "suffix is not supported by this server: remove it", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of is not supported (other than best_of == n): use n", "best_of")
        prompts = self.prompt_token_ids(body.prompt)
        request_id = random_id("cmpl")
        params = self.sampling_params(body, body.max_tokens, body.logprobs)
        requests = [(f"{request_id}-{i}", self.process(ids, params)) for i, ids in enumerate(prompts)]
        return Prepared(body, request_id, requests, sum(len(p) for p in prompts), body.logprobs)

    async def create_completion(self, prepared: Prepared, raw_request: Request) -> Response:
        body: CompletionRequest = prepared.body
        request_id, prompt_tokens = prepared.request_id, prepared.prompt_tokens
        choice_index = {(rid, k): i * body.n + k for i, (rid, _) in enumerate(prepared.requests)
                        for k in range(body.n)}
        stream, tracker = await self.add(prepared, body.n)
        if body.stream:
            options = body.stream_options
            return EventStream(self._stream_completion(stream, request_id, choice_index, prompt_tokens, tracker,
                                                        body.logprobs, bool(options and options.include_usage),
                                                        bool(options and options.continuous_usage_stats)),
                               stream, tracker)
        choices = {key: Choice() for key in choice_index}
        cached = await self.collect(stream, raw_request, tracker, choices)
        result = []
        for key, choice in choices.items():
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(choice.token_ids, choice.logprobs, 0)
            result.append(CompletionChoice(index=choice_index[key], text="".join(choice.text), logprobs=logprobs,
                                           finish_reason=choice.finish_reason, stop_reason=choice.stop_reason))
        result.sort(key=lambda c: c.index)
        usage = usage_info(prompt_tokens, sum(len(c.token_ids) for c in choices.values()), sum(cached.values()))
        response = CompletionResponse(id=request_id, model=self.model_name, choices=result, usage=usage)
        return JSONResponse(response.model_dump())

    async def _stream_completion(self, stream: RequestStream, request_id: str,
                                 choice_index: dict[tuple[str, int], int], prompt_tokens: int,
                                 tracker: RequestTracker, logprobs: int | None, include_usage: bool,
                                 continuous_usage: bool) -> AsyncIterator[str]:
        completion_tokens = 0
        cached: dict[str, int] = {}
        text_offsets = dict.fromkeys(choice_index.values(), 0)
        created = int(time.time())  # (one for every chunk of the stream, as OpenAI's)
        async for output in stream:
            tracker.observe(output)
            check_not_failed(output)
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
                    choice_logprobs = completion_logprobs(completion.token_ids, completion.logprobs or [],
                                                           text_offsets[index])
                    text_offsets[index] += sum(len(t) for t in choice_logprobs.tokens)
                choice = CompletionChoice(index=index, text=completion.text, logprobs=choice_logprobs,
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


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]],
                        text_offset: int) -> CompletionLogprobs:
    """OpenAI's legacy shape: per token its text, its logprob, and {text: logprob} of the top ones."""
    result = CompletionLogprobs()
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

