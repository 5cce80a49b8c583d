"""The scheduler: which sequences run in the next step, and how many new tokens each computes.

Each step has a token budget (max_num_batched_tokens). Running sequences go first, oldest first: a
decode takes one token, an unfinished prompt takes the next chunk that fits. Then, budget and seat
limits permitting, waiting sequences are admitted (continuous batching). When the KV pool runs dry,
the youngest running sequence is preempted: its blocks are freed and it goes back to the front of
the queue, to be recomputed later, so no request is ever dropped.

With async scheduling the next step is scheduled while the GPU still runs the last one: a sequence's
token from that step is a placeholder (Sequence.num_pending) that the model runner takes from the GPU.
A sequence that has all its tokens is not scheduled again, and one whose token is still pending is not
admitted from the queue (after a preemption) until the token is known.

With scheduling="static", sequences are admitted only when nothing runs, as many as fit, and the
batch runs to its end before the next one is admitted: it exists to show what continuous buys."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # ids of the sequences whose blocks were freed since the last batch (the model runner drops their rows)
    released: list[int] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "continuous") -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._released: list[int] = []
        self._pending_in_queue = False  # a preempted sequence waits with a pending token (it may stop at it)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> list[Sequence]:
        """Remove every sequence of the request, freeing its blocks; returns them."""
        aborted = [s for s in (*self.waiting, *self.running) if s.request_id == request_id]
        for seq in aborted:
            if seq in self.running:
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
            self._free(seq)
            seq.status = SequenceStatus.FINISHED
        return aborted

    def _free(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self._released.append(seq.seq_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.policy == "static" and not self.running:
            self._admit_static_batch()

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.params.max_tokens is not None and seq.num_output_tokens >= seq.params.max_tokens:
                i += 1  # its last token is pending: it finishes when that is read back
                continue
            num_new = self._try_allocate(seq, budget)
            while num_new is None:
                victim = self.running.pop()  # the youngest
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
                num_new = self._try_allocate(seq, budget)
            if num_new is None:
                break
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new
            i += 1

        # Admit no one in a step that had to preempt: the pool is already short.
        if self.policy == "continuous" and not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                if seq.num_pending:
                    break
                num_new = self._try_allocate(seq, budget)
                if num_new is None:
                    break
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.seqs.append(seq)
                out.num_new_tokens.append(num_new)
                budget -= num_new
        if out.seqs:  # (an empty batch reaches no model runner: the ids wait for the next one)
            out.released, self._released = self._released, []
        return out

    def _admit_static_batch(self) -> None:
        """Seat as many waiting sequences as there are seats and blocks for their prompts."""
        free = self.block_manager.num_free_blocks
        while self.waiting and len(self.running) < self.max_num_seqs and not self.waiting[0].num_pending:
            need = self.block_manager.blocks_needed(self.waiting[0].num_tokens + 1)
            if need > free and self.running:
                break
            free -= need
            seq = self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def _try_allocate(self, seq: Sequence, budget: int) -> int | None:
        """Blocks for seq's next chunk (at most `budget` tokens); its size, or None if the pool is short.
        A sequence without blocks first takes what the prefix cache holds of it."""
        if seq.block_table:  # the common case, a decode whose token fits in its last block: nothing to do
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.num_computed_tokens + num_new <= len(seq.block_table) * self.block_manager.block_size:
                return num_new
        cached: list[int] = []
        if not seq.block_table:
            cached = self.block_manager.find_cached_prefix(seq)
        num_computed = max(seq.num_computed_tokens, len(cached) * self.block_manager.block_size)
        num_new = min(seq.num_tokens - num_computed, budget)
        if not self.block_manager.allocate(seq, num_new, cached):
            return None
        if not seq.num_computed_tokens and seq.num_preemptions == 0:
            self.block_manager.record_prefix_lookup(seq.num_prompt_tokens, num_computed)
            seq.num_cached_tokens = num_computed
        seq.num_computed_tokens = num_computed
        return num_new

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and queue it first, to recompute prompt and output later."""
        self._free(seq)
        self._pending_in_queue |= seq.num_pending > 0
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def advance(self, out: SchedulerOutput) -> None:
        """Once the step is launched: its tokens count as computed (their K/V are written in stream
        order before any later step reads them)."""
        for seq, num_new in zip(out.seqs, out.num_new_tokens):
            seq.num_computed_tokens += num_new

    def update(self, out: SchedulerOutput) -> None:
        """Once the step's tokens are read back: cache the full blocks of its sequences (those that just
        finished too, so that a follow-up prompt holding their output finds it), and free the sequences
        that finished (a preempted one may finish while it waits, by its pending token)."""
        for seq in out.seqs:
            if seq.block_table:
                self.block_manager.cache_computed_blocks(seq)
        if any(s.is_finished for s in self.running):
            finished = [s for s in self.running if s.is_finished]
            self.running = [s for s in self.running if not s.is_finished]
            for seq in finished:
                self._free(seq)
        if self._pending_in_queue:  # its token is known now: drop it if that token finished it
            self.waiting = deque(s for s in self.waiting if not s.is_finished)
            self._pending_in_queue = False
