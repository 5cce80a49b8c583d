"""The interface a proposer of draft tokens offers the scheduler."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Proposer(ABC):
    """Guesses the next tokens of a batch of decoding sequences at once. The n-gram proposer looks at the tokens
    alone; a draft model would keep a KV cache per sequence id, hence the ids and `forget`."""

    @abstractmethod
    def propose(self, seq_ids: list[int], token_ids: list[list[int]], max_num_tokens: list[int]) -> list[list[int]]:
        """For each sequence (its id, every token it has: prompt then outputs), at most max_num_tokens[i] proposed
        next tokens, perhaps none."""

    def forget(self, seq_ids: list[int]) -> None:  # noqa: B027  (a proposer without state has nothing to forget)
        """These sequences are finished or preempted: drop what is kept of them."""

