"""Decode attention in equal shares of the step's KV tiles (stream-K), for large batches.

The plain decode kernel (attention.py) runs a program per (sequence, KV head): at 256 sequences that is 2,048
programs in about three waves, each program paying its start (the chain of loads from the batch's layout to its
first K tile) and the last wave leaving most of the GPU idle. Here a fixed grid of programs, as many as the GPU
holds at once, cuts the step's T = sum_i cdiv(context_i, BLOCK_N) tiles per KV head into equal shares: program p
walks tiles [p*T // P, (p+1)*T // P) (P = T if there are fewer tiles) in one pipelined loop, across sequence
boundaries, restarting its online softmax at each new sequence. A sequence cut between programs leaves each
piece's output and log2-sum-exp in a partial slot; the program that finishes its last piece (an atomic count per
sequence and KV head) merges them, as the combine kernel of flash-decoding would, so there is no second launch:

    out = sum_j w_j * out_j / sum_j w_j,   w_j = exp2(lse_j - max_j lse_j)

The tiles' layout (which sequence holds tile t) is planned once per step on the device (_plan_kernel, from the
context lengths), and the 16 layers share it: it is kept on the step's AttentionMetadata (decode_plan). Figures:
benchmarks/RESULTS.md."""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU engine uses the references on machines without Triton
    triton = None

from tinyvllm.ops.attention import (
    _LOG2E,
    AttentionMetadata,
    DecodeConfig,
    _check_shapes,
    decode_config,
    decode_rows,
    paged_attention_triton,
)
from tinyvllm.ops.pdl import pdl_options, pdl_wait

# Resident programs per SM that the grid is sized for (the float8 128-key tile fits 5 on an H100: 108 registers
# and 3 stages of its K and V tiles in shared memory).
BALANCED_PROGRAMS_PER_SM = 5
# Below this many (sequence, KV head) pairs the plain kernel's splits already spread a step over the GPU in one
# wave, and its first tile is prefetched under the kernel before: balanced decoding is for large batches.
BALANCED_MIN_PROGRAMS = 512
# Off until a GPU has timed it against the plain kernel (bench_kernels.py --balanced, throughput.py): with
# TINYVLLM_BALANCED_DECODE=1 the engine's large decode steps take it.
_ON = os.environ.get("TINYVLLM_BALANCED_DECODE", "0") == "1"


class DecodePlan(NamedTuple):
    """A decode step's tiles, shared by its layers. cu_tiles [B + 1] int32: sequence i's tiles are cu_tiles[i] ..
    cu_tiles[i+1] - 1 of the step's (cu_tiles[B] in all); tile_seq [max_tiles] int32: the sequence of each tile;
    counters [B * Hkv] int32: pieces finished per (sequence, KV head), zero between launches (the merging program
    resets its own); partial_out [(B + P) * Hq, D] and partial_lse [(B + P) * Hq] float32: a cut sequence's pieces,
    piece (i, p) in slot i + p."""

    cu_tiles: torch.Tensor
    tile_seq: torch.Tensor
    counters: torch.Tensor
    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    block_n: int
    programs: int


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def balanced_programs(device: torch.device, num_kv_heads: int) -> int:
    """P, the programs per KV head: the grid the GPU holds at once (a few on the CPU, where the interpreter runs
    the kernels in tests)."""
    if device.type != "cuda":
        return 3
    return max(1, _multiprocessors(device.index or 0) * BALANCED_PROGRAMS_PER_SM // num_kv_heads)


def balanced_batch(num_seqs: int, num_kv_heads: int) -> bool:
    """Whether a decode step of num_seqs sequences is large enough for the balanced kernel."""
    return num_seqs * num_kv_heads >= BALANCED_MIN_PROGRAMS


def paged_attention_balanced(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """attention.paged_attention_triton, with the decode steps of large batches in equal shares of their tiles
    (TINYVLLM_BALANCED_DECODE=1)."""
    if _ON and meta.is_decode and balanced_batch(meta.num_seqs, k_cache.shape[2]):
        return balanced_decode_triton(q, k_cache, v_cache, meta, scale, out=out)
    return paged_attention_triton(q, k_cache, v_cache, meta, scale, out=out)


if triton is not None:

    from tinyvllm.ops.attention import _attend_tile, _merge_slots, _query_for

    # One program: cu_tiles, then tile_seq, BLOCK_B sequences at a time (a running offset carries the sum).
    @triton.jit
    def _plan_kernel(cu_tiles_ptr, tile_seq_ptr, cu_query_lens_ptr, context_lens_ptr, num_seqs, max_tiles,
                     BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
        pdl_wait(USE_PDL)
        tl.store(cu_tiles_ptr, 0)
        offset = tl.full([], 0, dtype=tl.int32)
        for start in range(0, num_seqs, BLOCK_B):
            seqs = start + tl.arange(0, BLOCK_B)
            ok = seqs < num_seqs
            context_len = tl.load(context_lens_ptr + seqs, mask=ok, other=0)
            query_len = (tl.load(cu_query_lens_ptr + seqs + 1, mask=ok, other=0)
                         - tl.load(cu_query_lens_ptr + seqs, mask=ok, other=0))
            tiles = tl.where(ok & (query_len > 0) & (context_len > 0), tl.cdiv(context_len, BLOCK_N), 0)
            ends = offset + tl.cumsum(tiles, axis=0)
            tl.store(cu_tiles_ptr + 1 + seqs, ends, mask=ok)
            firsts = ends - tiles
            for j in range(0, tl.max(tiles, axis=0)):  # each sequence's j-th tile, for all at once
                tl.store(tile_seq_ptr + firsts + j, seqs, mask=(j < tiles) & (firsts + j < max_tiles))
            offset += tl.sum(tiles, axis=0)

    # Program (p, KV head): tiles lo .. hi - 1 of the step's, lo = p*T // P. See the module's docstring.
    @triton.jit
    def _balanced_decode_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_query_lens_ptr, context_lens_ptr,
        cu_tiles_ptr, tile_seq_ptr, counters_ptr, partial_out_ptr, partial_lse_ptr, num_seqs,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_table, qk_scale, num_q_heads,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        pdl_wait(USE_PDL)  # (the plan may be the kernel just before: nothing is read ahead of the wait)
        p, kv_head = tl.program_id(0), tl.program_id(1)
        num_programs, num_kv_heads = tl.num_programs(0), tl.num_programs(1)
        rows = tl.arange(0, BLOCK_G)
        head = kv_head * GROUP + rows
        row_valid = rows < GROUP
        offs_d = tl.arange(0, HEAD_DIM)
        # Rows with a token but no keys (a CUDA graph's padding rows, context 0) get zeros, as in the reference:
        # program p takes rows p, p + P, ..., ZERO_ROWS of them at a time in one [ZERO_ROWS * BLOCK_G, HEAD_DIM] tile.
        ZERO_ROWS: tl.constexpr = 4
        cells = tl.arange(0, ZERO_ROWS * BLOCK_G)
        cell_row, cell_head = cells // BLOCK_G, cells % BLOCK_G
        for base in range(p, num_seqs, ZERO_ROWS * num_programs):
            seqs = base + cell_row * num_programs
            ok = seqs < num_seqs
            token = tl.load(cu_query_lens_ptr + seqs, mask=ok, other=0)
            empty = (ok & (tl.load(cu_query_lens_ptr + seqs + 1, mask=ok, other=0) > token)
                     & (tl.load(cu_tiles_ptr + seqs + 1, mask=ok, other=0) == tl.load(cu_tiles_ptr + seqs, mask=ok,
                                                                                      other=0)))
            tl.store(out_ptr + token.to(tl.int64)[:, None] * stride_ot
                     + (kv_head * GROUP + cell_head)[:, None] * stride_oh + offs_d[None, :],
                     tl.zeros([ZERO_ROWS * BLOCK_G, HEAD_DIM], dtype=out_ptr.dtype.element_ty),
                     mask=(empty & (cell_head < GROUP))[:, None])

        # With fewer tiles than programs only the first T programs take one each: every program with tiles holds
        # at least one, so a sequence's pieces are programs p_first .. p_last, all of them (_finish_cut).
        total = tl.load(cu_tiles_ptr + num_seqs)
        num_programs = tl.maximum(tl.minimum(num_programs, total), 1)
        lo = tl.minimum(p * total // num_programs, total)
        hi = tl.minimum((p + 1) * total // num_programs, total)
        k_base = k_cache_ptr + kv_head * stride_kh
        v_base = v_cache_ptr + kv_head * stride_vh
        m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
        for t in range(lo, hi):
            seq = tl.load(tile_seq_ptr + t)
            first = tl.load(cu_tiles_ptr + seq)
            end = tl.load(cu_tiles_ptr + seq + 1)
            context_len = tl.load(context_lens_ptr + seq)
            token = tl.load(cu_query_lens_ptr + seq).to(tl.int64)
            q = tl.load(q_ptr + token * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                        mask=row_valid[:, None], other=0.0)
            q = _query_for(q, k_cache_ptr)
            fresh = (t == lo) | (t == first)  # a new sequence (or piece of one): the softmax starts over
            m_i = tl.where(fresh, -1.0e30, m_i)
            l_i = tl.where(fresh, 0.0, l_i)
            acc = tl.where(fresh, 0.0, acc)
            table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, m_i, (t - first) * BLOCK_N, context_len, table_ptr, k_base, v_base,
                stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                BLOCK_N, BLOCK_SIZE, HEAD_DIM, CAUSAL=False, BOUNDED=True,
            )
            if (t == hi - 1) | (t == end - 1):  # this program's piece of the sequence ends here
                out = acc / l_i[:, None]
                if (first >= lo) & (end <= hi):  # the whole sequence: the output
                    tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
                else:  # a piece: its slot, seq + p
                    slot = (seq + p).to(tl.int64) * num_q_heads + head
                    tl.store(partial_out_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_valid[:, None])
                    tl.store(partial_lse_ptr + slot, m_i + tl.log2(l_i), mask=row_valid)
        # Only the first and the last sequence of a share can be cut. Counted after the loop, whose pipelining a
        # barrier inside would undo: every thread's stores, then one release per piece, so that the program that
        # counts a sequence's last piece sees all of them.
        if hi > lo:
            tl.debug_barrier()
            first_seq = tl.load(tile_seq_ptr + lo)
            last_seq = tl.load(tile_seq_ptr + hi - 1)
            _finish_cut(first_seq, p, lo, hi, total, num_programs, out_ptr, cu_query_lens_ptr, cu_tiles_ptr,
                        counters_ptr + first_seq * num_kv_heads + kv_head, partial_out_ptr, partial_lse_ptr,
                        stride_ot, stride_oh, head, row_valid, num_q_heads, HEAD_DIM)
            if last_seq != first_seq:
                _finish_cut(last_seq, p, lo, hi, total, num_programs, out_ptr, cu_query_lens_ptr, cu_tiles_ptr,
                            counters_ptr + last_seq * num_kv_heads + kv_head, partial_out_ptr, partial_lse_ptr,
                            stride_ot, stride_oh, head, row_valid, num_q_heads, HEAD_DIM)

    @triton.jit
    def _finish_cut(seq, p, lo, hi, total, num_programs, out_ptr, cu_query_lens_ptr, cu_tiles_ptr, counter,
                    partial_out_ptr, partial_lse_ptr, stride_ot, stride_oh, head, row_valid, num_q_heads,
                    HEAD_DIM: tl.constexpr):
        """If program p's share [lo, hi) cuts sequence seq: count its piece, and if it is the last of the sequence's
        pieces to finish, merge them all (slots seq + p_first .. seq + p_last, read from L2) into the output. The
        pieces are programs p_first .. p_last, those whose shares hold the sequence's first and last tiles
        (lo(p) = p*T // P <= tile)."""
        first = tl.load(cu_tiles_ptr + seq)
        end = tl.load(cu_tiles_ptr + seq + 1)
        if (first < lo) | (end > hi):
            p_first = ((first + 1) * num_programs - 1) // total
            p_last = (end * num_programs - 1) // total
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == p_last - p_first:
                tl.debug_barrier()
                acc, weights, _ = _merge_slots(partial_out_ptr, partial_lse_ptr,
                                               (seq + p_first).to(tl.int64) * num_q_heads + head, num_q_heads,
                                               p_last - p_first + 1, tl.full(head.shape, float("-inf"), tl.float32),
                                               row_valid, HEAD_DIM)
                offs_d = tl.arange(0, HEAD_DIM)
                token = tl.load(cu_query_lens_ptr + seq).to(tl.int64)
                tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                         (acc / weights[:, None]).to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next layer's launch


def plan_balanced_decode(meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int,
                         block_size: int, block_n: int, programs: int) -> DecodePlan:
    """The step's DecodePlan (one small launch), for blocks of block_size tokens."""
    num_seqs = meta.num_seqs
    device = meta.context_lens.device
    # (a sequence's context fits its row of the block table; not the pool: prefix caching shares blocks)
    max_tiles = num_seqs * triton.cdiv(meta.block_tables.shape[1] * block_size, block_n)
    plan = DecodePlan(
        cu_tiles=torch.empty(num_seqs + 1, dtype=torch.int32, device=device),
        tile_seq=torch.empty(max(max_tiles, 1), dtype=torch.int32, device=device),
        counters=torch.zeros(num_seqs * num_kv_heads, dtype=torch.int32, device=device),
        partial_out=torch.empty((num_seqs + programs) * num_q_heads, head_dim, dtype=torch.float32, device=device),
        partial_lse=torch.empty((num_seqs + programs) * num_q_heads, dtype=torch.float32, device=device),
        block_n=block_n, programs=programs,
    )
    _plan_kernel[(1,)](plan.cu_tiles, plan.tile_seq, meta.cu_query_lens, meta.context_lens, num_seqs, max_tiles,
                       BLOCK_B=min(triton.next_power_of_2(max(num_seqs, 1)), 1024), BLOCK_N=block_n, num_warps=4,
                       **pdl_options(plan.cu_tiles))
    return plan


def balanced_decode_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    out: torch.Tensor | None = None, programs: int | None = None, config: DecodeConfig | None = None,
) -> torch.Tensor:
    """paged_attention_ref for a decode step (query lengths 0 or 1), in equal shares of its tiles. The step's
    plan is made at the first layer's call and kept on meta.decode_plan for the others; `programs` and `config`
    override P and the tile (tests cut sequences at many places on tiny inputs)."""
    group = _check_shapes(q, k_cache, v_cache)
    num_seqs, num_q_heads, num_kv_heads, head_dim = meta.num_seqs, q.shape[1], k_cache.shape[2], q.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    block_n, num_warps, num_stages = config or decode_config(head_dim, q.dtype, k_cache.dtype,
                                                             num_seqs * num_kv_heads)
    programs = programs or balanced_programs(q.device, num_kv_heads)
    plan = meta.decode_plan
    if plan is None or plan.block_n != block_n or plan.programs != programs:
        plan = meta.decode_plan = plan_balanced_decode(meta, num_q_heads, num_kv_heads, head_dim, k_cache.shape[1],
                                                       block_n, programs)
    _balanced_decode_kernel[(programs, num_kv_heads)](
        out, q, k_cache, v_cache, meta.block_tables, meta.cu_query_lens, meta.context_lens,
        plan.cu_tiles, plan.tile_seq, plan.counters, plan.partial_out, plan.partial_lse, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), meta.block_tables.stride(0), scale * _LOG2E, num_q_heads,
        GROUP=group, BLOCK_G=decode_rows(group, k_cache.dtype), BLOCK_N=block_n, BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim, num_warps=num_warps, num_stages=num_stages, **pdl_options(q),
    )
    return out
