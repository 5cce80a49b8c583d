"""The first op of a decode CUDA graph: it completes the step's inputs on the device, so that the host copies
them in once, in the layout it packed them, and the graph does the rest (worker/cuda_graphs.py).

Two things are left for it. An input token that the step before sampled and the host has not read back yet
(async scheduling) is taken from that step's tokens. And the block tables, packed by the host as [B, width]
(width: the step's longest table, so that the copy is no larger than the batch needs), go to the graph's
[B, max_blocks] buffer, whose row stride the attention kernels were captured with. Both the width and the
places of the tokens in flight are read from device memory, so one graph replays for any of them."""

from __future__ import annotations

import torch

from tinyvllm.ops.pdl import pdl_options, pdl_wait
from tinyvllm.ops.triton_import import tl, triton


def unpack_decode_inputs_ref(input_ids: torch.Tensor, pending: torch.Tensor, tokens: torch.Tensor,
                             packed_tables: torch.Tensor, width: torch.Tensor, block_tables: torch.Tensor) -> None:
    """In place, for the B = input_ids.shape[0] sequences of a decode step:
    input_ids[i] = tokens[pending[i]] where pending[i] >= 0 (else kept), and
    block_tables[i, :w] = packed_tables[i * w:(i + 1) * w] with w = width[0] (block_tables' other entries kept).
    pending [B] int64, tokens [N] int64, packed_tables [>= B * w] int32, width [1] int32, block_tables [B, M]."""
    num_rows, max_blocks = block_tables.shape
    input_ids.copy_(torch.where(pending >= 0, tokens[pending.clamp(min=0)], input_ids))
    cols = torch.arange(max_blocks, device=block_tables.device)
    index = torch.arange(num_rows, device=block_tables.device)[:, None] * width.long() + cols
    values = packed_tables[index.clamp(max=packed_tables.numel() - 1)]
    block_tables.copy_(torch.where(cols < width.long(), values, block_tables))


if triton is not None:

    # One program per sequence: its input token, then its packed table row, BLOCK entries at a time.
    @triton.jit
    def _unpack_decode_inputs_kernel(
        input_ids_ptr, pending_ptr, tokens_ptr, packed_ptr, width_ptr, tables_ptr, stride_table,
        BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        row = tl.program_id(0)
        source = tl.load(pending_ptr + row)
        if source >= 0:
            tl.store(input_ids_ptr + row, tl.load(tokens_ptr + source))
        width = tl.load(width_ptr)
        packed_row = packed_ptr + row.to(tl.int64) * width
        table_row = tables_ptr + row.to(tl.int64) * stride_table
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < width
            tl.store(table_row + cols, tl.load(packed_row + cols, mask=mask), mask=mask)


def unpack_decode_inputs_triton(input_ids: torch.Tensor, pending: torch.Tensor, tokens: torch.Tensor,
                                packed_tables: torch.Tensor, width: torch.Tensor, block_tables: torch.Tensor) -> None:
    """The Triton kernel of unpack_decode_inputs_ref: one launch for both parts."""
    num_rows, max_blocks = block_tables.shape
    assert block_tables.stride(1) == 1 and pending.shape[0] == input_ids.shape[0] == num_rows
    if num_rows:
        _unpack_decode_inputs_kernel[(num_rows,)](
            input_ids, pending, tokens, packed_tables, width, block_tables, block_tables.stride(0),
            BLOCK=min(triton.next_power_of_2(max_blocks), 256), num_warps=1, **pdl_options(input_ids))
