"""The sampler: from each sequence's final logits to its next token, applying that sequence's
SamplingParams (penalties, min_tokens, temperature, top-k/top-p/min-p, seed, logprobs).

Nothing here waits for the GPU: the tokens stay on the device (the next step may read them there, with
async scheduling) and are copied to pinned host memory behind an event; AsyncSamplerOutput.get() waits."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from tinyvllm import ops
from tinyvllm.engine.sequence import Sequence
from tinyvllm.outputs import Logprob

_MASK64 = (1 << 63) - 1
# Up to this many all-greedy rows, our sampling kernel's argmax (split over the vocabulary) beats torch.argmax:
# at batch 1, in a CUDA graph, the kernel took 7.1 us with sampling and torch.argmax 26.6 us; at 64 rows
# argmax was faster, 46 us to 83 (benchmarks/bench_kernels.py, H200, 2026-12-03).
_KERNEL_GREEDY_MAX_ROWS = 8
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

    @classmethod
    def greedy(cls, **flags: bool) -> SamplingTensors:
        """Every row greedy: no per-row tensors (the sampler takes the argmax). `flags`: the any_* fields."""
        return cls(None, None, None, None, None, all_greedy=True, use_top_p=False, max_top_k=0, use_min_p=False,
                   **flags)


@dataclass
class SamplerOutput:
    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]


class AsyncSamplerOutput:
    """A step's sampled tokens on their way to the host. `token_ids` (on the device) feeds the next
    step's inputs; get() waits for the copy and returns the SamplerOutput."""

    def __init__(self, seqs: list[Sequence], token_ids: torch.Tensor, host: torch.Tensor,
                 event: torch.cuda.Event | None, raw_logprobs: torch.Tensor | None, has_penalties: bool) -> None:
        self.seqs = seqs
        self.token_ids = token_ids
        self.has_penalties = has_penalties  # the next step cannot overlap this one: it needs these tokens
        self._host, self._event, self._raw_logprobs = host, event, raw_logprobs

    @functools.cached_property
    def row_of(self) -> dict[int, int]:
        """seq_id -> row of token_ids (only a next step with pending inputs asks)."""
        return {seq.seq_id: row for row, seq in enumerate(self.seqs)}

    def get(self) -> SamplerOutput:
        if self._event is not None:
            self._event.synchronize()
        token_ids = self._host.tolist()
        logprobs: list[dict[int, Logprob] | None] = [None] * len(self.seqs)
        if self._raw_logprobs is not None:
            for row, (seq, token) in enumerate(zip(self.seqs, token_ids)):
                if seq.params.logprobs is not None:
                    logprobs[row] = _logprobs_of(self._raw_logprobs[row], token, seq.params.logprobs)
        return SamplerOutput(self.seqs, token_ids, logprobs)


def _logprobs_of(row: torch.Tensor, token: int, top_n: int) -> dict[int, Logprob]:
    chosen = row[token]
    result = {token: Logprob(chosen.item(), int((row > chosen).sum().item()) + 1)}
    if top_n:
        values, indices = row.topk(top_n)
        for rank, (value, index) in enumerate(zip(values.tolist(), indices.tolist()), start=1):
            result.setdefault(index, Logprob(value, rank))
    return result


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # Two pinned buffers for the tokens' copy to the host, used in turn: step N's is read while step
        # N+1's copy is queued (async scheduling); N+2 reuses N's, which has been read by then.
        self._host_buffers: list[torch.Tensor] = []
        self._turn = 0
        self._greedy: tuple[torch.Tensor, ...] = ()

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence],
                 sampling: SamplingTensors) -> AsyncSamplerOutput:
        # The logits come in the model's dtype. Logprobs are those of the model's own distribution, before
        # penalties and temperature, in float32; penalties are applied in float32 too (as vLLM).
        raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32) if sampling.any_logprobs else None
        if sampling.any_penalties:
            logits = self._apply_penalties(logits.float(), seqs)
        if sampling.any_min_tokens:
            logits = self._apply_min_tokens(logits, seqs)
        if sampling.all_greedy and logits.is_cuda and logits.shape[0] <= _KERNEL_GREEDY_MAX_ROWS:
            token_ids = ops.sample(logits, *self._greedy_rows(logits.shape[0]), use_top_p=False, max_top_k=0,
                                   use_min_p=False)
        elif sampling.all_greedy:
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = ops.sample(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
                                   sampling.seeds, use_top_p=sampling.use_top_p, max_top_k=sampling.max_top_k,
                                   use_min_p=sampling.use_min_p)
        return AsyncSamplerOutput(seqs, token_ids, *self._to_host(token_ids), raw_logprobs, sampling.any_penalties)

    def _greedy_rows(self, n: int) -> tuple[torch.Tensor, ...]:
        """Sampling parameters of n greedy rows (temperature 0), kept on the device."""
        if not self._greedy or self._greedy[0].shape[0] < n:
            size = max(n, _KERNEL_GREEDY_MAX_ROWS)
            zeros = torch.zeros(size, dtype=torch.float32, device=self.device)
            index = torch.zeros(size, dtype=torch.int64, device=self.device)
            self._greedy = (zeros, index, torch.ones_like(zeros), zeros, index)
        return tuple(t[:n] for t in self._greedy)

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

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """vLLM's semantics: repetition divides positive (multiplies negative) logits of every token
        seen in prompt or output; frequency and presence subtract per output occurrence / once. (The
        engine never overlaps a step with penalties: their token histories must be known.)"""
        rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            seq, p = seqs[i], seqs[i].params
            assert not seq.num_pending, "penalties need every earlier token on the host"
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
                values = logits[i, seen]
                logits[i, seen] = torch.where(values > 0, values / p.repetition_penalty,
                                              values * p.repetition_penalty)
            if (p.frequency_penalty or p.presence_penalty) and seq.num_output_tokens:
                counts = torch.bincount(torch.tensor(seq.output_token_ids, device=logits.device),
                                        minlength=logits.shape[1])[: logits.shape[1]].to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Until a sequence has min_tokens outputs, its EOS and stop tokens cannot be drawn."""
        cloned = False
        for i, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens and seq.stop_token_set:
                if not cloned:
                    logits, cloned = logits.clone(), True
                logits[i, list(seq.stop_token_set)] = float("-inf")
        return logits
