"""Attention over the paged KV cache, for prefill chunks and decode tokens alike."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tinyvllm.ops.pdl import pdl_options, pdl_wait, prefetch_l2
from tinyvllm.ops.triton_import import tl, triton


@dataclass
class AttentionMetadata:
    """Where each sequence's new tokens sit in the flat batch and where its KV lives in the cache.

    Sequence i owns new tokens cu_query_lens[i]:cu_query_lens[i+1], at positions
    context_lens[i] - query_len ... context_lens[i] - 1; its keys are in blocks block_tables[i, :]."""

    cu_query_lens: torch.Tensor  # [B + 1] int32 or int64 (the runner stages every index array as int64)
    context_lens: torch.Tensor  # [B], tokens in the cache after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks_per_seq], unused entries are 0
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding tokens
    max_query_len: int
    max_context_len: int
    # What computes attention, if not ops.paged_attention (same signature): the piecewise CUDA graphs
    # (worker/cuda_graphs.py) cut their capture there, since attention's grid depends on the batch.
    attention: Callable[..., torch.Tensor] | None = None
    # Decode steps only: [1] int32 on the device, the first common_prefix_len tokens of every sequence with a
    # token this step are in the same blocks (block_tables[0]'s), whole blocks, all short of the sequence's
    # newest token. Set, ops.paged_attention reads that prefix once for all of them (cascade_attention.py).
    common_prefix_len: torch.Tensor | None = None
    # Mixed steps only: the first num_decodes sequences add one token each (the runner puts them first). The
    # Triton path sends them to the flash-decoding kernel and only the others to the prefill kernel, whose tiles
    # of query rows would hold one GQA group's rows for each of them (benchmarks/RESULTS.md).
    num_decodes: int = 0
    # What the reference ops derive from this step's metadata alone (the K/V store's block and offset of each token,
    # the rotary table's rows of its positions), computed by the first layer and kept for the others: on the CPU
    # each small op costs more than its arithmetic. Keyed by what it holds; a new step has a new, empty one.
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    def first_seqs(self, count: int) -> AttentionMetadata:
        """The metadata of sequences [0, count) alone: cu_query_lens stays absolute (the kernels index q and
        out by it), and max_context_len stays the batch's (an upper bound; it only sizes the decode splits)."""
        return AttentionMetadata(self.cu_query_lens[: count + 1], self.context_lens[:count], self.block_tables[:count],
                                 self.slot_mapping, 1, self.max_context_len)

    def last_seqs(self, start: int) -> AttentionMetadata:
        """The metadata of sequences [start, num_seqs), with absolute cu_query_lens as first_seqs."""
        return AttentionMetadata(self.cu_query_lens[start:], self.context_lens[start:], self.block_tables[start:],
                                 self.slot_mapping, self.max_query_len, self.max_context_len)

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token: the flash-decoding path applies."""
        return self.max_query_len == 1

    @classmethod
    def for_cached(cls, query_lens: list[int], context_lens: list[int],
                   block_tables: torch.Tensor) -> AttentionMetadata:
        """A batch whose K/V are in the cache already, to time or check attention alone (kernel benchmarks and
        tests): slot_mapping is all zeros, as nothing stores K/V."""
        device = block_tables.device
        cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        return cls(cu, torch.tensor(context_lens, dtype=torch.int32, device=device), block_tables,
                   torch.zeros(int(cu[-1]), dtype=torch.int64, device=device), max(query_lens), max(context_lens))


def cap_logits(scores: torch.Tensor, logit_softcap: float | None) -> torch.Tensor:
    """Gemma 2's attention logit soft-capping of scores (after the scale): cap * tanh(scores / cap); None: as they
    are."""
    return scores if logit_softcap is None else logit_softcap * torch.tanh(scores / logit_softcap)


def paged_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    out: torch.Tensor | None = None, *, sliding_window: int | None = None, logit_softcap: float | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] -> out [T, Hq, D]: each new token attends causally to every earlier token of its
    sequence in the cache (its own K/V included, already stored), grouped-query heads sharing KV. `out`: where
    to write it (a new tensor if None). sliding_window: a token at position p sees only keys p - sliding_window + 1
    .. p (Mistral's, Gemma 2's local layers); logit_softcap: scores become cap * tanh(score / cap) before the
    softmax (Gemma 2).

    Sequences go through torch's scaled_dot_product_attention in batches, their queries padded to the longest (the
    CPU engine's path: there each small op costs more than the arithmetic): a decode step in one call; a mixed step's
    one-token sequences in one call and its longer ones in another, or one call each where padding would more than
    double the query rows."""
    if meta.is_decode and q.shape[0] == meta.num_seqs:  # a decode step (a CUDA graph's padding rows included)
        result = _attend_last_rows(q[:, None], k_cache, v_cache, meta.block_tables, meta.context_lens,
                                   meta.max_context_len, scale, sliding_window, logit_softcap)
        result = result[:, 0].nan_to_num(0.0).to(q.dtype)  # context 0: zeros
        return result if out is None else out.copy_(result)
    out = torch.empty_like(q) if out is None else out
    cu, context_lens = meta.cu_query_lens.tolist(), meta.context_lens.tolist()
    query_lens = [end - start for start, end in zip(cu, cu[1:])]
    for kind in ([i for i, n in enumerate(query_lens) if n == 1], [i for i, n in enumerate(query_lens) if n > 1]):
        padded_rows = len(kind) * max((query_lens[i] for i in kind), default=0)
        batches = [kind] if padded_rows <= 2 * sum(query_lens[i] for i in kind) else [[i] for i in kind]
        for seqs in filter(None, batches):
            # row j of a sequence's padded query is its token at position context_len - longest + j, so the real
            # tokens are the last query_len rows; the rows before them repeat its first token (computed, unused)
            longest = max(query_lens[i] for i in seqs)
            rows = [max(cu[i + 1] - longest + j, cu[i]) for i in seqs for j in range(longest)]
            index = torch.tensor(seqs, device=q.device)
            real_rows = (torch.tensor([query_lens[i] for i in seqs], device=q.device)
                         if sliding_window is not None and len(seqs) > 1 else None)
            if rows == list(range(rows[0], rows[0] + len(rows))):  # unpadded, in order: views, no gather
                query, target = q[rows[0]:rows[0] + len(rows)], out[rows[0]:rows[0] + len(rows)]
            else:
                rows = torch.tensor(rows, device=q.device)
                query, target = q.index_select(0, rows), None
            result = _attend_last_rows(query.view(len(seqs), longest, *q.shape[1:]), k_cache, v_cache,
                                       meta.block_tables[index], meta.context_lens[index],
                                       max(context_lens[i] for i in seqs), scale, sliding_window,
                                       logit_softcap, real_rows).flatten(0, 1)
            if target is not None:
                target.copy_(result)
            else:
                real = torch.tensor([j >= longest - query_lens[i] for i in seqs for j in range(longest)],
                                    device=q.device)
                out[rows[real]] = result[real].to(q.dtype)
    return out


def _attend_last_rows(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, max_context_len: int, scale: float, sliding_window: int | None = None,
    logit_softcap: float | None = None, real_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [B, Q, Hq, D], the tokens at positions context_len - Q ... context_len - 1 of each sequence -> their
    attention [B, Q, Hq, D] in float32, in one call of scaled_dot_product_attention over the sequences' padded block
    tables. A position with no key (below 0, or in a sequence of context 0 as a CUDA graph's padding rows) gets NaN or
    zeros: the callers drop or zero it. real_rows [B]: how many of each sequence's last rows are real (the others
    padding, whose output is dropped); None: all Q.

    With a sliding window no key before a real row's window is used, nor read where it can be helped: the engine
    gives blocks that fell out of the window back (BlockManager.remove_skipped_blocks), and another sequence's K/V,
    even NaN, may sit there. One sequence's keys start at its oldest visible one; a batch's blocks start at the
    oldest visible one of any sequence, and each sequence's keys before its own window are zeroed, as those past its
    context."""
    num_seqs, num_rows, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    oldest, first_key = None, 0  # (each sequence's oldest key a real row sees; the first key gathered)
    if sliding_window is not None:
        oldest = context_lens - (num_rows if real_rows is None else real_rows) - sliding_window + 1
        first_key = max(int(oldest.min()), 0)
        if num_seqs > 1:
            first_key -= first_key % block_size
    first_block, skip = divmod(first_key, block_size)  # (skip: keys of the first block before first_key)
    if num_seqs == 1:  # its keys are a slice of its blocks: nothing past its context or before its window to zero
        length = int(context_lens[0]) - first_key
        blocks, hidden = block_tables[0, first_block:(first_key + length + block_size - 1) // block_size], None
    else:
        num_blocks = min((max_context_len + block_size - 1) // block_size, block_tables.shape[1]) - first_block
        blocks, length = block_tables[:, first_block:first_block + num_blocks].reshape(-1), num_blocks * block_size
        # the gathered rows past each context (and before each window): they may hold anything, even NaN, which a
        # masked score still turns into NaN
        keys = torch.arange(first_key, first_key + length, device=query.device)
        outside = keys >= context_lens[:, None]
        if oldest is not None:
            outside |= keys < oldest[:, None]
        hidden = outside.view(-1).nonzero().squeeze(1)

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [B, Hkv, L, D] float32 (a view), zeros past each context
        rows = cache.index_select(0, blocks).float()  # whole blocks in one call
        if hidden is None:
            return rows.flatten(0, 1)[skip:skip + length].transpose(0, 1)[None]
        # zeroed by rows: a mask broadcast over heads and head_dim costs several times more on the CPU
        rows = rows.view(num_seqs * length, num_kv_heads * head_dim).index_fill_(0, hidden, 0.0)
        return rows.view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)

    mask = None  # one sequence's one new token sees every key (without a window)
    if num_seqs > 1 or num_rows > 1 or sliding_window is not None:
        positions = context_lens[:, None] - num_rows + torch.arange(num_rows, device=query.device)  # [B, Q]
        keys = torch.arange(first_key, first_key + length, device=query.device)
        visible = keys <= positions[:, :, None]  # [B, Q, L]
        if sliding_window is not None:  # as transformers' sliding_window_overlay: key j visible iff p - j < window
            visible &= keys > positions[:, :, None] - sliding_window
        # rows ordered (position, head), below; a one-row query's mask broadcasts over the heads
        mask = (visible if num_rows == 1 else visible.repeat_interleave(group, dim=1))[:, None]
    # the query heads of a KV head are rows of one attention problem (no K/V repeated per query head)
    query = query.float().view(num_seqs, num_rows, num_kv_heads, group, head_dim).transpose(1, 2)
    query = query.reshape(num_seqs, num_kv_heads, num_rows * group, head_dim)
    if logit_softcap is None:
        out = F.scaled_dot_product_attention(query, gather(k_cache), gather(v_cache), mask, scale=scale)
    else:  # (scaled_dot_product_attention cannot cap the scores)
        scores = cap_logits(query @ gather(k_cache).transpose(-1, -2) * scale, logit_softcap)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = scores.softmax(-1).nan_to_num(0.0) @ gather(v_cache)  # (no keys: zeros, as that function gives)
    out = out.view(num_seqs, num_kv_heads, num_rows, group, head_dim).transpose(1, 2)
    return out.reshape(num_seqs, num_rows, num_q_heads, head_dim)


def attend_blocks_ref(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, first_key: int,
    context_lens: torch.Tensor, scale: float, with_lse: bool = False, logit_softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Row t of query [T, Hkv, G, D] (float32, G query heads per KV head) against keys first_key ..
    context_lens[t] - 1, held in blocks[t] (the row's blocks from first_key // block_size on): out [T, Hkv, G, D]
    float32 and, with_lse, its log2-sum-exp [T, Hkv, G] (-inf without keys). A row without keys gets zeros.
    logit_softcap: as paged_attention_ref's."""
    num_rows, num_kv_heads, _, head_dim = query.shape
    length = blocks.shape[1] * k_cache.shape[1]
    k = k_cache[blocks].reshape(num_rows, length, num_kv_heads, head_dim).float()
    v = v_cache[blocks].reshape(num_rows, length, num_kv_heads, head_dim).float()
    scores = cap_logits(torch.einsum("thgd,tlhd->thgl", query, k) * scale, logit_softcap)
    positions = first_key + torch.arange(length, device=query.device)
    visible = positions[None, :] < context_lens[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1) * _LOG2E if with_lse else None
    probs = scores.softmax(-1).nan_to_num(0.0)  # a padding row (context 0) attends to nothing: zeros
    v = v.masked_fill(~visible[:, :, None, None], 0.0)  # slots past the context may hold anything, even NaN
    return torch.einsum("thgl,tlhd->thgd", probs, v), lse


# ---------------------------------------------------------------------------------------------------
# Triton kernels. Both paths work in the log2 domain: scores are multiplied by scale * log2(e) so that
# the online softmax can use exp2. Rows of a tile are (query token, query head) pairs: the GROUP query
# heads that share one KV head are packed into the M dimension, so each KV tile is loaded once for them.
# ---------------------------------------------------------------------------------------------------

_LOG2E = math.log2(math.e)

if triton is not None:

    # a @ b with float32 accumulation; float32 operands use exact IEEE products (not TF32), so the float32
    # kernels match the reference to ~1e-6; half-precision operands use the tensor cores as usual.
    @triton.jit
    def _dot(a, b):
        if a.dtype == tl.float32:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    # Inline PTX, unless the interpreter runs the kernels as Python (the CPU tests): it has no PTX.
    _PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")

    @triton.jit
    def _values_as(v, dtype: tl.constexpr):
        """A V tile [keys, head_dim] as dtype, for p @ v. Float8 e4m3 to float16 converts in inline PTX marked impure,
        which Triton leaves where it is: its own conversion it moves past the tile's change of layout for the product,
        and that layout (keys paired per thread: V transposed) is then read from shared memory a byte at a time, as
        sm_90 has no 8-bit ldmatrix.trans. Converted first, the tile goes through shared memory as float16."""
        if (v.dtype == tl.float8e4nv) & (dtype == tl.float16):
            if _PTX:
                return tl.inline_asm_elementwise(
                    "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                    "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
                    "=r,=r,r", [v.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)
        return v.to(dtype)

    @triton.jit
    def _cap_scores(s, SOFTCAP: tl.constexpr):
        """Gemma 2's logit soft-capping, cap * tanh(score / cap), on scores s in the kernels' base-2 units (natural
        ones times log2(e)): with SOFTCAP = cap * log2(e) it is the natural cap converted, as SOFTCAP * tanh(s /
        SOFTCAP) = log2(e) * cap * tanh(score / cap). tanh(x) = 1 - 2 / (e^2x + 1), from exp2 (triton.language has
        no tanh that the interpreter runs too); it saturates to +-1 for large |x|."""
        return SOFTCAP * (1.0 - 2.0 / (tl.exp2(s * (2.0 * 1.4426950408889634 / SOFTCAP)) + 1.0))

    # One step of the online softmax over the keys start_n .. start_n + BLOCK_N of one sequence:
    #   s = (q @ K^T) * scale*log2(e), masked;  m' = max(m, rowmax(s));  p = exp2(s - m')
    #   l' = l * exp2(m - m') + rowsum(p);      acc' = acc * exp2(m - m') + p @ V
    # K/V rows are gathered through the block table: key n lives in block table[n // BLOCK_SIZE], slot
    # n % BLOCK_SIZE. CAUSAL masks key n > q_pos[row]; BOUNDED masks keys >= kv_end (tiles that are not full), and
    # with WINDOW_EDGE keys < kv_start too, unread (the tile a window starts inside: the blocks before the window
    # may have been given back, BlockManager.remove_skipped_blocks, and hold another sequence's K/V, even NaN);
    # SLIDING_WINDOW (0: none) masks keys n <= q_pos[row] - SLIDING_WINDOW, as transformers' sliding_window_overlay
    # (key n visible iff q_pos - n < window); SOFTCAP (0.0: none) caps the scores (_cap_scores).
    # K and V are converted to q's dtype as they are loaded: a float8 cache (kv_cache_dtype="fp8") is read as
    # half the bytes and multiplied as q's type (float16 there, see _query_for); for a cache of q's dtype the
    # conversion is no code at all.
    @triton.jit
    def _attend_tile(
        acc, m_i, l_i, q, q_pos, start_n, kv_end, table_ptr, k_base, v_base,
        stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
        BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
        CAUSAL: tl.constexpr, BOUNDED: tl.constexpr, SLIDING_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
        kv_start=0, WINDOW_EDGE: tl.constexpr = False,
    ):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        in_range = offs_n < kv_end
        if WINDOW_EDGE:
            in_range = in_range & (offs_n >= kv_start)
        if BOUNDED:
            blocks = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        else:
            blocks = tl.load(table_ptr + offs_n // BLOCK_SIZE).to(tl.int64)
        slots = offs_n % BLOCK_SIZE
        k_ptrs = k_base + blocks[:, None] * stride_kb + slots[:, None] * stride_ks + offs_d[None, :]
        v_ptrs = v_base + blocks[:, None] * stride_vb + slots[:, None] * stride_vs + offs_d[None, :]
        if BOUNDED:
            k = tl.load(k_ptrs, mask=in_range[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        k = k.to(q.dtype)
        s = _dot(q, tl.trans(k)) * qk_scale
        if SOFTCAP > 0.0:
            s = _cap_scores(s, SOFTCAP)
        if CAUSAL:
            s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
        elif BOUNDED:
            s = tl.where(in_range[None, :], s, float("-inf"))
        if SLIDING_WINDOW:
            s = tl.where(offs_n[None, :] > q_pos[:, None] - SLIDING_WINDOW, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if BOUNDED:
            v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        v = _values_as(v, q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
        return acc, m_new, l_i

    @triton.jit
    def _query_for(q, cache_ptr):
        """q as the tiles multiply it, for a cache of cache_ptr's element type: a bfloat16 q becomes float16 for a
        float8 e4m3 cache, whose values then convert in one instruction per pair (sm_89+'s cvt.f16x2.e4m3x2), not
        the three that bfloat16 takes; float16 holds every e4m3 value, and every bfloat16 q of its range (q is
        clamped to it), exactly. Any other q or cache: q unchanged."""
        if (cache_ptr.dtype.element_ty == tl.float8e4nv) & (q.dtype == tl.bfloat16):
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        return q

    @triton.jit
    def _attend_keys(
        q, start, end, table_ptr, k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
        SOFTCAP: tl.constexpr,
    ):
        """Query rows q [ROWS, HEAD_DIM] against keys start .. end - 1 of one block table, every row seeing all of
        them (a decode token, or cascade attention's shared prefix): the normalized output [ROWS, HEAD_DIM] and
        its log2-sum-exp [ROWS]. q as loaded: _query_for makes it what the tiles multiply. (No window mask: a decode
        token's keys start inside its window.)"""
        q = _query_for(q, k_base)
        m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
        for start_n in range(start, end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, m_i, start_n, end, table_ptr, k_base, v_base,
                stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                BLOCK_N, BLOCK_SIZE, HEAD_DIM, CAUSAL=False, BOUNDED=True, SLIDING_WINDOW=0, SOFTCAP=SOFTCAP,
            )
        return acc / l_i[:, None], m_i + tl.log2(l_i)

    @triton.jit
    def _store_partial(partial_out_ptr, partial_lse_ptr, part, out, lse, row_valid, HEAD_DIM: tl.constexpr):
        """A piece's output and log2-sum-exp into slots `part` [ROWS] of the partials the combine kernel merges."""
        offs_d = tl.arange(0, HEAD_DIM)
        tl.store(partial_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_valid[:, None])
        tl.store(partial_lse_ptr + part, lse, mask=row_valid)

    # Prefill (FlashAttention-2): program (kv head, sequence, query tile). The tile holds BLOCK_Q = BLOCK_M
    # // GROUP query tokens times the GROUP heads of this KV head; token j of the sequence sits at position
    # context_len - query_len + j. Keys below the tile's first position are visible to every row (unmasked
    # loop); the diagonal band up to its last position is masked causally; keys beyond it are skipped.
    # SLIDING_WINDOW (0: none) and SOFTCAP (0.0: none) as in _attend_tile; with a window the unmasked loop starts
    # at the tile of the first row's oldest visible key (no row sees a key below it) and masks each row's window; no
    # key below that one is loaded (WINDOW_EDGE), in that tile or, where the window is shorter than a tile, the
    # causal band's.
    @triton.jit(do_not_specialize=["stride_table"])  # varies from step to step: compile once
    def _paged_prefill_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_query_lens_ptr, context_lens_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_table, qk_scale,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, SLIDING_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
        kv_head, seq = tl.program_id(0), tl.program_id(1)
        tile = tl.num_programs(2) - 1 - tl.program_id(2)  # the last tiles (the most keys) start first
        seq_start = tl.load(cu_query_lens_ptr + seq)
        query_len = tl.load(cu_query_lens_ptr + seq + 1) - seq_start
        q_start = tile * BLOCK_Q
        if q_start >= query_len:
            return
        context_len = tl.load(context_lens_ptr + seq)
        first_pos = context_len - query_len + q_start
        last_pos = context_len - query_len + tl.minimum(q_start + BLOCK_Q, query_len) - 1

        rows = tl.arange(0, BLOCK_M)
        q_index = q_start + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_valid = (rows < BLOCK_Q * GROUP) & (q_index < query_len)
        q_pos = context_len - query_len + q_index
        token = (seq_start + q_index).to(tl.int64)
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_valid[:, None], other=0.0)
        q = _query_for(q, k_cache_ptr)

        table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
        k_base = k_cache_ptr + kv_head * stride_kh
        v_base = v_cache_ptr + kv_head * stride_vh
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
        first_key = 0
        oldest = 0  # no row sees a key before it
        if SLIDING_WINDOW:  # (aligned down to a tile, so that the unmasked loop's tiles stay below full_end)
            oldest = tl.maximum(first_pos - SLIDING_WINDOW + 1, 0)
            first_key = oldest // BLOCK_N * BLOCK_N
            if (first_key < oldest) & (first_key < full_end):  # the tile the window starts inside: from oldest on
                acc, m_i, l_i = _attend_tile(
                    acc, m_i, l_i, q, q_pos, first_key, full_end, table_ptr, k_base, v_base,
                    stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                    BLOCK_N, BLOCK_SIZE, HEAD_DIM, CAUSAL=False, BOUNDED=True, SLIDING_WINDOW=SLIDING_WINDOW,
                    SOFTCAP=SOFTCAP, kv_start=oldest, WINDOW_EDGE=True,
                )
                first_key += BLOCK_N
        for start_n in range(first_key, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_pos, start_n, full_end, table_ptr, k_base, v_base,
                stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                BLOCK_N, BLOCK_SIZE, HEAD_DIM, CAUSAL=False, BOUNDED=False, SLIDING_WINDOW=SLIDING_WINDOW,
                SOFTCAP=SOFTCAP,
            )
        for start_n in range(full_end, last_pos + 1, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_pos, start_n, last_pos + 1, table_ptr, k_base, v_base,
                stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                BLOCK_N, BLOCK_SIZE, HEAD_DIM, CAUSAL=True, BOUNDED=True, SLIDING_WINDOW=SLIDING_WINDOW,
                SOFTCAP=SOFTCAP, kv_start=oldest, WINDOW_EDGE=SLIDING_WINDOW > 0,  # (a window shorter than a tile)
            )
        out = acc / l_i[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])

    # The keys of one decode split: each sequence cuts its own context into num_splits pieces of
    #   partition = max(roundup(cdiv(context_len, num_splits), BLOCK_N), min_partition)
    # tokens (the last pieces may be empty), so that short and long sequences alike use the grid, and a
    # grid sized for the longest context (a CUDA graph's) still spreads a shorter one over its splits.
    @triton.jit
    def _split_partition(context_len, num_splits, min_partition, BLOCK_N: tl.constexpr):
        return tl.maximum(tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N, min_partition)

    @triton.jit
    def _prefetch_tile(start, end, table_ptr, k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs,
                       BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, USE_PDL: tl.constexpr):
        """Before pdl_wait: the L2 prefetch (pdl.prefetch_l2) of the K and V rows of keys start .. start + BLOCK_N
        (those below end), a line per 64 elements of a row. Without PDL it loads nothing."""
        if USE_PDL:
            offs_n = start + tl.arange(0, BLOCK_N)
            in_range = offs_n < end
            blocks = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
            slots = offs_n % BLOCK_SIZE
            LINES: tl.constexpr = (HEAD_DIM + 63) // 64
            offs_line = tl.arange(0, LINES) * 64
            k_rows = k_base + blocks[:, None] * stride_kb + slots[:, None] * stride_ks + offs_line[None, :]
            v_rows = v_base + blocks[:, None] * stride_vb + slots[:, None] * stride_vs + offs_line[None, :]
            prefetch_l2(tl.where(in_range[:, None], k_rows, k_base), USE_PDL)
            prefetch_l2(tl.where(in_range[:, None], v_rows, v_base), USE_PDL)

    # Decode (flash-decoding), pass 1: program (sequence, kv head, split) attends the GROUP query heads of
    # its single new token to keys split*partition .. min((split+1)*partition, context_len). With one
    # split it writes the output; otherwise it writes the partial result acc/l and its log2-sum-exp
    # lse = m + log2(l) for the combine kernel. A sequence without keys (a CUDA graph's padding row,
    # context 0) gets zeros, as in the reference.
    # SKIP_PREFIX (cascade attention's suffix pass): the keys start at *prefix_len_ptr instead of 0, the
    # splits cut context_len - prefix_len, and split s's partial goes to slot num_prefix_splits + s of the
    # num_prefix_splits + num_splits slots per row (the prefix pass fills the first ones). MERGE_PREFIX (with
    # SKIP_PREFIX and one split): the program merges the prefix pass's pieces with its own result and writes the
    # output, as the combine kernel would (the same sums in the same order), which then is not launched.
    # SLIDING_WINDOW (0: none): the keys start at context_len - SLIDING_WINDOW (the token's oldest visible one), so
    # the splits cut the window alone and the blocks before it are never read. SOFTCAP: as in _attend_tile.
    @triton.jit(do_not_specialize=["stride_table", "num_splits", "num_prefix_splits"])
    def _paged_decode_kernel(
        out_ptr, partial_out_ptr, partial_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
        cu_query_lens_ptr, context_lens_ptr, prefix_len_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_table, qk_scale, num_q_heads, num_splits, min_partition,
        num_prefix_splits,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr, SINGLE_SPLIT: tl.constexpr, SKIP_PREFIX: tl.constexpr, MERGE_PREFIX: tl.constexpr,
        SLIDING_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        # Before the wait, what the kernel before (qkv's product, storing this step's K and V) cannot change: the
        # batch's layout, written before the step, and where this piece's keys are; their lines are prefetched
        # into L2, so the kernel's HBM latency runs under that kernel's tail.
        seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        token = tl.load(cu_query_lens_ptr + seq)
        query_len = tl.load(cu_query_lens_ptr + seq + 1) - token
        context_len = tl.load(context_lens_ptr + seq)
        if SKIP_PREFIX:
            key_start = tl.load(prefix_len_ptr)
            num_slots = num_prefix_splits + num_splits
            first_slot = num_prefix_splits
        else:
            key_start = 0
            num_slots = num_splits
            first_slot = 0
        if SLIDING_WINDOW:  # the blocks before the window are skipped: the splits below cut the window alone
            key_start = tl.maximum(context_len - SLIDING_WINDOW, key_start)
        partition = _split_partition(context_len - key_start, num_splits, min_partition, BLOCK_N)
        start = key_start + split * partition
        end = tl.minimum(start + partition, context_len)
        table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
        _prefetch_tile(start, tl.where(query_len > 0, end, start), table_ptr, k_cache_ptr + kv_head * stride_kh,
                       v_cache_ptr + kv_head * stride_vh, stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_N,
                       BLOCK_SIZE, HEAD_DIM, USE_PDL)
        pdl_wait(USE_PDL)

        rows = tl.arange(0, BLOCK_G)
        head = kv_head * GROUP + rows
        row_valid = rows < GROUP
        offs_d = tl.arange(0, HEAD_DIM)
        token = token.to(tl.int64)
        out_ptrs = out_ptr + token * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        if SINGLE_SPLIT or MERGE_PREFIX:  # with several splits the combine kernel writes the zeros
            if (context_len <= 0) & (query_len > 0):
                zeros = tl.zeros([BLOCK_G, HEAD_DIM], dtype=out_ptr.dtype.element_ty)
                tl.store(out_ptrs, zeros, mask=row_valid[:, None])
        if MERGE_PREFIX:  # (a row whose suffix is empty still merges the prefix's pieces)
            done = (query_len == 0) | (context_len <= 0)
        else:
            done = (query_len == 0) | (start >= context_len)
        if done:
            return

        q = tl.load(q_ptr + token * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_valid[:, None], other=0.0)
        out, lse = _attend_keys(q, start, end, table_ptr, k_cache_ptr + kv_head * stride_kh,
                                v_cache_ptr + kv_head * stride_vh, stride_kb, stride_ks, stride_vb, stride_vs,
                                qk_scale, BLOCK_G, BLOCK_N, BLOCK_SIZE, HEAD_DIM, SOFTCAP)
        if SINGLE_SPLIT:
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
        elif MERGE_PREFIX:
            empty = start >= context_len  # (no suffix keys: _attend_keys gave 0/0; the prefix's pieces alone)
            out = tl.where(empty, 0.0, out)
            lse = tl.where(empty, float("-inf"), lse)
            rows_slots = (seq * num_q_heads + head).to(tl.int64) * num_slots  # each row's first slot
            pieces = _prefix_pieces(key_start, num_prefix_splits, min_partition, BLOCK_N)
            top = lse
            for slot in range(0, pieces):
                top = tl.maximum(top, tl.load(partial_lse_ptr + rows_slots + slot, mask=row_valid, other=float("-inf")))
            acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
            total = tl.zeros([BLOCK_G], dtype=tl.float32)
            for slot in range(0, pieces):
                piece_lse = tl.load(partial_lse_ptr + rows_slots + slot, mask=row_valid, other=float("-inf"))
                piece = tl.load(partial_out_ptr + (rows_slots + slot)[:, None] * HEAD_DIM + offs_d[None, :],
                                mask=row_valid[:, None], other=0.0)
                acc, total = _merge_piece(acc, total, piece, piece_lse, top)
            acc, total = _merge_piece(acc, total, out, lse, top)
            tl.store(out_ptrs, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
        else:
            part = (seq * num_q_heads + head).to(tl.int64) * num_slots + first_slot + split
            _store_partial(partial_out_ptr, partial_lse_ptr, part, out, lse, row_valid, HEAD_DIM)

    # Decode pass 2: program (sequence, HEADS query heads) merges the splits that held keys:
    #   out = sum_s w_s * out_s / sum_s w_s,   w_s = exp2(lse_s - max_s lse_s)
    # summed slot after slot (four loads in flight at a time), so that a row's rounding depends on its own pieces
    # only: not on HEADS, nor on how many splits a CUDA graph was captured with (an eager step and a graph cut a
    # context into the same pieces, see _split_partition; unused slots add exact zeros). A program per (sequence,
    # head) reducing a tile of every possible slot spent most of cascade attention's time at large batches.
    # CASCADE: the row's slots are num_prefix_splits pieces of the shared prefix (prefix_len tokens, cut as
    # _split_partition cuts a context), then num_splits pieces of the row's own suffix. SLIDING_WINDOW: the pieces
    # cut the window's min(context_len, SLIDING_WINDOW) keys, as the decode kernel did.
    @triton.jit
    def _prefix_pieces(prefix_len, num_prefix_splits, min_partition, BLOCK_N: tl.constexpr):
        """How many of cascade attention's prefix slots hold a piece with keys (the first ones)."""
        pieces = tl.cdiv(prefix_len, _split_partition(prefix_len, num_prefix_splits, min_partition, BLOCK_N))
        return tl.minimum(pieces, num_prefix_splits)

    @triton.jit
    def _merge_piece(acc, total, piece, piece_lse, top):
        """One slot of the combine's sums: acc += w * piece, total += w, w = exp2(piece_lse - top) (0 for a slot
        without keys, loaded as lse -inf and piece 0)."""
        weight = tl.exp2(piece_lse - top)
        return acc + piece * weight[:, None], total + weight

    @triton.jit
    def _slots_used(slot, context_len, prefix_len, num_splits, num_prefix_splits, min_partition,
                    BLOCK_N: tl.constexpr, CASCADE: tl.constexpr, SLIDING_WINDOW: tl.constexpr):
        """Whether slot (a scalar or a tensor of slots) holds a piece with keys, and the end of the used slots."""
        if CASCADE:
            prefix_pieces = _prefix_pieces(prefix_len, num_prefix_splits, min_partition, BLOCK_N)
            suffix_len = context_len - prefix_len
            suffix_pieces = tl.cdiv(suffix_len, _split_partition(suffix_len, num_splits, min_partition, BLOCK_N))
            suffix_pieces = tl.minimum(suffix_pieces, num_splits)
            suffix_slot = slot - num_prefix_splits
            used = (slot < prefix_pieces) | ((suffix_slot >= 0) & (suffix_slot < suffix_pieces))
            end = num_prefix_splits + suffix_pieces
        else:
            num_keys = context_len
            if SLIDING_WINDOW:
                num_keys = tl.minimum(context_len, SLIDING_WINDOW)
            end = tl.minimum(tl.cdiv(num_keys, _split_partition(num_keys, num_splits, min_partition, BLOCK_N)),
                             num_splits)
            used = slot < end
        return used, end

    @triton.jit(do_not_specialize=["num_splits", "num_prefix_splits"])
    def _combine_splits_kernel(
        out_ptr, partial_out_ptr, partial_lse_ptr, cu_query_lens_ptr, context_lens_ptr, prefix_len_ptr,
        stride_ot, stride_oh, num_q_heads, num_splits, min_partition, num_prefix_splits,
        HEADS: tl.constexpr, BLOCK_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
        CASCADE: tl.constexpr, SLIDING_WINDOW: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        # (the batch's layout and which slots hold pieces do not depend on the kernel before: read before the wait)
        seq = tl.program_id(0)
        heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        head_ok = heads < num_q_heads
        token = tl.load(cu_query_lens_ptr + seq)
        query_len = tl.load(cu_query_lens_ptr + seq + 1) - token
        context_len = tl.load(context_lens_ptr + seq)
        prefix_len = tl.load(prefix_len_ptr) if CASCADE else 0
        num_slots = num_prefix_splits + num_splits
        rows = (seq * num_q_heads + heads).to(tl.int64) * num_slots  # each (sequence, head) row's first slot
        splits = tl.arange(0, BLOCK_SPLITS)
        used, end = _slots_used(splits, context_len, prefix_len, num_splits, num_prefix_splits, min_partition,
                                BLOCK_N, CASCADE, SLIDING_WINDOW)
        pdl_wait(USE_PDL)
        offs_d = tl.arange(0, HEAD_DIM)
        out_ptrs = out_ptr + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        if query_len == 0:
            return
        if context_len <= 0:
            tl.store(out_ptrs, tl.zeros([HEADS, HEAD_DIM], dtype=out_ptr.dtype.element_ty), mask=head_ok[:, None])
            return
        lse = tl.load(partial_lse_ptr + rows[:, None] + splits[None, :], mask=head_ok[:, None] & used[None, :],
                      other=float("-inf"))
        top = tl.max(lse, axis=1)  # (exact in any order)
        acc = tl.zeros([HEADS, HEAD_DIM], dtype=tl.float32)
        total = tl.zeros([HEADS], dtype=tl.float32)
        for first in range(0, end, 4):
            for j in tl.static_range(4):
                slot = first + j + tl.zeros([HEADS], dtype=tl.int32)  # (per row: a mask of the rows' shape)
                slot_used, _ = _slots_used(slot, context_len, prefix_len, num_splits, num_prefix_splits,
                                           min_partition, BLOCK_N, CASCADE, SLIDING_WINDOW)
                mask = head_ok & slot_used
                piece_lse = tl.load(partial_lse_ptr + rows + slot, mask=mask, other=float("-inf"))
                piece = tl.load(partial_out_ptr + (rows + slot)[:, None] * HEAD_DIM + offs_d[None, :],
                                mask=mask[:, None], other=0.0)
                acc, total = _merge_piece(acc, total, piece, piece_lse, top)
        tl.store(out_ptrs, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


def softcap_switch(logit_softcap: float | None) -> float:
    """The kernels' SOFTCAP constexpr: the cap in their base-2 units (times log2(e), _cap_scores), 0.0 for none; so
    that without a cap they compile exactly as they would without the feature."""
    return 0.0 if logit_softcap is None else logit_softcap * _LOG2E


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The GQA group size, after checking what the kernels assume about layouts."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"paged_attention_triton needs a power-of-two head_dim >= 16, got {head_dim}")
    if block_size & (block_size - 1):
        raise ValueError(f"paged_attention_triton needs a power-of-two block_size, got {block_size}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("paged_attention_triton needs each head's values contiguous in q and the KV cache")
    return num_q_heads // num_kv_heads


# Launch configurations: (BLOCK_M, BLOCK_N, num_warps, num_stages) for prefill, (BLOCK_N, num_warps,
# num_stages) for decode. Fixed heuristics, no autotuning (the interpreter cannot autotune, and decode
# must launch identically inside CUDA graphs); benchmarks/bench_attention.py --sweep times the alternatives.
PrefillConfig = tuple[int, int, int, int]
DecodeConfig = tuple[int, int, int]


def prefill_config(head_dim: int, group: int, dtype: torch.dtype) -> PrefillConfig:
    """The prefill tile for a Hopper-class GPU: 128 (query, head) rows x 64 keys, two warpgroups. For
    bf16 on sm_90 (Triton 3.9) it compiles to wgmma without spills: head_dim 64 uses 122 registers and
    48 KiB of shared memory, head_dim 128 uses 177 registers and 96 KiB."""
    if dtype == torch.float32:  # no tensor cores for exact float32 products: small tiles, few registers
        return max(32, triton.next_power_of_2(group)), 32, 4, 1
    return max(128, triton.next_power_of_2(group)), 64, 8, 3


def decode_config(head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype | None = None,
                  programs: int = 0) -> DecodeConfig:
    """The decode tile: 64 keys per step; decode is bound by reading K/V, so stages keep loads in flight. A
    float8 cache read by half-precision queries, at a batch whose (sequence, KV head) programs fill the GPU
    without splits (`programs`, at least _DECODE_TARGET_PROGRAMS), takes 128 keys per step: a float8 key row is
    half a bf16 row's bytes, and the larger tile keeps as many bytes in flight. (`programs` counts a CUDA graph's
    padded batch, so an eager step of a few sequences fewer may take the other tile and round differently, as
    its split count may; cascade attention's suffix pass keeps 64, unmeasured with 128.)"""
    if dtype == torch.float32:
        return 64, 4, 2
    if cache_dtype == torch.float8_e4m3fn and programs >= _DECODE_TARGET_PROGRAMS:
        return 128, 4, 3
    return 64, 4, 3


def decode_rows(group: int, cache_dtype: torch.dtype) -> int:
    """BLOCK_G, a decode program's query rows: its KV head's group of query heads padded to a power of two. On a
    float8 cache at least 4 (Triton pads tl.dot's rows up to the MMA's 16 itself): with 16 rows for a group of 4,
    three quarters of the softmax and of the accumulator ran on padding, and 4 rows measured faster end to end.
    Other caches keep at least 16 rows: on bf16 the kernel reads near the copy rate, and 4 rows timed slower there
    (benchmarks/RESULTS.md)."""
    return max(4 if cache_dtype == torch.float8_e4m3fn else 16, triton.next_power_of_2(group))


def paged_prefill_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    config: PrefillConfig | None = None, out: torch.Tensor | None = None, *, sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """The FlashAttention-2 path of paged_attention_triton, for any mix of query lengths. `config`
    overrides prefill_config (tests use small tiles to exercise many tiles on tiny inputs)."""
    group = _check_shapes(q, k_cache, v_cache)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    block_m, block_n, num_warps, num_stages = config or prefill_config(q.shape[2], group, q.dtype)
    if group > block_m:
        raise ValueError(f"block_m={block_m} must hold at least the {group} query heads of one KV head")
    if q.shape[0] == 0 or meta.max_query_len <= 0:
        return out
    grid = (k_cache.shape[2], meta.num_seqs, triton.cdiv(meta.max_query_len, block_m // group))
    _paged_prefill_kernel[grid](
        out, q, k_cache, v_cache, meta.block_tables, meta.cu_query_lens, meta.context_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_tables.stride(0), scale * _LOG2E,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=q.shape[2],
        SLIDING_WINDOW=sliding_window or 0, SOFTCAP=softcap_switch(logit_softcap),
        num_warps=num_warps, num_stages=num_stages, **pdl_options(q),
    )
    return out


# Tokens: the shortest piece a split gets (one 64-key tile). At batch 1, where a few programs walk each context
# serially, more and shorter splits read the KV faster than a few long ones; large batches are unaffected (the
# program target below caps them at one split). The sweep in benchmarks/bench_attention.py (--sweep decode) chose
# this; figures in benchmarks/RESULTS.md.
_DECODE_MIN_PARTITION = 64
# About 4 programs per SM of an H100/H200: past it, a split more costs more in partial results than it adds in
# parallel reads. The same sweep chose this; figures in benchmarks/RESULTS.md.
_DECODE_TARGET_PROGRAMS = 512
_DECODE_MAX_SPLITS = 64  # the combine kernel holds all splits of a head in registers


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int) -> int:
    """How many splits flash-decoding cuts each context into, from Python ints only, so that a CUDA graph
    captured at a given batch size and max_context_len replays with the same grid: enough for about
    _DECODE_TARGET_PROGRAMS programs, but no more than the longest context has _DECODE_MIN_PARTITION
    pieces. Each sequence then sizes its own pieces from its context length (_split_partition)."""
    max_splits = triton.cdiv(max(max_context_len, 1), _DECODE_MIN_PARTITION)
    wanted = triton.cdiv(_DECODE_TARGET_PROGRAMS, max(num_seqs * num_kv_heads, 1))
    return max(1, min(max_splits, wanted, _DECODE_MAX_SPLITS))


def paged_decode_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    num_splits: int | None = None, config: DecodeConfig | None = None, out: torch.Tensor | None = None, *,
    sliding_window: int | None = None, logit_softcap: float | None = None,
) -> torch.Tensor:
    """The flash-decoding path of paged_attention_triton (every sequence has query_len <= 1).
    num_splits overrides decode_num_splits, and then pieces may be as short as BLOCK_N (tests force
    several splits on tiny contexts); config overrides decode_config. With a sliding window a token reads its
    window's keys alone, and the splits are sized for no more than the window."""
    _check_shapes(q, k_cache, v_cache)
    num_seqs, num_q_heads, num_kv_heads, head_dim = meta.num_seqs, q.shape[1], k_cache.shape[2], q.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    block_n, num_warps, num_stages = config or decode_config(head_dim, q.dtype, k_cache.dtype, num_seqs * num_kv_heads)
    min_partition = _DECODE_MIN_PARTITION if num_splits is None else block_n
    if num_splits is None:
        longest = meta.max_context_len if sliding_window is None else min(meta.max_context_len, sliding_window)
        num_splits = decode_num_splits(num_seqs, num_kv_heads, longest)
    single = num_splits == 1
    if single:
        partial_out = partial_lse = out  # unused
    else:
        partial_out = torch.empty((num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32,
                                  device=q.device)
        partial_lse = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    launch_decode(out, partial_out, partial_lse, q, k_cache, v_cache, meta, scale, num_splits, min_partition,
                  (block_n, num_warps, num_stages), sliding_window=sliding_window, logit_softcap=logit_softcap)
    if not single:
        launch_combine(out, partial_out, partial_lse, meta, num_splits, min_partition, block_n,
                       sliding_window=sliding_window)
    return out


def launch_decode(
    out: torch.Tensor, partial_out: torch.Tensor, partial_lse: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, num_splits: int, min_partition: int,
    config: DecodeConfig, prefix_len: torch.Tensor | None = None, num_prefix_splits: int = 0,
    merge_prefix: bool = False, sliding_window: int | None = None, logit_softcap: float | None = None,
) -> None:
    """Decode pass 1 (_paged_decode_kernel); with prefix_len, cascade attention's suffix pass, whose partials
    follow num_prefix_splits slots of the prefix pass's in each row; merge_prefix (one split): it merges the
    prefix pass's slots itself and writes `out`. (Cascade attention takes no window: see window_allows_cascade.)"""
    if merge_prefix and (num_splits != 1 or prefix_len is None):
        raise ValueError("merge_prefix needs cascade's suffix pass (prefix_len) in one split")
    if prefix_len is not None and sliding_window is not None:
        raise ValueError("cascade attention's suffix pass takes no sliding window")
    block_n, num_warps, num_stages = config
    num_seqs, num_q_heads, num_kv_heads, head_dim = meta.num_seqs, q.shape[1], k_cache.shape[2], q.shape[2]
    group = num_q_heads // num_kv_heads
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, partial_out, partial_lse, q, k_cache, v_cache, meta.block_tables, meta.cu_query_lens,
        meta.context_lens, meta.context_lens if prefix_len is None else prefix_len,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_tables.stride(0), scale * _LOG2E,
        num_q_heads, num_splits, min_partition, num_prefix_splits,
        GROUP=group, BLOCK_G=decode_rows(group, k_cache.dtype), BLOCK_N=block_n,
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, SINGLE_SPLIT=num_splits == 1 and prefix_len is None,
        SKIP_PREFIX=prefix_len is not None, MERGE_PREFIX=merge_prefix, SLIDING_WINDOW=sliding_window or 0,
        SOFTCAP=softcap_switch(logit_softcap), num_warps=num_warps, num_stages=num_stages, **pdl_options(q),
    )


def launch_combine(
    out: torch.Tensor, partial_out: torch.Tensor, partial_lse: torch.Tensor, meta: AttentionMetadata,
    num_splits: int, min_partition: int, block_n: int, prefix_len: torch.Tensor | None = None,
    num_prefix_splits: int = 0, sliding_window: int | None = None,
) -> None:
    """Decode pass 2 (_combine_splits_kernel); with prefix_len, the prefix's slots are merged too; sliding_window:
    the decode pass's, whose pieces cut the window alone."""
    num_q_heads, head_dim = out.shape[1], out.shape[2]
    heads = combine_heads(meta.num_seqs, num_q_heads)
    _combine_splits_kernel[(meta.num_seqs, triton.cdiv(num_q_heads, heads))](
        out, partial_out, partial_lse, meta.cu_query_lens, meta.context_lens,
        meta.context_lens if prefix_len is None else prefix_len,
        out.stride(0), out.stride(1), num_q_heads, num_splits, min_partition, num_prefix_splits,
        # (one width for the slots' log-sum-exps whatever the split count: no new variant mid-run)
        HEADS=heads, BLOCK_SPLITS=max(_DECODE_MAX_SPLITS, triton.next_power_of_2(num_splits + num_prefix_splits)),
        BLOCK_N=block_n, HEAD_DIM=head_dim, CASCADE=prefix_len is not None, SLIDING_WINDOW=sliding_window or 0,
        num_warps=max(1, min(4, heads * head_dim // 256)), **pdl_options(out),
    )


_COMBINE_TARGET_PROGRAMS = 256


def combine_heads(num_seqs: int, num_q_heads: int) -> int:
    """Query heads per program of the combine kernel: as many as leave about _COMBINE_TARGET_PROGRAMS programs
    (a power of two; one head each at small batches)."""
    heads = triton.next_power_of_2(num_q_heads)
    while heads > 1 and num_seqs * triton.cdiv(num_q_heads, heads) < _COMBINE_TARGET_PROGRAMS:
        heads //= 2
    return heads


def paged_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    out: torch.Tensor | None = None, *, sliding_window: int | None = None, logit_softcap: float | None = None,
) -> torch.Tensor:
    """The Triton kernels of paged_attention_ref: flash-decoding when every sequence adds one token,
    FlashAttention-2 over the paged cache otherwise (a mixed step's first meta.num_decodes sequences through
    flash-decoding). Grids depend on Python ints only (no host syncs)."""
    options = dict(sliding_window=sliding_window, logit_softcap=logit_softcap)
    if meta.is_decode:
        return paged_decode_triton(q, k_cache, v_cache, meta, scale, out=out, **options)
    if meta.num_decodes == 0:
        return paged_prefill_triton(q, k_cache, v_cache, meta, scale, out=out, **options)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    paged_decode_triton(q, k_cache, v_cache, meta.first_seqs(meta.num_decodes), scale, out=out, **options)
    return paged_prefill_triton(q, k_cache, v_cache, meta.last_seqs(meta.num_decodes), scale, out=out, **options)
