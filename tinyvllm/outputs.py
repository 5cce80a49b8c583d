"""What a request returns (vLLM's RequestOutput and CompletionOutput)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


# One entry per generated token: token id -> Logprob (the chosen token and the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing comes before it), then as SampleLogprobs' entries.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" (the engine failed on it) or None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """A request's times (time.time()): arrival and first/last token where the caller's engine saw them; queued,
    first scheduled and first token in the engine core (another process behind the server), so that a time to
    first token splits into the hops, the queue and the prefill (vLLM's queue and prefill times)."""

    arrival_time: float
    queued_time: float | None = None  # the engine core took it in
    first_scheduled_time: float | None = None
    first_token_engine_time: float | None = None  # the engine core had its first token
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: the prompt's, in the request's first output (a delta stream's first
    # only) and every later one that holds everything so far
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, later: RequestOutput) -> None:
        """Merge a later delta output of the same request into this one: a stream whose reader fell behind
        the engine reads one output for several steps (as vLLM's output collector merges them)."""
        for mine, theirs in zip(self.outputs, later.outputs):  # (the same n completions, in index order)
            mine.text += theirs.text
            mine.token_ids += theirs.token_ids
            if theirs.logprobs is not None:
                mine.logprobs = (mine.logprobs or []) + theirs.logprobs
            mine.finish_reason, mine.stop_reason = theirs.finish_reason, theirs.stop_reason
            mine.cumulative_logprob = theirs.cumulative_logprob
        self.finished = later.finished
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.metrics = later.metrics
        self.num_cached_tokens = later.num_cached_tokens
