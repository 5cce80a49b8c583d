"""Prompt logprobs (SamplingParams.prompt_logprobs): the log-probability the model gives each prompt token at its
place, with its rank and the top k there, which evaluation harnesses score a prompt with.

The hidden state at position p gives the logits of the token at p + 1, so a step that computes a prompt chunk
[start, end) scores the prompt tokens start + 1 .. end (those inside the prompt, from where the sequence's owed
logprobs start: NewSequence.prompt_logprobs_from). Those rows' logits are computed after the step's sampling, a
bounded number of rows at a time (score_chunk_rows: never prompt x vocabulary), and ops.token_logprobs takes from
each chunk only what the requests asked for, which alone leaves the device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tinyvllm import ops
from tinyvllm.contract import PromptLogprobsChunk
from tinyvllm.worker.input_batch import InputBatch

# Logits (rows x vocabulary) computed at once. On CUDA the chunk's logits in the model's dtype are all the memory
# scoring takes (the kernel reads them once, keeping nothing per token): 256 MiB in bfloat16, which the KV cache's
# profile reserves (kv_cache.py); a chunk of a thousand rows at a 128k vocabulary keeps the LM head's product large
# and the launches per row few. Where the reference runs (the CPU, or TINYVLLM_REFERENCE_OPS=1) it computes a float32
# log-softmax of the chunk: 64 MiB.
SCORE_CHUNK_ELEMENTS = {"cuda": 1 << 27, "cpu": 1 << 24}


@dataclass
class PromptScoring:
    """What one step scores: the rows of its hidden states whose next token is a prompt token owed a logprob, that
    token, and whose they are (by sequence, in row order: its first position, count and top k)."""

    rows: np.ndarray  # [L] int64, rows of the step's hidden states
    targets: np.ndarray  # [L] int64, the prompt token each row's logits score
    seq_ids: list[int]
    firsts: list[int]
    counts: list[int]
    top_ks: list[int]

    @property
    def max_top_k(self) -> int:
        return max(self.top_ks)


def find_prompt_scoring(batch: InputBatch, seq_ids: list[int], rows: np.ndarray, starts: np.ndarray,
                        ends: np.ndarray, cu_query_lens: np.ndarray) -> PromptScoring | None:
    """The step's scoring, for its sequences (input batch rows `rows`) computing positions [starts, ends), their
    tokens at cu_query_lens of the step's. Advances the rows' prompt_logprobs_from past what the step scores (to 0
    once the whole prompt is)."""
    owed_from, num_prompt = batch.prompt_logprobs_from, batch.num_prompt
    owing = np.flatnonzero(owed_from[rows])
    if not len(owing):
        return None
    hidden_rows, targets, scored = [], [], PromptScoring(np.empty(0), np.empty(0), [], [], [], [])
    for i in owing.tolist():
        row, start = int(rows[i]), int(starts[i])
        first = max(int(owed_from[row]), start + 1)
        end = min(int(ends[i]) + 1, int(num_prompt[row]))  # (position p's logits score the token at p + 1)
        if first >= end:  # (a recomputed chunk before what is owed)
            continue
        hidden_rows.append(np.arange(first - 1 - start, end - 1 - start, dtype=np.int64) + cu_query_lens[i])
        targets.append(np.asarray(batch.token_ids[row][first:end], dtype=np.int64))
        scored.seq_ids.append(seq_ids[i])
        scored.firsts.append(first)
        scored.counts.append(end - first)
        scored.top_ks.append(batch.params[row].prompt_logprobs or 0)
        owed_from[row] = end if end < num_prompt[row] else 0
    if not scored.seq_ids:
        return None
    scored.rows, scored.targets = np.concatenate(hidden_rows), np.concatenate(targets)
    return scored


def score_chunk_rows(vocab_size: int, device: torch.device) -> int:
    """How many rows' logits scoring computes at once on `device` (the reference's size where it runs there)."""
    elements = SCORE_CHUNK_ELEMENTS["cuda" if device.type == "cuda" and ops.triton_available() else "cpu"]
    return max(1, elements // vocab_size)


def score_chunks(num_rows: int, vocab_size: int, device: torch.device) -> list[slice]:
    """The rows computed together: every rank of a split vocabulary takes the same, as the logits' gather pairs
    them."""
    step = score_chunk_rows(vocab_size, device)
    return [slice(start, min(start + step, num_rows)) for start in range(0, num_rows, step)]


def score(compute_logits: Callable[[torch.Tensor], torch.Tensor | None], hidden: torch.Tensor,
          targets: torch.Tensor, top_k: int, vocab_size: int) -> tuple[torch.Tensor, ...] | None:
    """Per row of `hidden` (whose next token is `targets`): the token ids [L, 1 + top_k] (the target, then the top
    top_k), their logprobs (float32 log-softmax of the model's logits) and the target's rank [L], on the device;
    None on a rank other than 0 of a split vocabulary (which takes part in each chunk's gather all the same)."""
    ids, logprobs, ranks = [], [], []
    for rows in score_chunks(hidden.shape[0], vocab_size, hidden.device):
        logits = compute_logits(hidden[rows])
        if logits is None:
            continue
        target = targets[rows]
        chosen, rank, _, top_ids, top_logprobs = ops.token_logprobs(logits, target, top_k)
        ids.append(torch.cat([target[:, None], top_ids], dim=1))
        logprobs.append(torch.cat([chosen[:, None], top_logprobs], dim=1))
        ranks.append(rank)
    if not ranks:
        return None
    if len(ranks) == 1:
        return ids[0], logprobs[0], ranks[0]
    return torch.cat(ids), torch.cat(logprobs), torch.cat(ranks)


HostScores = tuple[tuple[torch.Tensor, ...], "torch.cuda.Event | None"]


def to_host(scores: tuple[torch.Tensor, ...]) -> HostScores:
    """The scores' copy to the host, queued behind the step (pinned memory, and an event to wait on): reading them
    then holds up nothing launched after this step (async scheduling), as the sampled tokens' copy does."""
    if not scores[0].is_cuda:
        return scores, None
    host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in scores)
    event = torch.cuda.Event()
    event.record()
    return host, event


def to_chunks(scoring: PromptScoring, scores: HostScores) -> dict[int, PromptLogprobsChunk]:
    """The scores (to_host's) by sequence, each cut to its own top k (waits for their copy)."""
    host, event = scores
    if event is not None:
        event.synchronize()
    ids, logprobs, ranks = (t.numpy() for t in host)
    chunks, offset = {}, 0
    for seq_id, first, count, top_k in zip(scoring.seq_ids, scoring.firsts, scoring.counts, scoring.top_ks):
        part = slice(offset, offset + count)
        chunks[seq_id] = PromptLogprobsChunk(first, ids[part, :1 + top_k], logprobs[part, :1 + top_k], ranks[part])
        offset += count
    return chunks
