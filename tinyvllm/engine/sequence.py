"""One sequence: a prompt and the tokens generated for it so far (one per `n` of a request)."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from tinyvllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tinyvllm.engine.structured_output import SequenceGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """The scheduler's view of a sequence: its real tokens, how many of them (and of the tokens in flight)
    are in the KV cache, and the blocks holding them."""

    def __init__(self, seq_id: int, request_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, seed: int, stop_token_ids: frozenset[int] = frozenset(),
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.token_ids = list(prompt_token_ids)  # real tokens only: the prompt, then the outputs read back
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.stop_token_ids = stop_token_ids  # EOS (unless ignore_eos) and stop_token_ids
        self.eos_token_ids = eos_token_ids  # a stop by EOS reports no stop_reason, as vLLM
        self.status = SequenceStatus.WAITING
        # Tokens sampled on the device and not read back yet: counts and positions include them, token_ids
        # does not (vLLM's num_output_placeholders).
        self.num_output_placeholders = 0
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache (or being written by a launched step)
        self.num_cached_tokens = 0  # prompt tokens that came from the prefix cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks, filled as they complete
        self.num_registered_blocks = 0  # leading blocks of block_table already offered to the prefix cache
        # Leading entries of block_table it no longer owns: blocks that fell out of the model's sliding window
        # (BlockManager.remove_skipped_blocks). The table keeps them, as positions index into it.
        self.num_skipped_blocks = 0
        # The full blocks [first, last) past its cached prefix that it computes, claimed (BlockManager.claim) until
        # they are cached or it lets go of its blocks; and, while it waits for another's claim, how many leading
        # blocks it found in the cache at its last look (BlockManager.is_being_computed starts there).
        self.claimed_blocks = (0, 0)
        self.num_blocks_seen_cached = 0
        self.num_sent_blocks = -1  # blocks the model runner knows of; -1: it does not hold the sequence
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # The next prompt position whose logprob the request is owed (SamplingParams.prompt_logprobs: of its first
        # completion alone), up to num_prompt_tokens; None: none are.
        self.prompt_logprobs_next = 1 if params.prompt_logprobs is not None and index == 0 else None
        self.grammar: SequenceGrammar | None = None  # (structured output) it waits in the queue until it compiled
        self.queued_time = time.time()  # when the engine core took it in (wall clock, as the API process's)
        self.first_scheduled_time: float | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens including those in flight: what positions and block counts are computed from."""
        return len(self.token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, those in flight included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt logprobs are still owed: the prompt's tokens are computed (not read from the prefix
        cache, which keeps K/V but no logits) until they are all scored."""
        return self.prompt_logprobs_next is not None and self.prompt_logprobs_next < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")
