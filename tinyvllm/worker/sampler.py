"""The sampler: from each sequence's final logits to its next token, applying that sequence's
SamplingParams (penalties, min_tokens, temperature, top-k/top-p/min-p, seed, logprobs).

Nothing here waits for the GPU: the tokens stay on the device (the next step may read them there, with
async scheduling) and are copied to pinned host memory behind an event; AsyncModelRunnerOutput.get() waits."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tinyvllm import ops
from tinyvllm.contract import GrammarOutput, ModelRunnerOutput
from tinyvllm.outputs import Logprob
from tinyvllm.worker.input_batch import InputBatch
from tinyvllm.worker.prompt_logprobs import HostScores, PromptScoring, to_chunks
from tinyvllm.worker.rejection_sampler import Verification

_MASK64 = (1 << 63) - 1
# Up to this many all-greedy rows (the default max_num_seqs), our sampling kernel's argmax (split over the
# vocabulary) is faster than torch.argmax; above them argmax runs (figures in benchmarks/RESULTS.md).
_KERNEL_GREEDY_MAX_ROWS = 256
_SEED_MULTIPLIERS = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def step_seed(seed: int, step: int) -> int:
    """A 63-bit seed for one draw, a function of the sequence's seed and how many tokens it has
    generated only, so that a seeded sequence draws the same tokens whatever else runs with it."""
    a, b, c = _SEED_MULTIPLIERS
    x = (seed * a + step * b) & _MASK64
    x ^= x >> 31
    return (x * c) & _MASK64


def step_seeds(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """step_seed over arrays (uint64 arithmetic wraps modulo 2^64, and the mask keeps 63 bits, so the
    values are step_seed's), as int64."""
    a, b, c = (np.uint64(m) for m in _SEED_MULTIPLIERS)
    mask = np.uint64(_MASK64)
    x = (seeds.astype(np.uint64) * a + steps.astype(np.uint64) * b) & mask
    x ^= x >> np.uint64(31)
    return ((x * c) & mask).astype(np.int64)


@dataclass
class SamplingTensors:
    """A step's per-row sampling parameters on the device, with host-side facts about them so that the
    sampler picks its path without reading anything back."""

    temperature: torch.Tensor | None  # [B] float32, 0 = greedy (the five are None when all rows are greedy)
    top_k: torch.Tensor | None  # [B] int64, <= 0 = off
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    seeds: torch.Tensor | None  # [B] int64, this draw's seed (step_seed)
    all_greedy: bool
    use_top_p: bool  # some sampled row has top_p < 1
    max_top_k: int  # the largest active top_k of a sampled row, 0 for none
    use_min_p: bool  # some sampled row has min_p > 0
    # Whether some row asks for what needs a pass over the sequences in Python (most steps: none)
    any_penalties: bool = False
    any_logprobs: bool = False
    any_min_tokens: bool = False
    any_structured: bool = False  # some row samples under a grammar (its bitmask comes with sample_tokens)

    @property
    def needs_host_pass(self) -> bool:
        """Whether some row asks for logprobs, penalties, min_tokens or a grammar, which the sampler applies row by
        row from the host's histories and bitmasks: else the tokens come from the logits and these tensors alone
        (Sampler.draw), which a CUDA graph can hold."""
        return self.any_penalties or self.any_logprobs or self.any_min_tokens or self.any_structured

    @property
    def needs_logits(self) -> bool:
        """Whether a row samples, or asks for logprobs, penalties or min_tokens: else the greedy tokens alone
        will do, and the model may take them without writing logits (CausalLM.greedy_tokens)."""
        return not self.all_greedy or self.needs_host_pass

    def with_tensors(self, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                     seeds: torch.Tensor) -> SamplingTensors:
        """These hints with the rows' parameters on the device."""
        return dataclasses.replace(self, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds)

    @classmethod
    def greedy(cls, **flags: bool) -> SamplingTensors:
        """Every row greedy: no per-row tensors (the sampler takes the argmax). `flags`: the any_* fields."""
        return cls(None, None, None, None, None, all_greedy=True, use_top_p=False, max_top_k=0, use_min_p=False,
                   **flags)


# What a step's output calls when its tokens are on the host: (input batch rows at launch, their sequences' ids,
# the tokens), as InputBatch.record_tokens takes them.
OnReady = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


class AsyncModelRunnerOutput:
    """A step's sampled tokens on their way to the host. `token_ids` (on the device) feeds the next step's
    inputs; get() waits for the copy and returns the ModelRunnerOutput. Token i is sequence seq_ids[i]'s, which
    held the input batch's row rows[i] when the step was launched."""

    def __init__(self, seq_ids: list[int], rows: np.ndarray, token_ids: torch.Tensor, host: torch.Tensor,
                 event: torch.cuda.Event | None, token_scores: tuple[torch.Tensor, ...] | None,
                 num_logprobs: list[int | None] | None, has_penalties: bool, on_ready: OnReady | None = None,
                 timer: tuple[torch.cuda.Event, torch.cuda.Event] | None = None) -> None:
        self.seq_ids = seq_ids
        self.rows = rows
        self.token_ids = token_ids
        self.has_penalties = has_penalties  # the next step cannot overlap this one: it needs these tokens
        # The drawn tokens' logprobs, ranks, top ids and top logprobs (ops.token_logprobs), on the host once the
        # event has passed
        self._host, self._event, self._token_scores = host, event, token_scores
        self._num_logprobs, self._on_ready, self._timer = num_logprobs, on_ready, timer
        # The step's prompt logprobs on the device (prompt_logprobs.score), set by the runner after sampling
        self.prompt_scores: tuple[PromptScoring, HostScores] | None = None
        # A step that verified proposed tokens: its rows are several per sequence, turned into each one's accepted
        # run when read (rejection_sampler.py); set by the runner after sampling
        self.verification: Verification | None = None

    def places(self, rows: np.ndarray) -> np.ndarray:
        """Where in token_ids the tokens of these input batch rows are (rows whose token this step sampled and
        that their sequences still hold: the next step's inputs in flight)."""
        place = np.full(max(int(self.rows.max()), int(rows.max())) + 1, -1, dtype=np.int64)
        place[self.rows] = np.arange(len(self.rows))
        places = place[rows]
        assert (places >= 0).all(), "an input in flight that the step before did not sample"
        return places

    def get(self) -> ModelRunnerOutput:
        if self._event is not None:
            self._event.synchronize()
        host = self._host.numpy()
        token_ids = host.reshape(-1, 1).tolist()  # (a list of one token per sequence)
        if self._on_ready is not None:
            self._on_ready(self.rows, np.array(self.seq_ids, dtype=np.int64), host)
        logprobs: list[list[dict[int, Logprob]] | None] = [None] * len(self.seq_ids)
        if self._token_scores is not None and self._num_logprobs is not None:
            chosen, ranks, top_ids, top_logprobs = (t.tolist() for t in self._token_scores)
            for row, ((token,), top_n) in enumerate(zip(token_ids, self._num_logprobs)):
                if top_n is not None:
                    logprobs[row] = [_logprobs_of(token, chosen[row], ranks[row], top_ids[row][:top_n],
                                                  top_logprobs[row][:top_n])]
        gpu_ms = None
        if self._timer is not None:
            start, end = self._timer
            end.synchronize()
            gpu_ms = start.elapsed_time(end)
        prompt_logprobs = to_chunks(*self.prompt_scores) if self.prompt_scores is not None else {}
        output = ModelRunnerOutput(self.seq_ids, token_ids, logprobs, gpu_ms, prompt_logprobs)
        return output if self.verification is None else self.verification.accept(output)


def _logprobs_of(token: int, chosen: float, rank: int, top_ids: list[int], top_logprobs: list[float]
                 ) -> dict[int, Logprob]:
    """A drawn token's logprobs entry: the token's own, then the top ones by rank (the token once, if among them)."""
    result = {token: Logprob(chosen, rank)}
    for top_rank, (index, value) in enumerate(zip(top_ids, top_logprobs), start=1):
        result.setdefault(index, Logprob(value, top_rank))
    return result


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # Two pinned buffers for the tokens' copy to the host, used in turn: step N's is read while step
        # N+1's copy is queued (async scheduling); N+2 reuses N's, which has been read by then.
        self._host_buffers: list[torch.Tensor] = []
        self._turn = 0
        # Sampling parameters of greedy rows (temperature 0) for the kernel's argmax, made once: not in the
        # middle of a CUDA graph's capture, whose allocations belong to the graph's pool.
        zeros = torch.zeros(_KERNEL_GREEDY_MAX_ROWS, dtype=torch.float32, device=device)
        index = torch.zeros(_KERNEL_GREEDY_MAX_ROWS, dtype=torch.int64, device=device)
        self._greedy = (zeros, index, torch.ones_like(zeros), zeros, index)

    def __call__(self, logits: torch.Tensor, sampling: SamplingTensors, batch: InputBatch, rows: np.ndarray,
                 seq_ids: list[int], on_ready: OnReady | None = None,
                 timer: tuple[torch.cuda.Event, torch.cuda.Event] | None = None,
                 grammar: GrammarOutput | None = None) -> AsyncModelRunnerOutput:
        """Sample one token for each row of `logits`: row i is the batch's row rows[i], sequence seq_ids[i].
        Its outputs so far (num_tokens - num_prompt: before this step's token) count for min_tokens; the grammar's
        rows mask what their sequences may draw."""
        # The logits come in the model's dtype. Logprobs are those of the model's own distribution, before
        # penalties and temperature, in float32; penalties are applied in float32 too (as vLLM). Penalties and
        # min_tokens change a copy; the grammar's mask is written in place, so the raw logits are kept aside from it.
        grammar_applies = grammar is not None and bool(grammar.seq_ids)
        raw_logits = None
        if sampling.any_logprobs:
            raw_logits = logits.clone() if grammar_applies else logits
        if sampling.any_penalties:
            logits = self._apply_penalties(logits.float(), batch, rows)
        if sampling.any_min_tokens:
            logits = self._apply_min_tokens(logits, batch, rows)
        if grammar_applies:
            logits = self._apply_grammar(logits, grammar, seq_ids)
        token_ids = self.draw(logits, sampling)
        token_scores = None
        if raw_logits is not None:
            top_n = max((p.logprobs or 0 for p in (batch.params[row] for row in rows.tolist())), default=0)
            chosen, ranks, _, top_ids, top_logprobs = ops.token_logprobs(raw_logits, token_ids, top_n)
            token_scores = (chosen, ranks, top_ids, top_logprobs)
        return self.output(token_ids, sampling, batch, rows, seq_ids, on_ready, timer, token_scores)

    def draw(self, logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
        """One token per row of `logits` (penalties and min_tokens already applied), on the device. Nothing here
        reads back or allocates outside the kernels' outputs, so a CUDA graph can hold it (CudaGraphs)."""
        if sampling.all_greedy and logits.is_cuda and logits.shape[0] <= _KERNEL_GREEDY_MAX_ROWS:
            return ops.sample(logits, *(t[: logits.shape[0]] for t in self._greedy), use_top_p=False, max_top_k=0,
                              use_min_p=False)
        if sampling.all_greedy:
            return logits.argmax(dim=-1)
        return ops.sample(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
                          sampling.seeds, use_top_p=sampling.use_top_p, max_top_k=sampling.max_top_k,
                          use_min_p=sampling.use_min_p)

    def output(self, token_ids: torch.Tensor, sampling: SamplingTensors, batch: InputBatch, rows: np.ndarray,
               seq_ids: list[int], on_ready: OnReady | None = None,
               timer: tuple[torch.cuda.Event, torch.cuda.Event] | None = None,
               token_scores: tuple[torch.Tensor, ...] | None = None) -> AsyncModelRunnerOutput:
        """The step's output from tokens already drawn (by __call__, or by the model's greedy LM head), on their
        way to the host, with their logprobs (token_scores: __call__'s) where asked."""
        num_logprobs = None
        if sampling.any_logprobs:
            num_logprobs = [p.logprobs for p in (batch.params[row] for row in rows.tolist())]
        if timer is not None:
            timer[1].record()
        if token_scores is not None and token_scores[0].is_cuda:  # (queued before the tokens' copy and its event)
            token_scores = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                                 for t in token_scores)
        return AsyncModelRunnerOutput(seq_ids, rows, token_ids, *self._to_host(token_ids), token_scores, num_logprobs,
                                      sampling.any_penalties, on_ready, timer)

    def _to_host(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if token_ids.device.type != "cuda":
            return token_ids, None
        n = token_ids.shape[0]
        if not self._host_buffers or self._host_buffers[0].shape[0] < n:
            size = max(n, 2 * self._host_buffers[0].shape[0] if self._host_buffers else 256)
            self._host_buffers = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        host = self._host_buffers[self._turn][:n]
        self._turn ^= 1
        host.copy_(token_ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _apply_penalties(self, logits: torch.Tensor, batch: InputBatch, rows: np.ndarray) -> torch.Tensor:
        """vLLM's semantics: repetition divides positive (multiplies negative) logits of every token
        seen in prompt or output; frequency and presence subtract per output occurrence / once. (The
        engine never overlaps a step with penalties: their token histories are all on the host.)"""
        logits = logits.clone()
        for i, row in enumerate(rows.tolist()):
            p = batch.params[row]
            if not p.has_penalties:
                continue
            history = batch.token_ids[row]
            assert len(history) == batch.num_tokens[row], "penalties need every earlier token on the host"
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(history)), dtype=torch.long, device=logits.device)
                values = logits[i, seen]
                logits[i, seen] = torch.where(values > 0, values / p.repetition_penalty,
                                              values * p.repetition_penalty)
            outputs = history[batch.num_prompt[row]:]
            if (p.frequency_penalty or p.presence_penalty) and outputs:
                counts = torch.bincount(torch.tensor(outputs, device=logits.device),
                                        minlength=logits.shape[1])[: logits.shape[1]].to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    @staticmethod
    def _apply_grammar(logits: torch.Tensor, grammar: GrammarOutput, seq_ids: list[int]) -> torch.Tensor:
        """Mask the logits of the rows whose sequences the grammar names (a sequence gone since has none): a
        sequence's j-th bitmask row masks its j-th logits row (a verification samples several per sequence)."""
        places: dict[int, list[int]] = {}
        for i, seq_id in enumerate(seq_ids):
            places.setdefault(seq_id, []).append(i)
        pairs, taken = [], dict.fromkeys(places, 0)
        for i, seq_id in enumerate(grammar.seq_ids):
            if seq_id in places and taken[seq_id] < len(places[seq_id]):
                pairs.append((places[seq_id][taken[seq_id]], i))
                taken[seq_id] += 1
        if not pairs:
            return logits
        rows = torch.tensor([r for r, _ in pairs], dtype=torch.int64).to(logits.device, non_blocking=True)
        bitmask = torch.from_numpy(grammar.bitmask[[i for _, i in pairs]]).to(logits.device, non_blocking=True)
        return ops.apply_token_bitmask(logits.contiguous(), bitmask, rows)

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, batch: InputBatch, rows: np.ndarray) -> torch.Tensor:
        """Until a sequence has min_tokens outputs, its EOS and stop tokens cannot be drawn."""
        cloned = False
        num_outputs = batch.num_tokens[rows] - batch.num_prompt[rows]
        for i, row in enumerate(rows.tolist()):
            stops = batch.stop_token_ids[row]
            if num_outputs[i] < batch.params[row].min_tokens and stops:
                if not cloned:
                    logits, cloned = logits.clone(), True
                logits[i, list(stops)] = float("-inf")
        return logits
