"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """temperature=0 is greedy. Every field is checked on construction so that a bad request fails
    before it reaches the engine."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    _stop_strings: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        require(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        require(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        require(isinstance(self.top_k, int) and self.top_k >= -1,
                f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        require(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        require(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        require(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
                f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        require(self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        require(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
                f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        require(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        require(-2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        require(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        require(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        require(all(isinstance(s, str) and s for s in stops), "stop strings must be non-empty strings")
        self._stop_strings = stops
        require(all(isinstance(t, int) for t in self.stop_token_ids or []), "stop_token_ids must be integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_strings

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
