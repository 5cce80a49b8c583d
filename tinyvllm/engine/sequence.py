"""One sequence: a prompt and the tokens generated for it so far (one per `n` of a request)."""

from __future__ import annotations

import enum
from typing import Any

from tinyvllm.outputs import Logprob
from tinyvllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids (prompt then output), how many of them are in the KV cache, and the blocks holding them."""

    def __init__(self, seq_id: int, request_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, seed: int, arrival_time: float, detokenizer: Any = None,
                 stop_token_set: frozenset[int] = frozenset()) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.arrival_time = arrival_time
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # prompt tokens that came from the prefix cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks, filled as they complete
        self.num_registered_blocks = 0  # leading blocks of block_table already offered to the prefix cache
        self.detokenizer = detokenizer
        self.stop_token_set = stop_token_set  # EOS (unless ignore_eos) and stop_token_ids
        self.output_text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0
        self.num_preemptions = 0
        # Tokens sampled on the GPU but not yet read back (async scheduling): placeholders at the end of
        # token_ids, so that counts and positions already include them; the engine fills them in.
        self.num_pending = 0
        # Progress already reported to the caller, so each RequestOutput carries only what is new.
        self.num_reported_tokens = 0
        self.reported_text_len = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, those still pending on the GPU included."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens known so far (pending placeholders excluded)."""
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - self.num_pending]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """More than one token still to compute: a prompt (or a recomputation after preemption)."""
        return self.num_tokens - self.num_computed_tokens > 1

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")
