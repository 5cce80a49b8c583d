"""The model runner's own state of the sequences it holds, built from the scheduler's messages alone.

Each sequence holds a row of persistent host arrays: its block table (only blocks it gained are
written), its sampling parameters (written once), counts, and its newest token. A step gathers the rows it
needs with numpy, so its host cost is a few numpy calls (and a short loop over the rows with prompt tokens),
not a Python pass over every sequence, let alone every block. Rows of freed sequences are reused.

A sequence's tokens after those the scheduler sent with it (NewSequence.token_ids) are its outputs, and each is
the input of one decode step: the row keeps only the newest (last_token). Only a row with penalties keeps
every token it reads back, for the sampler to count."""

from __future__ import annotations

import numpy as np

from tinyvllm.contract import NewSequence
from tinyvllm.sampling_params import SamplingParams

# What a row's SamplingParams ask of the sampler beyond the kernel (bits of InputBatch.needs)
PENALTIES, LOGPROBS, MIN_TOKENS, STRUCTURED = 1, 2, 4, 8


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
        self.needs = np.zeros(capacity, dtype=np.int8)  # PENALTIES | LOGPROBS | MIN_TOKENS | STRUCTURED
        self.seq_ids = np.full(capacity, -1, dtype=np.int64)  # each row's sequence, -1 when free
        self.num_sent = np.zeros(capacity, dtype=np.int64)  # tokens sent with the sequence (NewSequence)
        self.num_known = np.zeros(capacity, dtype=np.int64)  # tokens read back (those in flight not)
        self.last_token = np.zeros(capacity, dtype=np.int64)  # the newest of them
        # The next prompt position owed a logprob (NewSequence.prompt_logprobs_from; 0: none)
        self.prompt_logprobs_from = np.zeros(capacity, dtype=np.int64)
        # Per row: the tokens sent with the sequence (with penalties: and every token read back since), the
        # parameters, min_tokens' stop ids.
        self.token_ids: list[list[int]] = [[] for _ in range(capacity)]
        self.params: list[SamplingParams | None] = [None] * capacity
        self.stop_token_ids: list[tuple[int, ...]] = [()] * capacity

    _ARRAYS = ("block_tables", "num_blocks", "num_computed", "num_tokens", "num_prompt", "temperature", "top_k",
               "top_p", "min_p", "seeds", "needs", "seq_ids", "num_sent", "num_known", "last_token",
               "prompt_logprobs_from")

    def _grow(self) -> None:
        old = self.block_tables.shape[0]
        for name in self._ARRAYS:
            array = getattr(self, name)
            grown = np.full((2 * old, *array.shape[1:]), -1 if name == "seq_ids" else 0, dtype=array.dtype)
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
        """Take a new sequence into a free row; if any of its values does not fit the row's arrays, the row is
        given back and the error raised (the batch is as it was)."""
        if not self._free_rows:
            self._grow()
        row = self.row_of[new.seq_id] = self._free_rows.pop()
        try:
            self._fill(row, new)
        except BaseException:
            self.remove(new.seq_id)
            raise

    def _fill(self, row: int, new: NewSequence) -> None:
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
                           | MIN_TOKENS * (p.min_tokens > 0) | STRUCTURED * (p.structured_outputs is not None))
        self.seq_ids[row] = new.seq_id
        self.num_sent[row] = self.num_known[row] = len(new.token_ids)
        self.last_token[row] = new.token_ids[-1]
        self.prompt_logprobs_from[row] = new.prompt_logprobs_from or 0
        self.token_ids[row] = new.token_ids
        self.params[row] = p
        self.stop_token_ids[row] = new.stop_token_ids

    def remove(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self.seq_ids[row] = -1
            self.token_ids[row] = []
            self.params[row] = None
            self._free_rows.append(row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        self.block_tables[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def record_tokens(self, rows: np.ndarray, seq_ids: np.ndarray, token_ids: np.ndarray) -> None:
        """A step's sampled tokens, read back: token i is that of sequence seq_ids[i], which held row rows[i]
        when the step was launched. A row freed since (and perhaps given to another sequence) keeps nothing."""
        held = self.seq_ids[rows] == seq_ids
        if not held.all():
            rows, token_ids = rows[held], token_ids[held]
        self.last_token[rows] = token_ids
        self.num_known[rows] += 1
        with_penalties = np.flatnonzero(self.needs[rows] & PENALTIES)
        for i in with_penalties.tolist():
            self.token_ids[int(rows[i])].append(int(token_ids[i]))

    def record_verified(self, rows: np.ndarray, seq_ids: np.ndarray, tokens: list[list[int]],
                        num_drafts: list[int]) -> None:
        """A verification step's tokens, read back (rejection_sampler.Verification): sequence seq_ids[i], at row
        rows[i] when launched, verified num_drafts[i] proposals and got tokens[i], the accepted ones and one more.
        The step counted one token and every proposal's slot: the rest are counted now, the rejected slots taken
        off (the next step writes over them)."""
        for row, seq_id, new, drafts in zip(rows.tolist(), seq_ids.tolist(), tokens, num_drafts):
            if self.seq_ids[row] != seq_id:
                continue
            self.last_token[row] = new[-1]
            self.num_known[row] += len(new)
            self.num_tokens[row] += len(new) - 1
            self.num_computed[row] -= drafts - (len(new) - 1)
            if self.needs[row] & PENALTIES:
                self.token_ids[row].extend(new)
