"""The engine/worker contract: what the scheduler tells the model runner at each step, and what the
runner gives back. Plain data only: the two sides share no mutable object, so either can change how it
works (or run in another rank or process) without touching the other. Names follow vLLM's V1 engine.

A sequence is sent in full once (NewSequence), when the runner first sees it or sees it again after a
preemption; after that a step names it by id with its new-token count, and the blocks it gained. The
runner keeps its own per-sequence state from these messages (worker/input_batch.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinyvllm.outputs import Logprob
from tinyvllm.sampling_params import SamplingParams


@dataclass
class NewSequence:
    """Everything the runner needs about a sequence it does not hold yet."""

    seq_id: int
    token_ids: list[int]  # every token known: the prompt, then (after a preemption) the outputs so far
    num_prompt_tokens: int
    num_computed_tokens: int  # already in the KV cache (a prefix-cache hit)
    block_ids: list[int]
    params: SamplingParams
    seed: int  # the sequence's base seed; each draw's seed derives from it and the output count
    stop_token_ids: tuple[int, ...]  # what min_tokens keeps from being drawn (EOS unless ignore_eos, stop ids)
    # The first prompt position whose logprob the runner computes (SamplingParams.prompt_logprobs), up to the
    # prompt's end; None: none (not asked, another of the request's n completions, or all sent already).
    prompt_logprobs_from: int | None = None


class SequenceError(Exception):
    """The model runner could not take one sequence into a step, and raised before the step ran. The engine core
    fails that sequence's request (finish_reason "error"), undoes the step (its other sequences are recomputed
    later: the runner's state of them is void) and goes on serving everyone else."""

    def __init__(self, seq_id: int, message: str) -> None:
        super().__init__(f"sequence {seq_id}: {message}")
        self.seq_id = seq_id
        self.message = message


@dataclass
class SchedulerOutput:
    """One step: which sequences run, in batch order, with how many new tokens each."""

    seq_ids: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    new_seqs: list[NewSequence] = field(default_factory=list)
    new_block_ids: dict[int, list[int]] = field(default_factory=dict)  # seen sequences' blocks gained since
    # Sequences freed since the last step (finished, aborted or preempted): the runner drops their state.
    finished_seq_ids: list[int] = field(default_factory=list)
    # Proposed (draft) tokens the step verifies, by sequence (speculative decoding): the last of the sequence's
    # num_new_tokens, after its newest token. The runner samples at each of these 1 + k positions and returns the
    # accepted run (ModelRunnerOutput); both sides then count the rejected ones' slots as not computed.
    scheduled_spec_decode_tokens: dict[int, list[int]] = field(default_factory=dict)
    # Seen sequences whose block tables lost their last blocks since (those of rejected proposals, given back): how
    # many blocks each keeps, before any of new_block_ids.
    truncated_block_tables: dict[int, int] = field(default_factory=dict)
    # The sequences that sample in this step under a grammar (structured output): the engine fills their rows of
    # the step's GrammarOutput once their tokens before are known
    structured_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def is_empty(self) -> bool:
        return not self.seq_ids


@dataclass
class GrammarOutput:
    """What a step's constrained sequences may draw (structured output), for ModelRunner.sample_tokens: row i of
    the bitmask is sequence seq_ids[i]'s, token v allowed where bit v % 32 of word v // 32 is set. A sequence that
    verifies k proposals has 1 + k rows in a row, for its sampled positions in order."""

    seq_ids: list[int]
    bitmask: np.ndarray  # int32 [len(seq_ids), ceil(vocab_size / 32)]


@dataclass
class PromptLogprobsChunk:
    """The logprobs of one sequence's prompt tokens at positions first .. first + L - 1, which one step scored, as
    arrays (they cross the pipe to the API process: a few arrays pickle in microseconds, L x (k + 1) small objects
    do not). Column 0 is the prompt's own token, columns 1..k the top k at its place (vLLM's LogprobsTensors)."""

    first: int
    token_ids: np.ndarray  # [L, 1 + k] int64
    logprobs: np.ndarray  # [L, 1 + k] float32
    ranks: np.ndarray  # [L] int64: the prompt token's rank (1: the most likely)

    def __len__(self) -> int:
        return len(self.ranks)

    def since(self, position: int) -> PromptLogprobsChunk:
        """The rows from `position` on (a recomputed chunk after a preemption scores some positions again)."""
        skip = max(0, position - self.first)
        return PromptLogprobsChunk(self.first + skip, self.token_ids[skip:], self.logprobs[skip:], self.ranks[skip:])


@dataclass
class ModelRunnerOutput:
    """The tokens a step sampled for each sequence whose last known token was in the step: a list each, of one
    token, or, where the step verified k proposed tokens, the a accepted ones and the token drawn after them (a + 1,
    a <= k: the other k - a proposals were rejected)."""

    seq_ids: list[int]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[dict[int, Logprob]] | None]  # per sampled sequence, a dict per token, where asked
    gpu_time_ms: float | None = None  # the step's device time, when the engine asked for it
    # By sequence, the prompt logprobs the step scored (NewSequence.prompt_logprobs_from): any sequence with prompt
    # tokens in the step, sampled or not
    prompt_logprobs: dict[int, PromptLogprobsChunk] = field(default_factory=dict)


@dataclass
class EngineCoreOutputs:
    """What the engine core reports after a step: each sequence that got a token, its token, and whether it
    finished, as columns (entry i is one sequence). The output processor turns these into RequestOutputs.

    Columns, not an object per sequence: the server's engine core sends one of these per step to the API
    process, and a few lists of ints and strings pickle in microseconds where hundreds of small objects took
    a millisecond each way. What only some entries have is kept sparse, by entry."""

    request_ids: list[str] = field(default_factory=list)
    indexes: list[int] = field(default_factory=list)  # which of the request's n completions
    token_ids: list[int] = field(default_factory=list)  # the entry's new token (a sequence may have several entries)
    # entry -> (finish_reason: "stop", "length" or "abort"; stop_reason: the stop token id or string, or None)
    finished: dict[int, tuple[str, int | str | None]] = field(default_factory=dict)
    logprobs: dict[int, dict[int, Logprob]] = field(default_factory=dict)  # entry -> its token's, where asked
    # entry -> on a sequence's first token: (prompt tokens served from the prefix cache, and the core's times
    # (time.time()) of its queueing, first scheduling and of this token), for the latency metrics
    first: dict[int, tuple[int, float, float | None, float]] = field(default_factory=dict)
    # request id -> why the engine could not serve it: its unfinished completions end with finish_reason "error"
    errors: dict[str, str] = field(default_factory=dict)
    # request id -> its prompt's logprobs scored since the last outputs, in prompt order (they come before its
    # first token: a step that computes a prompt chunk samples nothing)
    prompt_logprobs: dict[str, list[PromptLogprobsChunk]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.request_ids)

    def extend(self, other: EngineCoreOutputs) -> None:
        """Append a later step's entries (so that several steps read at once are processed as one)."""
        offset = len(self.request_ids)
        self.request_ids += other.request_ids
        self.indexes += other.indexes
        self.token_ids += other.token_ids
        for mine, theirs in zip(self._sparse(), other._sparse()):
            for entry, value in theirs.items():
                mine[entry + offset] = value
        self.errors.update(other.errors)
        for request_id, chunks in other.prompt_logprobs.items():
            self.prompt_logprobs.setdefault(request_id, []).extend(chunks)

    def select(self, entries: list[int], errors: dict[str, str],
               prompt_logprobs: dict[str, list[PromptLogprobsChunk]]) -> EngineCoreOutputs:
        """The given entries (in that order), errors and prompt logprobs as outputs of their own: one API
        process's share of a step."""
        out = EngineCoreOutputs([self.request_ids[e] for e in entries], [self.indexes[e] for e in entries],
                                [self.token_ids[e] for e in entries], errors=errors, prompt_logprobs=prompt_logprobs)
        for mine, theirs in zip(out._sparse(), self._sparse()):
            if theirs:
                for new, old in enumerate(entries):
                    if old in theirs:
                        mine[new] = theirs[old]
        return out

    def _sparse(self) -> tuple[dict[int, Any], dict[int, Any], dict[int, Any]]:
        return self.finished, self.logprobs, self.first

    def add(self, request_id: str, index: int, token_id: int) -> int:
        """Append an entry; its position, for the sparse columns."""
        self.request_ids.append(request_id)
        self.indexes.append(index)
        self.token_ids.append(token_id)
        return len(self.request_ids) - 1


@dataclass
class StepStats:
    """One engine step, for whoever watches (benchmarks, tests, metrics): LLMEngine.add_step_callback. With
    async scheduling a step is launched during the step before it: its times are its own all the same."""

    num_seqs: int  # sequences in the step
    num_prefill_tokens: int  # prompt tokens computed (prefix-cache hits not counted)
    num_decode_tokens: int  # the step's other tokens
    num_inputs_in_flight: int  # input tokens taken on the device from the step before (async scheduling)
    num_running: int
    num_waiting: int
    num_blocks_used: int
    num_blocks: int
    num_preemptions: int  # in this step
    schedule_ms: float  # the scheduler's decision
    launch_ms: float  # the model runner: inputs, forward pass and sampler launched (on the CPU: run)
    wait_ms: float = 0.0  # waiting for the sampled tokens: device time the host could not hide
    update_ms: float = 0.0  # the scheduler taking the tokens (stop checks, freeing, prefix cache)
    gpu_ms: float | None = None  # the step's device time (with record_gpu_time)

    @property
    def host_ms(self) -> float:
        return self.schedule_ms + self.launch_ms + self.update_ms
