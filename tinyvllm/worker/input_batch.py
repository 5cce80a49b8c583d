"""The model runner's own state of the sequences it holds, built from the scheduler's messages alone.

Each sequence holds a row of persistent host arrays: its block table (only blocks it gained are
written), its sampling parameters (written once), and counts. A step gathers the rows it needs with numpy,
so its host cost is a few numpy calls plus one short loop for the token ids, not a Python pass over
every block of every sequence. Rows of freed sequences are reused."""

from __future__ import annotations

import numpy as np

from tinyvllm.contract import NewSequence
from tinyvllm.sampling_params import SamplingParams

# What a row's SamplingParams ask of the sampler beyond the kernel (bits of InputBatch.needs)
PENALTIES, LOGPROBS, MIN_TOKENS = 1, 2, 4


class InputBatch:
    def __init__(self, capacity: int, max_blocks_per_seq: int) -> None:
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self._free_rows = list(range(capacity - 1, -1, -1))
        self.block_tables = np.zeros((capacity, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(capacity, dtype=np.int64)  # block-table entries written per row
        self.num_computed = np.zeros(capacity, dtype=np.int64)  # tokens in the KV cache (or launched)
        self.num_tokens = np.zeros(capacity, dtype=np.int64)  # tokens known, those sampled in flight included
        self.num_prompt = np.zeros(capacity, dtype=np.int64)
        self.temperature = np.zeros(capacity, dtype=np.float32)
        self.top_k = np.zeros(capacity, dtype=np.int64)
        self.top_p = np.ones(capacity, dtype=np.float32)
        self.min_p = np.zeros(capacity, dtype=np.float32)
        self.seeds = np.zeros(capacity, dtype=np.uint64)
        self.needs = np.zeros(capacity, dtype=np.int8)  # PENALTIES | LOGPROBS | MIN_TOKENS
        # Per row: the tokens read back so far (prompt first), the parameters, min_tokens' stop ids.
        self.token_ids: list[list[int]] = [[] for _ in range(capacity)]
        self.params: list[SamplingParams | None] = [None] * capacity
        self.stop_token_ids: list[tuple[int, ...]] = [()] * capacity

    _ARRAYS = ("block_tables", "num_blocks", "num_computed", "num_tokens", "num_prompt", "temperature", "top_k",
               "top_p", "min_p", "seeds", "needs")

    def _grow(self) -> None:
        old = self.block_tables.shape[0]
        for name in self._ARRAYS:
            array = getattr(self, name)
            grown = np.zeros((2 * old, *array.shape[1:]), dtype=array.dtype)
            grown[:old] = array
            setattr(self, name, grown)
        self.token_ids += [[] for _ in range(old)]
        self.params += [None] * old
        self.stop_token_ids += [()] * old
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    @property
    def capacity(self) -> int:
        return self.block_tables.shape[0]

    def add(self, new: NewSequence) -> None:
        if not self._free_rows:
            self._grow()
        row = self.row_of[new.seq_id] = self._free_rows.pop()
        self.num_blocks[row] = 0
        self.append_blocks(row, new.block_ids)
        self.num_computed[row] = new.num_computed_tokens
        self.num_tokens[row] = len(new.token_ids)
        self.num_prompt[row] = new.num_prompt_tokens
        p = new.params
        self.temperature[row] = 0.0 if p.greedy else p.temperature
        self.top_k[row], self.top_p[row], self.min_p[row] = p.top_k, p.top_p, p.min_p
        self.seeds[row] = new.seed
        self.needs[row] = (PENALTIES * p.has_penalties | LOGPROBS * (p.logprobs is not None)
                           | MIN_TOKENS * (p.min_tokens > 0))
        self.token_ids[row] = new.token_ids
        self.params[row] = p
        self.stop_token_ids[row] = new.stop_token_ids

    def remove(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self.token_ids[row] = []
            self.params[row] = None
            self._free_rows.append(row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        self.block_tables[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def record_tokens(self, seq_ids: list[int], token_ids: list[int]) -> None:
        """A step's sampled tokens, read back: each joins its sequence's history (if the runner still holds
        the sequence: one freed since keeps nothing)."""
        row_of = self.row_of
        for seq_id, token in zip(seq_ids, token_ids):
            row = row_of.get(seq_id)
            if row is not None:
                self.token_ids[row].append(token)
