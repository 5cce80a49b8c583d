"""The scheduler: which sequences run in the next step, and how many new tokens each computes; then,
with the step's sampled tokens, which sequences they finish.

Each step has a token budget (max_num_batched_tokens). Running sequences go first, oldest first: a
decode takes one token, an unfinished prompt takes the next chunk that fits. Then, budget and seat
limits permitting, waiting sequences are admitted (continuous batching); one whose prompt continues with a
block that a running sequence is computing right now waits for that block to reach the prefix cache, rather
than computing it again (requests that arrive together with one long shared prompt compute it once, as
SGLang's scheduler does). A prompt block enters the cache as soon as the step computing it is launched
(cache_launched), so the waiting request is seated in the next step. When the KV pool runs dry,
the youngest running sequence is preempted: its blocks are freed and it goes back to the front of
the queue, to be recomputed later, so no request is ever dropped. Where every layer of the model attends within a
sliding window, a running sequence gives back the blocks that fell out of it before it takes new ones
(BlockManager.remove_skipped_blocks); as a prompt takes blocks a chunk at a time, even a long one holds no more than
its window and a chunk. A request that asks for prompt logprobs computes its whole prompt (the prefix cache holds
K/V, not the logits it needs; vLLM does the same) and is owed each prompt position once, however often a preemption
makes it compute them.

A step's output is plain data (contract.SchedulerOutput): the model runner never sees a Sequence. A
sequence whose last token is in the step gets a placeholder (Sequence.num_output_placeholders) until the
runner's sampled token comes back (update_from_output). With async scheduling the next step is scheduled
before that, as if the token were known; the runner takes it from the device. A sequence that has all its
tokens is not scheduled again, and one whose token is still in flight is not admitted from the queue
(after a preemption) until the token is known.

With speculative decoding (a proposer), a decoding sequence may get proposed tokens, as many as the proposer finds,
up to num_speculative_tokens, fewer where the token budget, the KV pool, max_tokens or max_model_len leave less
room: it computes its newest token and the proposals in one step (SchedulerOutput.scheduled_spec_decode_tokens),
and gets back the accepted run. The rejected proposals' slots are then not computed any more, and the blocks past
its tokens are given back, so that the prefix cache never holds a rejected token. A sequence under a grammar gets
only the proposals its grammar allows (each sampled position has its bitmask row); one with penalties, or short of
its min_tokens, gets none (the sampler applies those from each row's own tokens).

With scheduling="static", sequences are admitted only when nothing runs, as many as fit, and the
batch runs to its end before the next one is admitted: it exists to show what continuous buys."""

from __future__ import annotations

import time
from collections import deque

from tinyvllm.contract import EngineCoreOutputs, ModelRunnerOutput, NewSequence, SchedulerOutput
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.sequence import Sequence, SequenceStatus
from tinyvllm.spec_decode import Proposer


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "continuous", share_prefix_computation: bool = True,
                 proposer: Proposer | None = None, num_speculative_tokens: int = 0) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        # Whether a request waits for prompt blocks another is computing (on by default; tests turn it off to
        # compare).
        self.share_prefix_computation = share_prefix_computation
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence, by id
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # prompt tokens computed (prefix-cache hits not counted)
        self._freed: list[int] = []  # ids whose blocks were freed since the last batch (the runner drops them)
        self._waiting_with_placeholder = False  # a preempted sequence waits for its token in flight
        self._prompting: list[Sequence] = []  # the sequences with prompt tokens in the step last scheduled
        self._sampling: list[Sequence] = []  # those the step last scheduled gave a placeholder (unschedule)
        self.proposer = proposer if num_speculative_tokens > 0 else None
        self.num_speculative_tokens = num_speculative_tokens
        self._truncated: dict[int, int] = {}  # sequences whose block tables lost blocks since last sent: blocks kept
        # Speculative decoding's counters (vLLM's metrics): sequence-steps that verified proposals, the proposals,
        # and those accepted
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a sequence now (an abort, or a stop string found in its text) and free its blocks."""
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._set_finished(seq, reason, stop_reason)
        if seq.num_sent_blocks >= 0 or seq.block_table:  # (a preempted one was freed then)
            self._free(seq)
        del self.seqs[seq.seq_id]

    @staticmethod
    def _set_finished(seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.status = SequenceStatus.FINISHED
        seq.num_output_placeholders = 0  # a token a step in flight draws for it is dropped

    def _free(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_sent_blocks = -1
        self._freed.append(seq.seq_id)
        if self.proposer is not None:
            self._truncated.pop(seq.seq_id, None)
            self.proposer.forget([seq.seq_id])

    # ---- scheduling -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        if self.policy == "static" and not self.running:
            self._admit_static_batch()

        preempted = False
        i = 0
        running = self.running  # (a preemption pops from this same list)
        block_size = self.block_size
        windowed = self.block_manager.sliding_window is not None
        proposals = self._propose() if self.proposer is not None else None
        while i < len(running) and budget > 0:
            seq = running[i]
            num_tokens, num_computed = seq.num_tokens, seq.num_computed_tokens
            if num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens:
                i += 1  # its last token is in flight: it finishes when that is read back
                continue
            if windowed:  # (before it takes blocks: those that fell out of the window serve first)
                self.block_manager.remove_skipped_blocks(seq)
            # The common case, a decode whose token fits in its last block, needs nothing of the block manager.
            num_new = min(num_tokens - num_computed, budget)
            if proposals and seq.seq_id in proposals:
                num_new += self._take_proposals(seq, proposals[seq.seq_id][:budget - 1], len(running) - i, out)
            if num_computed + num_new > len(seq.block_table) * block_size:
                num_new = self._try_allocate(seq, budget)
            while num_new is None:
                victim = running.pop()  # the youngest
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
                num_new = self._try_allocate(seq, budget)
            if num_new is None:
                break
            scheduled.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new
            i += 1

        # Admit no one in a step that had to preempt: the pool is already short.
        if self.policy == "continuous" and not preempted:
            now = time.time()
            deferred: list[Sequence] = []  # (they keep their places in the queue)
            seats = self.max_num_seqs - len(self.running)
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                if seq.num_output_placeholders:
                    break
                if (seq.grammar is not None and not seq.grammar.ready()) or (
                        self.share_prefix_computation and not seq.scores_prompt
                        and self.block_manager.is_being_computed(seq)):
                    deferred.append(self.waiting.popleft())
                    if len(deferred) >= seats:  # (as many as could have been seated: look no further)
                        break
                    continue
                num_new = self._try_allocate(seq, budget)
                if num_new is None:
                    break
                self.waiting.popleft()
                self._start_running(seq, now)
                scheduled.append(seq)
                out.num_new_tokens.append(num_new)
                budget -= num_new
            self.waiting.extendleft(reversed(deferred))
        if scheduled:  # (an empty batch reaches no model runner: the freed ids wait for the next one)
            out.finished_seq_ids, self._freed = self._freed, []
            self._describe(out, scheduled)
        return out

    def _propose(self, in_flight: bool = False) -> dict[int, list[int]]:
        """The proposer's tokens for the running sequences about to decode (their newest token is all they have left
        to compute), at most as many as max_tokens and max_model_len leave room for after the token each step draws
        anyway. in_flight: also for those whose newest token is in flight, from the tokens known (speculation_ready);
        a step never verifies proposals after a token it has not read."""
        seqs, limits = [], []
        k, max_model_len = self.num_speculative_tokens, self.max_model_len
        for seq in self.running:
            params = seq.params
            if (seq.num_tokens - seq.num_computed_tokens != 1 or (seq.num_output_placeholders and not in_flight)
                    or (seq.grammar is not None and not seq.grammar.ready()) or params.has_penalties
                    or seq.num_output_tokens < params.min_tokens):
                continue
            limit = min(k, params.max_tokens - seq.num_output_tokens - 1, max_model_len - seq.num_tokens - 1)
            if limit > 0:
                seqs.append(seq)
                limits.append(limit)
        if not seqs:
            return {}
        drafts = self.proposer.propose([s.seq_id for s in seqs], [s.token_ids for s in seqs], limits)
        # (under a grammar, only the proposals it allows: the step samples each under its bitmask row)
        drafts = [tokens if seq.grammar is None or not tokens else seq.grammar.valid_drafts(tokens)
                  for seq, tokens in zip(seqs, drafts)]
        return {seq.seq_id: tokens for seq, tokens in zip(seqs, drafts) if tokens}

    def speculation_ready(self) -> bool:
        """With async scheduling, whether the proposer finds tokens for a running sequence from the tokens known now
        (the newest in flight): then the engine reads the step in flight back before it schedules the next, which can
        verify proposals, rather than launching the next ahead without any. Open chat, where prompt lookup seldom
        finds anything, keeps the overlap; text that copies its context gets its proposals (the n-gram proposer's
        lookups cost microseconds, on the host while the step runs)."""
        return self.proposer is not None and bool(self._propose(in_flight=True))

    def _take_proposals(self, seq: Sequence, drafts: list[int], num_left: int, out: SchedulerOutput) -> int:
        """Schedule seq's proposals after its newest token if their slots are there or free blocks are (keeping a
        block for each running sequence not scheduled yet: proposals never preempt anyone); how many."""
        if not drafts:
            return 0
        end = seq.num_computed_tokens + 1 + len(drafts)
        bm = self.block_manager
        if end > len(seq.block_table) * self.block_size:
            if bm.blocks_needed(end) - len(seq.block_table) > bm.num_free_blocks - num_left or \
                    not bm.allocate(seq, 1 + len(drafts)):
                return 0
        out.scheduled_spec_decode_tokens[seq.seq_id] = drafts
        return len(drafts)

    def cache_launched(self) -> None:
        """Once the step schedule() last returned is launched: the full blocks of its sequences with prompt tokens
        (those it fills, and any earlier ones not cached yet) go into the prefix cache now, not when its tokens are
        read back. Any later step reads them after this one writes them (the device runs steps in order), so
        requests waiting for a prefix this step computes are seated in the very next step, which async scheduling
        plans while this one runs. (Blocks that decoding fills are cached by update_from_output: waiting requests
        share prompts, and leaving the decoding sequences out here keeps a decode step's host time down.)"""
        prompting, self._prompting = self._prompting, []
        self.block_manager.cache_full_blocks(prompting)  # (at once without prefix caching)

    def unschedule(self, out: SchedulerOutput) -> None:
        """Undo the step schedule() last returned, which never ran (the model runner refused one of its
        sequences): each of its sequences loses the placeholder the step gave it and is preempted, to be
        recomputed later from what is known, and the runner, whose state of them is void, is told again of the
        sequences freed before it."""
        for seq in self._sampling:
            seq.num_output_placeholders -= 1
        self._sampling = self._prompting = []
        self._freed[:0] = out.finished_seq_ids
        for seq_id in reversed(out.seq_ids):  # (each goes to the front of the queue: they keep their order)
            seq = self.seqs.get(seq_id)
            if seq is not None and seq.status == SequenceStatus.RUNNING:
                self.running.remove(seq)
                self._preempt(seq)

    def _describe(self, out: SchedulerOutput, scheduled: list[Sequence]) -> None:
        """Fill in what the runner needs of each scheduled sequence, and count the step's tokens as computed
        (their K/V are written in stream order before any later step reads them); a sequence whose last
        token is in the step gets a placeholder for the token it samples."""
        seq_ids = out.seq_ids
        self._prompting = prompting = []  # (for cache_launched)
        self._sampling = sampling = []  # (for unschedule)
        spec, truncated = out.scheduled_spec_decode_tokens, self._truncated
        for seq, num_new in zip(scheduled, out.num_new_tokens):
            seq_ids.append(seq.seq_id)
            num_blocks = len(seq.block_table)
            if truncated and seq.seq_id in truncated:
                if seq.num_sent_blocks >= 0:
                    out.truncated_block_tables[seq.seq_id] = truncated[seq.seq_id]
                del truncated[seq.seq_id]
            if seq.num_sent_blocks < 0:
                out.new_seqs.append(NewSequence(
                    seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens, seq.num_computed_tokens,
                    list(seq.block_table), seq.params, seq.seed, tuple(seq.stop_token_ids),
                    seq.prompt_logprobs_next if seq.scores_prompt else None))
                seq.num_sent_blocks = num_blocks
            elif num_blocks > seq.num_sent_blocks:
                out.new_block_ids[seq.seq_id] = seq.block_table[seq.num_sent_blocks:]
                seq.num_sent_blocks = num_blocks
            num_computed = seq.num_computed_tokens
            if num_computed < seq.num_prompt_tokens:
                self.num_prompt_tokens += min(seq.num_prompt_tokens - num_computed, num_new)
                prompting.append(seq)
            seq.num_computed_tokens = num_computed = num_computed + num_new
            if spec and seq.seq_id in spec:  # (its proposals are computed too, after its newest token)
                num_computed -= len(spec[seq.seq_id])
            if num_computed == len(seq.token_ids) + seq.num_output_placeholders:  # (Sequence.num_tokens)
                seq.num_output_placeholders += 1
                sampling.append(seq)
                if seq.grammar is not None:
                    out.structured_seq_ids.append(seq.seq_id)

    def _start_running(self, seq: Sequence, now: float) -> None:
        seq.status = SequenceStatus.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
        self.running.append(seq)

    def _admit_static_batch(self) -> None:
        """Seat as many waiting sequences as there are seats and blocks for their prompts."""
        free = self.block_manager.num_free_blocks
        now = time.time()
        while (self.waiting and len(self.running) < self.max_num_seqs
               and not self.waiting[0].num_output_placeholders):
            need = self.block_manager.blocks_needed(self.waiting[0].num_tokens + 1)
            if need > free and self.running:
                break
            free -= need
            self._start_running(self.waiting.popleft(), now)

    def _try_allocate(self, seq: Sequence, budget: int) -> int | None:
        """Blocks for seq's next chunk (at most `budget` tokens); its size, or None if the pool is short.
        A sequence without blocks first takes what the prefix cache holds of it, and claims the full blocks
        after that, which it computes."""
        starting = not seq.block_table
        cached = self.block_manager.find_cached_prefix(seq) if starting and not seq.scores_prompt else []
        num_computed = max(seq.num_computed_tokens, len(cached) * self.block_manager.block_size)
        num_new = min(seq.num_tokens - num_computed, budget)
        if not self.block_manager.allocate(seq, num_new, cached):
            return None
        if starting:
            self.block_manager.claim(seq, len(cached))
        if not seq.num_computed_tokens and seq.num_preemptions == 0:
            self.block_manager.record_prefix_lookup(seq.num_prompt_tokens, num_computed)
            seq.num_cached_tokens = num_computed
        seq.num_computed_tokens = num_computed
        return num_new

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and queue it first, to recompute prompt and output later."""
        self._free(seq)
        self._waiting_with_placeholder |= seq.num_output_placeholders > 0
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- after the step ---------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> EngineCoreOutputs:
        """Take a step's sampled tokens: append each sequence's new tokens in turn, until one is a stop token or
        its last (the rest are dropped: nothing past a stop or max_tokens), cache the full blocks of the step's
        sequences (those that just finished too, so that a follow-up prompt holding their output finds it), and
        free the finished ones. A sequence's tokens past the first have no K/V yet: the next step computes them
        with its new token, as a chunk. (This runs for every sequence at every step: the loops keep to plain
        attributes and local names.)"""
        request_ids: list[str] = []
        indexes: list[int] = []
        token_ids: list[int] = []
        outputs = EngineCoreOutputs(request_ids, indexes, token_ids)
        finished: list[Sequence] = []
        seqs = self.seqs
        spec = out.scheduled_spec_decode_tokens
        for seq_id, chunk in result.prompt_logprobs.items():
            seq = seqs.get(seq_id)
            if seq is not None and seq.scores_prompt:  # (what a preempted sequence's recomputation scores again goes)
                assert chunk.first <= seq.prompt_logprobs_next, "prompt logprobs scored out of order"
                chunk = chunk.since(seq.prompt_logprobs_next)
                if len(chunk):
                    outputs.prompt_logprobs.setdefault(seq.request_id, []).append(chunk)
                    seq.prompt_logprobs_next = chunk.first + len(chunk)
        for seq_id, new_tokens, new_logprobs in zip(result.seq_ids, result.sampled_token_ids, result.logprobs):
            seq = seqs.get(seq_id)
            if seq is None:  # it stopped at its previous token, or was aborted: these tokens are dropped
                continue
            seq.num_output_placeholders -= 1
            if spec and seq_id in spec:
                self._roll_back_rejected(seq, len(spec[seq_id]), len(new_tokens) - 1)
            for i, token in enumerate(new_tokens):
                seq.token_ids.append(token)
                if seq.grammar is not None:
                    seq.grammar.accept(token)
                entry = len(token_ids)
                request_ids.append(seq.request_id)
                indexes.append(seq.index)
                token_ids.append(token)
                if new_logprobs is not None:
                    outputs.logprobs[entry] = new_logprobs[i]
                if len(seq.token_ids) == seq.num_prompt_tokens + 1:
                    outputs.first[entry] = (seq.num_cached_tokens, seq.queued_time, seq.first_scheduled_time,
                                            time.time())
                if self._check_stop(seq, token):
                    finished.append(seq)
                    outputs.finished[entry] = (seq.finish_reason, seq.stop_reason)
                    break
        if self.block_manager.enable_prefix_caching:
            self.block_manager.cache_full_blocks(map(seqs.get, out.seq_ids))
        if finished:
            self.running = [s for s in self.running if not s.is_finished]
            for seq in finished:
                del seqs[seq.seq_id]
                if seq.block_table:  # (a preempted one has none)
                    self._free(seq)
        if self._waiting_with_placeholder:  # its token is known now: drop it if that token finished it
            self.waiting = deque(s for s in self.waiting if not s.is_finished)
            self._waiting_with_placeholder = False
        return outputs

    def _roll_back_rejected(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """seq verified num_drafts proposals and accepted the first num_accepted: the others' slots are not computed
        (the next step writes over them), and the blocks past the tokens it will have after this step are given
        back (the runner is told with its next step: SchedulerOutput.truncated_block_tables)."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        seq.num_computed_tokens -= num_drafts - num_accepted
        if self.block_manager.free_beyond(seq, seq.num_tokens + num_accepted + 1):
            seq.num_sent_blocks = min(seq.num_sent_blocks, len(seq.block_table))
            self._truncated[seq.seq_id] = len(seq.block_table)

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        """Finish seq if its new token is a stop token or its last; whether it did."""
        num_outputs = len(seq.token_ids) - seq.num_prompt_tokens  # this token's number
        params = seq.params
        if token in seq.stop_token_ids and num_outputs >= params.min_tokens:
            self._set_finished(seq, "stop", None if token in seq.eos_token_ids and not params.ignore_eos else token)
        elif num_outputs >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            self._set_finished(seq, "length", None)
        elif seq.grammar is not None and seq.grammar.terminated:
            self._set_finished(seq, "stop", None)
        else:
            return False
        return True
