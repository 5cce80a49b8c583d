"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

# Bounds of what one request may ask for, beyond those the model sets (vocabulary, context: the input
# processor checks those). Each keeps one request from costing the engine out of proportion to its answer:
# stop strings are searched in the text at every token, and the text just before the end is held back while
# it could still become the start of one.
MAX_LOGPROBS = 20  # vLLM's default max_logprobs, OpenAI's top_logprobs limit
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_TOP_K = 2**31 - 1  # the sampling kernels index the vocabulary with int32
FLOAT32_MAX = 3.4028234663852886e38
# A temperature below this samples as greedy (vLLM's _SAMPLING_EPS): dividing logits by it overflows float32.
MIN_TEMPERATURE = 1e-5


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's names): exactly one of a JSON schema (a dict or its JSON text), any JSON
    object (json_object=True), a regular expression, one of a list of strings, or an EBNF grammar (xgrammar's
    dialect, GBNF-like). The engine masks every token that would break it, and stops when it is complete."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError("structured_outputs must give exactly one of json, regex, choice, grammar and "
                             f"json_object, got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema: an object, or its JSON text")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string")
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec): what the grammar compiles from, and its cache key."""
        if self.json is not None:
            return "json", self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.regex is not None:
            return "regex", self.regex
        return "grammar", self.grammar or ""


@dataclass
class SamplingParams:
    """temperature=0 is greedy. Every field is checked on construction so that a bad request fails
    before it reaches the engine; what depends on the model (token ids, the context, the engine's max_n) is
    the input processor's to check."""

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
    # The log-probability of each prompt token (after the first) and of the top prompt_logprobs at its place
    # (RequestOutput.prompt_logprobs): what evaluation harnesses score a prompt with.
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
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

        require(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        require(_is_number(self.temperature) and 0 <= self.temperature <= FLOAT32_MAX,
                f"temperature must be a finite number >= 0, got {self.temperature!r}")
        require(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        require(_is_int(self.top_k) and -1 <= self.top_k <= MAX_TOP_K,
                f"top_k must be -1 (disabled), 0 (disabled) or an integer in [1, {MAX_TOP_K}], got {self.top_k!r}")
        require(_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        require(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        require(_is_int(self.min_tokens) and self.min_tokens >= 0,
                f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        require(self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        require(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        require(self.prompt_logprobs is None
                or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
                f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        require(_is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        require(_is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        require(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= FLOAT32_MAX,
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        require(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**63),
                f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}")
        require(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
                "structured_outputs must be a StructuredOutputsParams")
        require(self.structured_outputs is None or self.min_tokens == 0,
                "min_tokens cannot be used with structured_outputs: the grammar decides where the answer ends (and "
                "may allow nothing but its end); remove min_tokens")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        require(stops is None or isinstance(stops, (list, tuple)), "stop must be a string or a list of strings")
        stops = list(stops or [])
        require(len(stops) <= MAX_STOP_STRINGS, f"stop has {len(stops)} strings: at most {MAX_STOP_STRINGS}")
        require(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in stops),
                f"stop strings must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        self._stop_strings = stops
        stop_ids = self.stop_token_ids
        require(stop_ids is None or (isinstance(stop_ids, (list, tuple)) and all(_is_int(t) for t in stop_ids)),
                "stop_token_ids must be a list of integers")
        require(len(stop_ids or ()) <= MAX_STOP_TOKEN_IDS,
                f"stop_token_ids has {len(stop_ids or ())} ids: at most {MAX_STOP_TOKEN_IDS}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_strings

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
