"""Verifying proposed tokens (speculative decoding): which of a sequence's k proposals d_1..d_k the target model
accepts, and the token after them, from the target's tokens drawn at the k + 1 positions of one forward pass.

The step samples every position as it samples any token (worker/sampler.py: greedy argmax, or temperature, top-k,
top-p and min-p with the draw's own seed, that of the output's number), giving x_0..x_k, where x_j is the target's
draw after the newest token and d_1..d_j. Proposal d_{j+1} is accepted while x_j == d_{j+1}; the first x_j that
differs (or x_k, after all k) is the step's last token. So the output is exactly the target's, token for token:
greedy output equals greedy without speculation, and a seeded request draws the same tokens with or without it.

This is the standard rejection sampling (Leviathan et al., Chen et al.) for a deterministic proposal, q = one-hot at
d: that accepts d with probability min(1, p(d) / q(d)) = p(d) and on rejection draws from max(0, p - q), renormalized:
p without d. Drawing x ~ p and accepting iff x == d does both at once: P(accept) = p(d), and a rejected x is
distributed as p restricted to x != d. (A draft model's proposals come with a distribution q of their own: they need
the general rule, with a uniform per proposal.)"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tinyvllm.contract import ModelRunnerOutput


def accepted_run(drawn: list[int], drafts: list[int]) -> list[int]:
    """The tokens a verification gives: the target's draws x_0..x_k (one more than the drafts) up to and including
    the first that differs from its proposal."""
    num_accepted = 0
    while num_accepted < len(drafts) and drawn[num_accepted] == drafts[num_accepted]:
        num_accepted += 1
    return drawn[:num_accepted + 1]


# What a verification calls when its tokens are on the host: (input batch rows at launch, their sequences' ids, each
# sequence's tokens, its proposals' count), as InputBatch.record_verified takes them.
OnVerified = Callable[[np.ndarray, np.ndarray, list[list[int]], list[int]], None]


@dataclass
class Verification:
    """A step's sequences that sample, in order, with the proposals each verifies (none: one token, as always). The
    step's sampled rows are theirs in the same order, 1 + len(drafts) each."""

    seq_ids: list[int]
    rows: np.ndarray  # input batch rows at launch
    drafts: list[list[int]]
    on_ready: OnVerified | None = None

    def accept(self, drawn: ModelRunnerOutput) -> ModelRunnerOutput:
        """From the output of one token per sampled row to each sequence's accepted run (and its tokens' logprobs)."""
        tokens: list[list[int]] = []
        logprobs = []
        offset = 0
        for drafts in self.drafts:
            n = len(drafts) + 1
            run = accepted_run([t for (t,) in drawn.sampled_token_ids[offset:offset + n]], drafts)
            tokens.append(run)
            first = drawn.logprobs[offset]
            logprobs.append(None if first is None else [drawn.logprobs[offset + j][0] for j in range(len(run))])
            offset += n
        if self.on_ready is not None:
            self.on_ready(self.rows, np.array(self.seq_ids, dtype=np.int64), tokens, [len(d) for d in self.drafts])
        return ModelRunnerOutput(self.seq_ids, tokens, logprobs, drawn.gpu_time_ms, drawn.prompt_logprobs)
