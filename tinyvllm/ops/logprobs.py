"""Token logprobs from a block of logits: per row, the log-probability of a given token (the prompt token a row
scores, or the token just sampled), its rank, the row's logsumexp and the top k, all in float32 log-softmax
semantics, without a float32 copy of the logits.

    lse = log(sum_v exp(x_v))        logprob(t) = x_t - lse        rank(t) = 1 + #{v : x_v > x_t}
    top k: the k largest x_v (ties: the lower token id first), with logprobs x_v - lse

The Triton kernel reads each row once, in vocabulary tiles: a running max and sum of exponentials (online
softmax), the count of logits above the target's, and a running top k that a tile only touches when it holds a
logit above the k-th kept (after the first tiles, seldom). The kernel counts the rank on the logits, the reference
on their float32 log-softmax: the two differ only where rounding x - lse to float32 merges a logit above the
target's with it (some float32 logits; bfloat16 ones only very near zero), and then the kernel's follows the
logits' own order."""

from __future__ import annotations

import torch

from tinyvllm.ops.triton_import import tl, triton

TokenLogprobs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def token_logprobs_ref(logits: torch.Tensor, targets: torch.Tensor, top_k: int) -> TokenLogprobs:
    """logits [L, V] (any float dtype), targets [L] int64, top_k >= 0 -> (target logprobs [L] float32, target ranks
    [L] int32, logsumexp [L] float32, top ids [L, top_k] int64, top logprobs [L, top_k] float32), the logprobs those
    of torch.log_softmax in float32."""
    logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    chosen = logprobs.gather(1, targets[:, None])
    ranks = _count_greater(logprobs, chosen) + 1
    top = logprobs.topk(max(top_k, 1), dim=1)  # (its first: the max, whose logprob is -log sum exp(x - max))
    lse = logits.gather(1, top.indices[:, :1]).float().squeeze(1) - top.values[:, 0]
    return chosen.squeeze(1), ranks, lse, top.indices[:, :top_k], top.values[:, :top_k]


def _count_greater(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """How many of each row's values exceed its chosen one. On the CPU a few rows at a time, so that the comparison's
    mask stays in the cache (a third of the time of one pass over the whole chunk); on a GPU in one pass."""
    block = logprobs.shape[0] if logprobs.is_cuda else 8
    counts = [(logprobs[r:r + block] > chosen[r:r + block]).sum(dim=1, dtype=torch.int32)
              for r in range(0, logprobs.shape[0], block)]
    if not counts:
        return torch.zeros(0, dtype=torch.int32, device=logprobs.device)
    return counts[0] if len(counts) == 1 else torch.cat(counts)


if triton is not None:

    @triton.jit
    def _weakest(top_value, top_id):
        """The kept entry a better one replaces: the lowest value, and of those the highest token id."""
        value = tl.min(top_value, axis=0)
        return value, tl.max(tl.where(top_value == value, top_id, -1), axis=0)

    @triton.jit
    def _beats(x, cols, value, token):
        """Whether (x, cols) come before (value, token) in the top-k order: larger first, then the lower id."""
        return (x > value) | ((x == value) & (cols < token))

    # One program per row, over tiles of BLOCK tokens:
    #   m = max x, s = sum exp(x - m) (rescaled by exp(m_old - m_new) as m grows), lse = m + log s;
    #   greater = #{x > x_target};
    #   with HAS_TOP, a running top top_k (TOP slots, those past top_k never replaced): while the tile holds a
    #   token that beats the weakest kept one, the tile's best (largest, lowest id) replaces it. The kept entries
    #   are written out best first at the end.
    @triton.jit(do_not_specialize=["top_k"])
    def _token_logprobs_kernel(logits_ptr, targets_ptr, logprob_ptr, rank_ptr, lse_ptr, top_ids_ptr,
                               top_logprobs_ptr, vocab, stride_logits, top_k,
                               HAS_TOP: tl.constexpr, TOP: tl.constexpr, BLOCK: tl.constexpr):
        LOG2E: tl.constexpr = 1.4426950408889634
        NO_TOKEN: tl.constexpr = 2147483647
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_logits
        target = tl.load(targets_ptr + row)
        x_target = tl.load(base + target).to(tl.float32)
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.zeros([], tl.float32)
        greater = tl.zeros([], tl.int32)
        slots = tl.arange(0, TOP)
        # Empty slots hold (-inf, distinct ids above any token), so that any token beats them; slots past top_k hold
        # (+inf, -1), which nothing beats.
        top_value = tl.where(slots < top_k, float("-inf"), float("inf"))
        top_id = tl.where(slots < top_k, NO_TOKEN - slots, -1)
        weak_value, weak_id = _weakest(top_value, top_id)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < vocab
            x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
            greater += tl.sum((x > x_target).to(tl.int32), axis=0)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # (a row all -inf so far: no inf - inf)
            s = s * tl.exp2((m - shift) * LOG2E) + tl.sum(tl.exp2((x - shift) * LOG2E), axis=0)
            m = m_new
            if HAS_TOP:
                better = inside & _beats(x, cols, weak_value, weak_id)
                while tl.max(better.to(tl.int32), axis=0) > 0:
                    best = tl.max(tl.where(better, x, float("-inf")), axis=0)
                    best_id = tl.min(tl.where(better & (x == best), cols, NO_TOKEN), axis=0)
                    replace = (top_value == weak_value) & (top_id == weak_id)
                    top_value = tl.where(replace, best, top_value)
                    top_id = tl.where(replace, best_id, top_id)
                    weak_value, weak_id = _weakest(top_value, top_id)
                    better = better & (cols != best_id) & _beats(x, cols, weak_value, weak_id)
        lse = m + tl.log(s)
        tl.store(logprob_ptr + row, x_target - lse)
        tl.store(rank_ptr + row, greater + 1)
        tl.store(lse_ptr + row, lse)
        if HAS_TOP:
            taken = slots >= top_k
            for j in range(0, top_k):
                value = tl.max(tl.where(taken, float("-inf"), top_value), axis=0)
                token = tl.min(tl.where(~taken & (top_value == value), top_id, NO_TOKEN), axis=0)
                taken = taken | (top_id == token)
                tl.store(top_ids_ptr + row * top_k + j, token.to(tl.int64))
                tl.store(top_logprobs_ptr + row * top_k + j, value - lse)


def token_logprobs_triton(logits: torch.Tensor, targets: torch.Tensor, top_k: int) -> TokenLogprobs:
    """The same as token_logprobs_ref, reading the logits once in their own dtype."""
    assert logits.stride(1) == 1, "the logits' rows must be contiguous"
    num_rows, vocab = logits.shape
    device = logits.device
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=device)
    ranks = torch.empty(num_rows, dtype=torch.int32, device=device)
    lse = torch.empty(num_rows, dtype=torch.float32, device=device)
    top_ids = torch.empty(num_rows, top_k, dtype=torch.int64, device=device)
    top_logprobs = torch.empty(num_rows, top_k, dtype=torch.float32, device=device)
    if num_rows:
        block = min(2048, triton.next_power_of_2(vocab))
        _token_logprobs_kernel[(num_rows,)](logits, targets, logprobs, ranks, lse, top_ids, top_logprobs, vocab,
                                            logits.stride(0), top_k, HAS_TOP=top_k > 0,
                                            TOP=max(2, triton.next_power_of_2(top_k)), BLOCK=block, num_warps=8)
    return logprobs, ranks, lse, top_ids, top_logprobs
