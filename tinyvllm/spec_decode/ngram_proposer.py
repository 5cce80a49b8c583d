"""Prompt lookup (n-gram) proposals: text that repeats its context (code edits, quoting, summaries that copy, lists)
continues as it went on before. The sequence's latest n tokens are looked up earlier in its prompt and outputs, for n
from prompt_lookup_max down to prompt_lookup_min; the longest n that occurs wins, at its earliest occurrence (vLLM's
rule), and the tokens that followed it there are proposed."""

from __future__ import annotations

import numpy as np

from tinyvllm.spec_decode.proposer import Proposer


def ngram_proposal(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """At most k tokens that followed the longest n-gram (min_n <= n <= max_n) ending the sequence `tokens` where it
    occurred before (its earliest occurrence), or none.

    Every earlier position j holding the last token is a candidate end; its match length grows while the tokens
    before it equal those before the last one. One numpy pass per offset, at most max_n passes over the candidates."""
    length = len(tokens)
    if k < 1 or length < min_n + 1:
        return []
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])  # candidate ends j (before the last token)
    if not len(ends):
        return []
    matched = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for offset in range(1, min(max_n, length - 1)):
        before = ends - offset
        alive &= before >= 0
        alive[alive] = tokens[before[alive]] == tokens[length - 1 - offset]
        if not alive.any():
            break
        matched += alive
    best = int(matched.max())
    if best < min_n:
        return []
    start = int(ends[np.argmax(matched == best)]) + 1  # (argmax: the first, i.e. the earliest occurrence)
    return tokens[start:start + k].tolist()


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seq_ids: list[int], token_ids: list[list[int]], max_num_tokens: list[int]) -> list[list[int]]:
        return [ngram_proposal(np.asarray(tokens, dtype=np.int64), self.min_n, self.max_n, k)
                for tokens, k in zip(token_ids, max_num_tokens)]
