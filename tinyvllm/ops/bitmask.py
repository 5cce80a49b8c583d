"""Structured output's token mask on the logits: logits[rows[r], v] = -inf wherever bit v of bitmask[r] is 0.

The bitmask is xgrammar's layout: int32 words, token v's bit is bit v % 32 of word v // 32 (1: allowed). Only the
constrained rows are listed (`rows`), so the other rows of a batch pay nothing."""

import torch

from tinyvllm.ops.triton_import import tl, triton


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (changed in place and returned), bitmask int32 [R, ceil(V / 32)], rows int64 [R]."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (an arithmetic shift: & 1 keeps the bit all the same)
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits


if triton is not None:

    # One program per (constrained row, BLOCK tokens): each token reads its word and keeps its logit or writes -inf.
    @triton.jit
    def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab, stride_logits, stride_bitmask,
                              BLOCK: tl.constexpr):
        r = tl.program_id(0)
        tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = tokens < vocab
        words = tl.load(bitmask_ptr + r * stride_bitmask + tokens // 32, mask=inside, other=-1)
        blocked = ((words >> (tokens % 32)) & 1) == 0
        row = tl.load(rows_ptr + r).to(tl.int64)
        minus_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
        tl.store(logits_ptr + row * stride_logits + tokens, minus_inf, mask=inside & blocked)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The same as apply_token_bitmask_ref, in place."""
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1, "rows must be contiguous"
    if rows.numel() == 0:
        return logits
    block = 1024
    grid = (rows.shape[0], triton.cdiv(logits.shape[1], block))
    _apply_bitmask_kernel[grid](logits, bitmask, rows, logits.shape[1], logits.stride(0), bitmask.stride(0),
                                BLOCK=block)
    return logits
