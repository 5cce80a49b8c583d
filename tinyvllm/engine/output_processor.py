"""The output processor: from the engine core's new tokens to RequestOutputs. Incremental detokenization,
stop strings (which the core cannot see: they are text), logprobs' token text, prompt logprobs (which the core
sends as arrays, chunk by chunk, before the first token), and what each output carries: everything so far
("cumulative"), only what is new ("delta"), or only the final result ("final_only"). Every entry point (LLM, CLI,
server) goes through it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tinyvllm.contract import EngineCoreOutputs, PromptLogprobsChunk
from tinyvllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.tokenizer import IncrementalDetokenizer

OUTPUT_KINDS = ("cumulative", "delta", "final_only")

# A completion a stop string ended: (request id, completion index, the stop string). The engine core
# must free it.
StoppedByString = tuple[str, int, str]


@dataclass
class _Completion:
    """One completion's text and tokens so far, and how much of them was already reported."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_reported_tokens: int = 0
    reported_text_len: int = 0


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: str
    completions: list[_Completion]
    metrics: RequestMetrics
    prompt_logprobs: PromptLogprobs | None = None  # (SamplingParams.prompt_logprobs) as they come
    prompt_logprobs_reported: bool = False  # (a delta stream reports them once)

    @property
    def has_prompt_logprobs(self) -> bool:
        """Whether its prompt logprobs, if it asked for them, are all in: the request has no output before."""
        return self.prompt_logprobs is None or len(self.prompt_logprobs) == len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        for completion in self.completions:  # (a loop, not all(...): this runs for every request every step)
            if completion.finish_reason is None:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    output_kind: str, arrival_time: float) -> None:
        completions = [_Completion(i, None if self.tokenizer is None else IncrementalDetokenizer(
            self.tokenizer, params.skip_special_tokens)) for i in range(params.n)]
        self.requests[request_id] = _RequestState(request_id, prompt, prompt_token_ids, params, output_kind,
                                                  completions, RequestMetrics(arrival_time=arrival_time),
                                                  None if params.prompt_logprobs is None else [None])

    def abort_request(self, request_id: str) -> bool:
        """Forget a request; True if it was still unfinished."""
        return self.requests.pop(request_id, None) is not None

    def process(self, outputs: EngineCoreOutputs) -> tuple[list[RequestOutput], list[StoppedByString]]:
        """One step's outputs (or several steps', concatenated: a request then gets one RequestOutput holding
        all its new tokens), and the completions that stop strings ended (the engine core frees them)."""
        now = time.time()
        touched: dict[str, _RequestState] = {}
        stopped: list[StoppedByString] = []
        requests, finished, logprobs, first = self.requests, outputs.finished, outputs.logprobs, outputs.first
        for request_id, chunks in outputs.prompt_logprobs.items():
            request = requests.get(request_id)
            if request is not None and request.prompt_logprobs is not None:
                for chunk in chunks:
                    request.prompt_logprobs += self._prompt_logprobs(chunk)
        for entry, (request_id, index, token) in enumerate(zip(outputs.request_ids, outputs.indexes,
                                                               outputs.token_ids)):
            request = requests.get(request_id)
            if request is None:
                continue  # aborted meanwhile
            completion = request.completions[index]
            if completion.finish_reason is not None:
                continue  # a stop string ended it: the token that was in flight is dropped
            if self._append(request.params, completion, token, logprobs.get(entry) if logprobs else None,
                            finished.get(entry) if finished else None):
                stopped.append((request_id, index, completion.stop_reason))
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                if entry in first:
                    (metrics.num_cached_tokens, metrics.queued_time, metrics.first_scheduled_time,
                     metrics.first_token_engine_time) = first[entry]
            metrics.last_token_time = now
            # (a final_only request has an output only when it finishes, which takes a completion finishing; and a
            # request with prompt logprobs none before they are all in, which another of its n may precede)
            if (request.output_kind != "final_only" or completion.finish_reason is not None) and \
                    request.has_prompt_logprobs:
                touched[request_id] = request
        for request_id in outputs.errors:  # (the core has dropped them: each unfinished completion ends here)
            request = requests.get(request_id)
            if request is not None:
                for completion in request.completions:
                    if completion.finish_reason is None:
                        completion.finish_reason, completion.stop_reason = "error", None
                touched[request_id] = request
        results = []
        for request in touched.values():
            finished_now = request.finished
            if finished_now:
                request.metrics.finished_time = now
                del requests[request.request_id]
            if finished_now or request.output_kind != "final_only":
                results.append(self._make_output(request, finished_now))
        return results, stopped

    def _append(self, params: SamplingParams, completion: _Completion, token: int,
                logprobs: dict[int, Logprob] | None, finish: tuple[str, int | str | None] | None) -> bool:
        """Account for a completion's new token: logprobs, text, stop strings, finish. True if a stop string
        ended it (in the core's view it is still running)."""
        completion.token_ids.append(token)
        if logprobs is not None:
            if self.tokenizer is not None:
                for token_id, lp in logprobs.items():
                    lp.decoded_token = self.tokenizer.decode([token_id])
            completion.logprobs.append(logprobs)
            completion.cumulative_logprob += logprobs[token].logprob
        text_before = len(completion.text)
        if completion.detokenizer is not None:
            completion.detokenizer.add(token)
            completion.text = completion.detokenizer.text
        stopped_by_token = finish is not None and finish[0] == "stop"  # (a stop token wins over a stop string)
        if params.stop_strings and not stopped_by_token and len(completion.token_ids) >= params.min_tokens:
            if self._truncate_at_stop(params, completion, text_before):
                return True
        if finish is not None:
            if completion.detokenizer is not None:
                completion.detokenizer.flush()
                completion.text = completion.detokenizer.text
            completion.finish_reason, completion.stop_reason = finish
        return False

    def _prompt_logprobs(self, chunk: PromptLogprobsChunk) -> PromptLogprobs:
        """A chunk's rows as Logprob dicts: the prompt token with its rank, then the top k ranked 1..k."""
        token_ids, values, ranks = chunk.token_ids.tolist(), chunk.logprobs.tolist(), chunk.ranks.tolist()
        texts: dict[int, str | None] = {}
        if self.tokenizer is not None:
            unique = list({t for row in token_ids for t in row})
            texts = dict(zip(unique, self.tokenizer.batch_decode([[t] for t in unique])))
        result: PromptLogprobs = []
        for ids, lps, rank in zip(token_ids, values, ranks):
            entry = {ids[0]: Logprob(lps[0], rank, texts.get(ids[0]))}
            for top_rank, (token_id, value) in enumerate(zip(ids[1:], lps[1:]), start=1):
                entry.setdefault(token_id, Logprob(value, top_rank, texts.get(token_id)))
            result.append(entry)
        return result

    @staticmethod
    def _truncate_at_stop(params: SamplingParams, completion: _Completion, text_before: int) -> bool:
        """If a stop string appeared in the new text, cut the output there (keeping the stop string only if
        asked) and finish."""
        for stop in params.stop_strings:
            index = completion.text.find(stop, max(0, text_before - len(stop) + 1))
            if index >= 0:
                end = index + len(stop) if params.include_stop_str_in_output else index
                completion.text = completion.text[:end]
                completion.finish_reason, completion.stop_reason = "stop", stop
                return True
        return False

    def _make_output(self, request: _RequestState, finished: bool) -> RequestOutput:
        delta = request.output_kind == "delta"
        want_logprobs = request.params.logprobs is not None
        results = []
        for c in request.completions:
            text = _visible_text(request.params, c)
            tokens = c.token_ids
            logprobs = c.logprobs if want_logprobs else None
            if delta:
                text = text[c.reported_text_len:]
                tokens = tokens[c.num_reported_tokens:]
                logprobs = logprobs[c.num_reported_tokens:] if logprobs is not None else None
                c.reported_text_len += len(text)
                c.num_reported_tokens += len(tokens)
            else:
                tokens = list(tokens)
            results.append(CompletionOutput(c.index, text, tokens, c.finish_reason, c.stop_reason, logprobs,
                                            c.cumulative_logprob if want_logprobs else None))
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is not None and (not request.has_prompt_logprobs
                                            or (delta and request.prompt_logprobs_reported)):
            prompt_logprobs = None  # (not all in: only a failed request has an output then)
        request.prompt_logprobs_reported |= prompt_logprobs is not None
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, results, finished,
                             request.metrics, request.metrics.num_cached_tokens, prompt_logprobs)


def _visible_text(params: SamplingParams, completion: _Completion) -> str:
    """While a completion runs, hold back a tail that could be the start of a stop string, so that streamed
    text never has to be taken back."""
    if completion.finish_reason is not None or not params.stop_strings:
        return completion.text
    hold = max(len(s) for s in params.stop_strings) - 1
    return completion.text[: max(len(completion.text) - hold, completion.reported_text_len)]
