"""Cascade attention for decode steps: when many sequences of a batch start with the same KV blocks (the prefix
cache gives them the same block ids), attention over that shared prefix is computed once per KV head for all
their queries, so the prefix's K/V are read from memory once per step instead of once per sequence (as vLLM and
FlashInfer do it). The plain decode kernel then attends each sequence to its own suffix only, and the two
partial results are merged by their log-sum-exp:

    out = (w_p * out_p + w_s * out_s) / (w_p + w_s),   w = exp2(lse - max(lse_p, lse_s))

Launches with grids from Python ints and the prefix length read on the device, so that one CUDA graph per batch
size serves every prefix:
1. the prefix pass (_cascade_prefix_kernel): program (KV head, row tile, prefix split) attends a tile of
   (sequence, query head) rows, all the sequences' GROUP heads of that KV head, to one piece of the prefix
   through the first sequence's block table (the blocks are the same for all);
2. the suffix pass: attention.py's decode kernel with SKIP_PREFIX, keys from the prefix's end;
3. the decode combine kernel with CASCADE, which merges the prefix's pieces and the suffix's alike. When each
   suffix is one piece (large batches: the case cascade attention is for), the suffix pass merges the prefix's
   pieces itself (MERGE_PREFIX) and this launch, with its round trip of the suffix's partials, is left out.

Logit soft-capping (Gemma 2) applies in both passes. A sliding window does not: the prefix pass lets every query
see the whole shared prefix, which is right only where no context outgrows the window (window_allows_cascade);
ops.paged_attention takes the plain path otherwise."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from tinyvllm.ops.attention import (
    _DECODE_MAX_SPLITS,
    _DECODE_MIN_PARTITION,
    _LOG2E,
    AttentionMetadata,
    DecodeConfig,
    _check_shapes,
    attend_blocks_ref,
    cap_logits,
    decode_config,
    decode_num_splits,
    softcap_switch,
)
from tinyvllm.ops.triton_import import tl, triton

# When cascade attention pays (to tune on the GPU: benchmarks/bench_cascade.py, shared_prefix.py
# --cascade-off): a prefix shorter than this many tokens costs the plain kernel little to read per sequence, and
# below this many sequences the prefix pass's extra launch and partial results outweigh the reads it saves.
CASCADE_MIN_PREFIX_TOKENS = 256
CASCADE_MIN_SEQS = 32  # (the smallest batch where cascade attention pays, as measured)


def use_cascade_attention(common_prefix_len: int, num_seqs: int) -> bool:
    """Whether a decode step of num_seqs sequences sharing common_prefix_len tokens (whole blocks) should
    read the prefix once (cascade attention) rather than once per sequence."""
    return common_prefix_len >= CASCADE_MIN_PREFIX_TOKENS and num_seqs >= CASCADE_MIN_SEQS


def window_allows_cascade(max_context_len: int, sliding_window: int | None) -> bool:
    """Whether cascade attention computes a decode step of a layer with this sliding window right: its prefix pass
    lets every query see all of the shared prefix, so only without a window or where no context (max_context_len,
    an upper bound) is longer than the window, which then hides nothing."""
    return sliding_window is None or max_context_len <= sliding_window


def common_prefix_len(block_tables: np.ndarray, context_lens: np.ndarray, block_size: int) -> int:
    """Tokens at the start of every sequence held in the same blocks (equal leading block ids in every row),
    counting only blocks that every sequence holds entirely before its newest token: that token's K/V are
    written this step, and each sequence keeps at least it for the suffix pass. block_tables [B, W] and
    context_lens [B] (tokens after this step, the newest included) of a decode step."""
    if block_tables.shape[0] == 0:
        return 0
    limit = min(int(context_lens.min() - 1) // block_size, block_tables.shape[1])
    if limit <= 0 or not (block_tables[:, 0] == block_tables[0, 0]).all():  # (the common case, cheaply)
        return 0
    same = (block_tables[:, :limit] == block_tables[0, :limit]).all(axis=0)
    return block_size * (limit if same.all() else int(same.argmin()))


# -------------------------------------------------------------------------------------------------- references


def _token_seqs(meta: AttentionMetadata) -> torch.Tensor:
    """The sequence of each token of a decode batch (query lengths 0 or 1)."""
    query_lens = (meta.cu_query_lens[1:] - meta.cu_query_lens[:-1]).long()
    return torch.repeat_interleave(torch.arange(meta.num_seqs, device=query_lens.device), query_lens)


def cascade_prefix_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, prefix_len: int,
    scale: float, logit_softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's query against the first prefix_len keys of block_table: out [T, Hq, D] float32 and its
    log2-sum-exp [T, Hq] (-inf without keys), as the prefix pass gives them."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if prefix_len == 0:
        return (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
                torch.full((num_tokens, num_q_heads), float("-inf"), device=q.device))
    blocks = block_table[: prefix_len // k_cache.shape[1]].long()
    k = k_cache[blocks].reshape(prefix_len, num_kv_heads, head_dim).float()
    v = v_cache[blocks].reshape(prefix_len, num_kv_heads, head_dim).float()
    query = q.float().view(num_tokens, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = cap_logits(torch.einsum("thgd,lhd->thgl", query, k) * scale, logit_softcap)
    out = torch.einsum("thgl,lhd->thgd", scores.softmax(-1), v)
    lse = torch.logsumexp(scores, -1) * _LOG2E
    return out.reshape(q.shape), lse.reshape(num_tokens, num_q_heads)


def cascade_suffix_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, prefix_len: int,
    scale: float, logit_softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token of a decode batch against its own sequence's keys prefix_len .. context_len - 1 (prefix_len
    a multiple of the block size): out [T, Hq, D] float32 and log2-sum-exp [T, Hq] (-inf without keys)."""
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    seqs = _token_seqs(meta)
    first = prefix_len // block_size
    num_blocks = min((meta.max_context_len + block_size - 1) // block_size, meta.block_tables.shape[1])
    query = q.float().view(num_tokens, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    out, lse = attend_blocks_ref(query, k_cache, v_cache, meta.block_tables[seqs, first:max(num_blocks, first)].long(),
                                 prefix_len, meta.context_lens[seqs], scale, with_lse=True,
                                 logit_softcap=logit_softcap)
    return out.reshape(q.shape), lse.reshape(num_tokens, num_q_heads)


def merge_attention_ref(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Attention over two disjoint sets of keys from each one's result and log2-sum-exp: their softmax weights,
    renormalized. Rows without keys on either side are zeros."""
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weight_a, weight_b = torch.exp2(lse_a - top), torch.exp2(lse_b - top)
    total = weight_a + weight_b
    merged = (out_a * weight_a[..., None] + out_b * weight_b[..., None]) / total.clamp_min(1e-30)[..., None]
    return torch.where((total > 0)[..., None], merged, torch.zeros_like(merged))


def cascade_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    out: torch.Tensor | None = None, *, logit_softcap: float | None = None,
) -> torch.Tensor:
    """paged_attention_ref computed as cascade attention computes it, for a decode step with meta.common_prefix_len
    set (ops.paged_attention sends only those here): the shared prefix (block_tables[0]'s first common_prefix_len
    tokens) for all tokens at once, each sequence's suffix, and the merge."""
    prefix_len = int(meta.common_prefix_len[0])
    if prefix_len % k_cache.shape[1]:
        raise ValueError(f"common_prefix_len={prefix_len} is not a whole number of {k_cache.shape[1]}-token blocks")
    prefix = cascade_prefix_ref(q, k_cache, v_cache, meta.block_tables[0], prefix_len, scale, logit_softcap)
    suffix = cascade_suffix_ref(q, k_cache, v_cache, meta, prefix_len, scale, logit_softcap)
    merged = merge_attention_ref(*prefix, *suffix)
    has_keys = meta.context_lens[_token_seqs(meta)] > 0  # a padding row (context 0) attends to nothing: zeros
    result = torch.where(has_keys[:, None, None], merged, torch.zeros_like(merged)).to(q.dtype)
    return result if out is None else out.copy_(result)


# ---------------------------------------------------------------------------------------------- Triton kernels

if triton is not None:
    from tinyvllm.ops.attention import _attend_keys, _split_partition, _store_partial, launch_combine, launch_decode
    from tinyvllm.ops.pdl import pdl_options, pdl_wait

    # The prefix pass: program (kv head, row tile, split). Row r of the tile is sequence r // GROUP's query
    # head kv_head * GROUP + r % GROUP; the tile attends to prefix keys split * partition .. min((split + 1) *
    # partition, prefix_len), cut as _split_partition cuts a context, through block_tables[0], and writes the
    # partial result and its log2-sum-exp to slot `split` of the row's num_slots. Rows of sequences without a
    # token this step write nothing; a CUDA graph's padding rows (context 0) compute, and the combine kernel (or
    # the merging suffix pass) writes their zeros. SOFTCAP (0.0: none): attention.softcap_switch.
    @triton.jit(do_not_specialize=["num_rows", "num_prefix_splits", "num_slots"])
    def _cascade_prefix_kernel(
        partial_out_ptr, partial_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_query_lens_ptr,
        prefix_len_ptr, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        qk_scale, num_rows, num_q_heads, num_prefix_splits, num_slots, min_partition,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr, SOFTCAP: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        kv_head, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        prefix_len = tl.load(prefix_len_ptr)
        partition = _split_partition(prefix_len, num_prefix_splits, min_partition, BLOCK_N)
        start = split * partition
        if start >= prefix_len:
            return
        end = tl.minimum(start + partition, prefix_len)

        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        seq = rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        in_batch = rows < num_rows
        token = tl.load(cu_query_lens_ptr + seq, mask=in_batch, other=0)
        query_len = tl.load(cu_query_lens_ptr + seq + 1, mask=in_batch, other=0) - token
        row_valid = in_batch & (query_len > 0)
        token = token.to(tl.int64)
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_valid[:, None], other=0.0)
        out, lse = _attend_keys(q, start, end, block_tables_ptr, k_cache_ptr + kv_head * stride_kh,
                                v_cache_ptr + kv_head * stride_vh, stride_kb, stride_ks, stride_vb, stride_vs,
                                qk_scale, BLOCK_M, BLOCK_N, BLOCK_SIZE, HEAD_DIM, SOFTCAP)
        part = (seq * num_q_heads + head).to(tl.int64) * num_slots + split
        _store_partial(partial_out_ptr, partial_lse_ptr, part, out, lse, row_valid, HEAD_DIM)


# (BLOCK_M, num_warps, num_stages) of the prefix pass; its BLOCK_N is the decode tile's, so that the combine
# kernel cuts the prefix into the same pieces as the prefix pass did.
PrefixConfig = tuple[int, int, int]

# The prefix pass aims at this many programs (KV heads x row tiles x prefix splits), in at least
# _CASCADE_MIN_PREFIX_SPLITS splits: enough to spread a prefix over the GPU, while each split adds a partial result
# per (sequence, head) row to write and merge. The GPU sweep of the cascade benchmark tunes these (figures in
# benchmarks/RESULTS.md).
_CASCADE_TARGET_PROGRAMS = 128
_CASCADE_MIN_PREFIX_SPLITS = 2
_CASCADE_MAX_PREFIX_SPLITS = 16


def cascade_prefix_config(dtype: torch.dtype) -> PrefixConfig:
    """The prefix tile: 64 (sequence, head) rows per tile (one warpgroup's wgmma) for half types; small tiles
    for exact float32 products (no tensor cores). One tile whatever the batch, so that an eager step and a
    CUDA graph of a larger size round each row alike."""
    if dtype == torch.float32:
        return 32, 4, 1
    return 64, 4, 2


class CascadePlan(NamedTuple):
    """A cascade launch's Python ints (fixed per batch size and max_context_len, as a CUDA graph needs)."""

    num_prefix_splits: int
    num_splits: int  # of each sequence's suffix
    min_partition: int
    decode_config: DecodeConfig
    prefix_config: PrefixConfig


def cascade_plan(
    q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, num_prefix_splits: int | None = None,
    num_splits: int | None = None, config: DecodeConfig | None = None, prefix_config: PrefixConfig | None = None,
) -> CascadePlan:
    """The splits and tiles of a cascade step. Forcing a split count lets pieces be as short as one BLOCK_N
    tile (tests cut tiny prefixes and suffixes into several), as paged_decode_triton's num_splits does."""
    num_seqs, num_q_heads, num_kv_heads = meta.num_seqs, q.shape[1], k_cache.shape[2]
    decode = config or decode_config(q.shape[2], q.dtype)
    prefix = prefix_config or cascade_prefix_config(q.dtype)
    forced = num_prefix_splits is not None or num_splits is not None
    if num_prefix_splits is None:
        tiles = triton.cdiv(num_seqs * (num_q_heads // num_kv_heads), prefix[0])
        wanted = triton.cdiv(_CASCADE_TARGET_PROGRAMS, num_kv_heads * tiles)
        num_prefix_splits = max(_CASCADE_MIN_PREFIX_SPLITS, min(_CASCADE_MAX_PREFIX_SPLITS, wanted))
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, meta.max_context_len)
        num_splits = max(1, min(num_splits, _DECODE_MAX_SPLITS - num_prefix_splits))
    return CascadePlan(num_prefix_splits, num_splits, decode[0] if forced else _DECODE_MIN_PARTITION, decode,
                       prefix)


def cascade_prefix_pass(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    plan: CascadePlan, logit_softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1: partial results [B, Hq, P + S, D] float32 and their log2-sum-exp [B, Hq, P + S], of which it fills
    slots 0 .. P-1 with the prefix's pieces (pieces without keys are not written)."""
    num_seqs, num_q_heads, head_dim = meta.num_seqs, q.shape[1], q.shape[2]
    num_kv_heads, group = k_cache.shape[2], q.shape[1] // k_cache.shape[2]
    num_slots = plan.num_prefix_splits + plan.num_splits
    partial_out = torch.empty((num_seqs, num_q_heads, num_slots, head_dim), dtype=torch.float32, device=q.device)
    partial_lse = torch.empty((num_seqs, num_q_heads, num_slots), dtype=torch.float32, device=q.device)
    block_m, num_warps, num_stages = plan.prefix_config
    prefix_len = meta.common_prefix_len
    grid = (num_kv_heads, triton.cdiv(num_seqs * group, block_m), plan.num_prefix_splits)
    _cascade_prefix_kernel[grid](
        partial_out, partial_lse, q, k_cache, v_cache, meta.block_tables, meta.cu_query_lens, prefix_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), scale * _LOG2E,
        num_seqs * group, num_q_heads, plan.num_prefix_splits, num_slots, plan.min_partition,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=plan.decode_config[0], BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        SOFTCAP=softcap_switch(logit_softcap), num_warps=num_warps, num_stages=num_stages, **pdl_options(q),
    )
    return partial_out, partial_lse


def cascade_partials_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    plan: CascadePlan, logit_softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Passes 1 and 2 unmerged: the prefix pass's partials with the suffix's in slots P .. P+S-1."""
    partial_out, partial_lse = cascade_prefix_pass(q, k_cache, v_cache, meta, scale, plan, logit_softcap)
    launch_decode(partial_out, partial_out, partial_lse, q, k_cache, v_cache, meta, scale, plan.num_splits,
                  plan.min_partition, plan.decode_config, meta.common_prefix_len, plan.num_prefix_splits,
                  logit_softcap=logit_softcap)
    return partial_out, partial_lse


def cascade_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    plan: CascadePlan | None = None, out: torch.Tensor | None = None, *, logit_softcap: float | None = None,
) -> torch.Tensor:
    """The Triton kernels of cascade_attention_ref (a decode step with meta.common_prefix_len set): the prefix
    pass, the suffix pass and the combine (left out when the suffix pass merges: one suffix piece), no host syncs.
    `plan` overrides cascade_plan."""
    _check_shapes(q, k_cache, v_cache)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if q.shape[0] == 0 or meta.num_seqs == 0:
        return out
    plan = plan or cascade_plan(q, k_cache, meta)
    if plan.num_splits == 1:
        partial_out, partial_lse = cascade_prefix_pass(q, k_cache, v_cache, meta, scale, plan, logit_softcap)
        launch_decode(out, partial_out, partial_lse, q, k_cache, v_cache, meta, scale, 1, plan.min_partition,
                      plan.decode_config, meta.common_prefix_len, plan.num_prefix_splits, merge_prefix=True,
                      logit_softcap=logit_softcap)
        return out
    partial_out, partial_lse = cascade_partials_triton(q, k_cache, v_cache, meta, scale, plan, logit_softcap)
    launch_combine(out, partial_out, partial_lse, meta, plan.num_splits, plan.min_partition, plan.decode_config[0],
                   meta.common_prefix_len, plan.num_prefix_splits)
    return out
