"""Draft-model proposals: a smaller model with the target's tokenizer guesses each sequence's next k tokens greedily.
It is run by a ModelRunner of its own (the engine's, with a KV cache of as many blocks as the target's), which this
proposer drives as the scheduler drives the target's: with SchedulerOutputs.

Per sequence the proposer keeps the blocks of the draft's cache and which tokens' K/V they hold: a prefix of the
sequence, then the guesses computed after it. A call catches each sequence up on the tokens its cache lacks (the
prompt on the first call; later the target's token after the accepted guesses, and any guess it rejected), drawing
the first guess where the catching up ends, then decodes the others one step at a time. A rejected guess's K/V is
simply written over: the longest prefix of the sequence that the cache holds is all a rollback needs to know. The
runner knows of a sequence only the tokens sent with it and those it drew, and the target's are neither, so each
call sends the sequence afresh (NewSequence, its cached prefix counted as computed, as a prefix-cache hit is).

Greedy guesses are a deterministic proposal, which the rejection sampler verifies exactly at any temperature
(worker/rejection_sampler.py); drafting by sampling would accept more at high temperatures but needs the draft's
probabilities in the acceptance rule."""

from __future__ import annotations

from dataclasses import dataclass, field

from tinyvllm.contract import NewSequence, SchedulerOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.spec_decode.proposer import Proposer
from tinyvllm.worker.kv_cache import blocks_needed
from tinyvllm.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class _Cached:
    """What the draft's cache holds of one sequence: its first num_tokens tokens, then `guesses`."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    guesses: list[int] = field(default_factory=list)

    def prefix_of(self, tokens: list[int]) -> int:
        """How many of `tokens` (the sequence now: what was cached, then the tokens since) the cache holds."""
        n = self.num_tokens
        for guess in self.guesses:
            if n >= len(tokens) or tokens[n] != guess:
                break
            n += 1
        return n


class DraftModelProposer(Proposer):
    def __init__(self, runner: ModelRunner, max_model_len: int, max_num_batched_tokens: int) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.max_model_len = max_model_len  # (the draft's: sequences longer get no proposals)
        self.max_num_batched_tokens = max_num_batched_tokens
        self._free_blocks = list(range(runner.num_blocks - 1, -1, -1))
        self._cached: dict[int, _Cached] = {}
        self._held: set[int] = set()  # sequences the runner holds
        self._freed: list[int] = []  # ... and those it should drop at the next step

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            cached = self._cached.pop(seq_id, None)
            if cached is not None:
                self._free_blocks += cached.blocks
            if seq_id in self._held:
                self._held.discard(seq_id)
                self._freed.append(seq_id)

    def propose(self, seq_ids: list[int], token_ids: list[list[int]], max_num_tokens: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seq_ids]
        seated, starts, new_seqs = [], [], []
        for i, (seq_id, tokens, k) in enumerate(zip(seq_ids, token_ids, max_num_tokens)):
            end = len(tokens) + k - 1  # (the last guess is drawn, not computed)
            if k < 1 or end > self.max_model_len:
                continue
            cached = self._cached.setdefault(seq_id, _Cached())
            needed = blocks_needed(end, self.block_size) - len(cached.blocks)
            if needed > len(self._free_blocks):
                continue  # (no room in the draft's cache: no proposals for it this step)
            for _ in range(needed):
                cached.blocks.append(self._free_blocks.pop())
            start = min(cached.prefix_of(tokens), len(tokens) - 1)  # (its last token is computed, to draw from)
            cached.num_tokens, cached.guesses = start, []
            new_seqs.append(NewSequence(seq_id, list(tokens), len(tokens), start, list(cached.blocks), GREEDY, 0, ()))
            seated.append(i)
            starts.append(start)
        if not seated:
            return drafts
        index = {seq_id: i for i, seq_id in enumerate(seq_ids)}
        finished, self._freed = self._freed + [seq_ids[i] for i in seated if seq_ids[i] in self._held], []
        self._held.update(seq_ids[i] for i in seated)
        # Catch up on the tokens the cache lacks, in steps of at most max_num_batched_tokens: each sequence draws its
        # first guess in the step that reaches its end
        left = {i: len(token_ids[i]) - start for i, start in zip(seated, starts)}
        while left:
            step = SchedulerOutput(finished_seq_ids=finished, new_seqs=new_seqs)
            finished, new_seqs, budget = [], [], self.max_num_batched_tokens
            for i in list(left):
                n = min(left[i], budget)
                if n == 0:
                    break
                step.seq_ids.append(seq_ids[i])
                step.num_new_tokens.append(n)
                budget -= n
                left[i] -= n
                if not left[i]:
                    del left[i]
            self._run(step, index, drafts)
        for i in seated:
            self._cached[seq_ids[i]].num_tokens = len(token_ids[i])
        # Then the other guesses, a decode step each
        for j in range(1, max(max_num_tokens[i] for i in seated)):
            decoding = [seq_ids[i] for i in seated if max_num_tokens[i] > j]
            self._run(SchedulerOutput(decoding, [1] * len(decoding)), index, drafts)
        for i in seated:
            self._cached[seq_ids[i]].guesses = drafts[i][:-1]
        return drafts

    def _run(self, step: SchedulerOutput, index: dict[int, int], drafts: list[list[int]]) -> None:
        """One step of the draft's runner; the tokens it draws are appended to their sequences' drafts (index: a
        sequence id's place in them)."""
        self.runner.execute_model(step)
        output = self.runner.sample_tokens().get()
        for seq_id, (token,) in zip(output.seq_ids, output.sampled_token_ids):
            drafts[index[seq_id]].append(token)
