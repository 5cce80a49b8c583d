"""The sampler: from each sequence's final logits to its next token, applying that sequence's
SamplingParams (penalties, min_tokens, temperature, top-k/top-p/min-p, seed, logprobs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyvllm import ops
from tinyvllm.engine.sequence import Sequence
from tinyvllm.outputs import Logprob

_MASK64 = (1 << 63) - 1


def step_seed(seed: int, step: int) -> int:
    """A 63-bit seed for one draw, a function of the sequence's seed and how many tokens it has
    generated only, so that a seeded sequence draws the same tokens whatever else runs with it."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 31
    return (x * 0x94D049BB133111EB) & _MASK64


@dataclass
class SamplerOutput:
    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        params = [s.params for s in seqs]
        # Logprobs are those of the model's own distribution, before penalties and temperature.
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = self._apply_penalties(logits, seqs)
        logits = self._apply_min_tokens(logits, seqs)
        if all(p.greedy for p in params):
            token_tensor = logits.argmax(dim=-1)
        else:
            def column(values: list, dtype: torch.dtype) -> torch.Tensor:
                return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

            token_tensor = ops.sample(
                logits,
                column([0.0 if p.greedy else p.temperature for p in params], torch.float32),
                column([p.top_k for p in params], torch.int64),
                column([p.top_p for p in params], torch.float32),
                column([p.min_p for p in params], torch.float32),
                column([step_seed(s.seed, s.num_output_tokens) for s in seqs], torch.int64),
            )
        token_ids = token_tensor.tolist()
        logprobs: list[dict[int, Logprob] | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            for row, (seq, token) in enumerate(zip(seqs, token_ids)):
                if seq.params.logprobs is not None:
                    logprobs[row] = self._logprobs_of(raw_logprobs[row], token, seq.params.logprobs)
        return SamplerOutput(seqs, token_ids, logprobs)

    @staticmethod
    def _logprobs_of(row: torch.Tensor, token: int, top_n: int) -> dict[int, Logprob]:
        chosen = row[token]
        result = {token: Logprob(chosen.item(), int((row > chosen).sum().item()) + 1)}
        if top_n:
            values, indices = row.topk(top_n)
            for rank, (value, index) in enumerate(zip(values.tolist(), indices.tolist()), start=1):
                result.setdefault(index, Logprob(value, rank))
        return result

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """vLLM's semantics: repetition divides positive (multiplies negative) logits of every token
        seen in prompt or output; frequency and presence subtract per output occurrence / once."""
        rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            seq, p = seqs[i], seqs[i].params
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
