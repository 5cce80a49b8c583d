"""Every Triton kernel against its PyTorch reference, under the Triton interpreter on CPU tensors
(conftest sets TRITON_INTERPRET=1 before triton is imported). Shapes are tiny: the interpreter is slow.
Outputs the kernels allocate are poisoned with NaN (or -1 for integers), so an unwritten element fails."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tests.utils import assert_bf16_attention_close  # noqa: E402
from tinyvllm.ops import attention  # noqa: E402
from tinyvllm.ops.activation import (  # noqa: E402
    gelu_tanh_and_mul_ref,
    gelu_tanh_and_mul_triton,
    silu_and_mul_ref,
    silu_and_mul_triton,
)
from tinyvllm.ops.attention import (  # noqa: E402
    AttentionMetadata,
    decode_config,
    decode_num_splits,
    decode_rows,
    paged_attention_ref,
    paged_attention_triton,
    paged_decode_triton,
    paged_prefill_triton,
)
from tinyvllm.ops.bitmask import apply_token_bitmask_ref, apply_token_bitmask_triton  # noqa: E402
from tinyvllm.ops.embedding import embedding_ref, embedding_triton  # noqa: E402
from tinyvllm.ops.layernorm import (  # noqa: E402
    RowNorm,
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm_ref,
    rms_norm_triton,
)
from tinyvllm.ops.pdl import pdl_options  # noqa: E402
from tinyvllm.ops.rotary import (  # noqa: E402
    RopeStore,
    build_cos_sin_cache,
    rope_store_ref,
    rope_store_triton,
    rotary_embedding_and_store_ref,
    rotary_embedding_and_store_triton,
)
from tinyvllm.ops.sampling import _exponential, sample_triton  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # log(0) = -inf on purpose in sampling
              pytest.mark.usefixtures("poison_outputs")]  # (conftest: unwritten outputs show as NaN)


def test_pdl_is_off_without_a_hopper_gpu() -> None:
    """Programmatic dependent launch needs real PTX on SM90+: CPU tensors (and the interpreter, which these
    tests run under) get plain launches, with the kernels' USE_PDL branch compiled out."""
    assert pdl_options(torch.zeros(1)) == {"USE_PDL": False}




def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-5)
    elif actual.dtype == torch.bfloat16:  # the interpreter rounds float32 to bfloat16 toward zero: one step apart
        torch.testing.assert_close(actual.float(), expected.float(), atol=1e-5, rtol=1.6e-2)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------------------------------------- elementwise


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_apply_token_bitmask(dtype: torch.dtype) -> None:
    """Rows 1 and 3 of 4 constrained, a vocabulary of 2,100 (two blocks, the last word partial); the reference against
    a mask spelled out token by token."""
    logits = torch.randn(4, 2100).to(dtype)
    allowed = torch.rand(2, 2100) < 0.3
    allowed[:, 2050] = True
    words = torch.zeros(2, 66, dtype=torch.int64)
    for r, v in allowed.nonzero().tolist():
        words[r, v // 32] |= 1 << (v % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # (bit 31 as int32's sign)
    rows = torch.tensor([1, 3])
    expected = logits.clone()
    expected[rows] = expected[rows].masked_fill(~allowed, float("-inf"))
    torch.testing.assert_close(apply_token_bitmask_ref(logits.clone(), bitmask, rows), expected)
    torch.testing.assert_close(apply_token_bitmask_triton(logits.clone(), bitmask, rows), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_embedding(dtype: torch.dtype) -> None:
    weight = torch.randn(50, 1100).to(dtype)  # two column tiles, the second partial
    ids = torch.randint(0, 50, (7,))
    torch.testing.assert_close(embedding_triton(ids, weight), embedding_ref(ids, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    x, weight = torch.randn(5, hidden).to(dtype), torch.randn(hidden).to(dtype)
    _close(rms_norm_triton(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_several_rows_per_program(residual: bool) -> None:
    from tinyvllm.ops.layernorm import _launch_rms_norm

    x, res, weight = torch.randn(7, 96), torch.randn(7, 96), torch.randn(96)  # 7 rows: the last group is partial
    normed, new_residual = _launch_rms_norm(x, res if residual else None, weight, 1e-5, config=(4, 2))
    if residual:
        ref_normed, ref_residual = fused_add_rms_norm_ref(x, res, weight, 1e-5)
        torch.testing.assert_close(new_residual, ref_residual, atol=0, rtol=0)
    else:
        ref_normed = rms_norm_ref(x, weight, 1e-5)
    _close(normed, ref_normed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_add_rms_norm(dtype: torch.dtype) -> None:
    x, residual, weight = torch.randn(6, 80).to(dtype), torch.randn(6, 80).to(dtype), torch.rand(80).to(dtype)
    normed, new_residual = fused_add_rms_norm_triton(x, residual, weight, 1e-6)
    ref_normed, ref_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    torch.testing.assert_close(new_residual, ref_residual, atol=0, rtol=0)  # the rounded sum, bit for bit
    _close(normed, ref_normed)


# Llama 3 frequency scaling, with a short original context so that all three bands occur in 200 positions
LLAMA3_SCALING = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def _rotary_case(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype,
                 magnitude: float = 1.0, scaling: dict | None = LLAMA3_SCALING) -> tuple:
    """rotary_embedding_and_store's inputs: positions, q, k and v as views of one fused qkv projection (as the
    model produces them, times `magnitude`), the cos/sin cache, random K and V caches [2, blocks, block size, KV
    heads, head dim] and slots with two padding tokens."""
    num_blocks, block_size, tokens = 4, 8, 6
    cos_sin = build_cos_sin_cache(head_dim, 200, 500000.0, scaling, torch.device("cpu"))
    positions = torch.randint(0, 200, (tokens,))
    slots = torch.tensor([9, -1, 30, 0, -1, 17], dtype=torch.int64)
    qkv = (magnitude * torch.randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim)).to(dtype)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(tokens, -1, head_dim) for x in (q, k, v))
    caches = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype)
    return positions, q, k, v, cos_sin, caches, slots


@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, scaling", [
    (4, 2, 64, None), (9, 3, 64, LLAMA3_SCALING), (4, 2, 128, LLAMA3_SCALING)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_and_store(num_q_heads: int, num_kv_heads: int, head_dim: int, scaling: dict | None,
                                    dtype: torch.dtype) -> None:
    positions, q, k, v, cache, caches, slots = _rotary_case(num_q_heads, num_kv_heads, head_dim, dtype, dtype,
                                                            scaling=scaling)
    k_cache, v_cache = caches
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_q = rotary_embedding_and_store_ref(positions, q.clone(), k.clone(), v.clone(), cache, ref_k, ref_v, slots)
    original_k, original_cache = k.clone(), k_cache.clone()
    out_q = rotary_embedding_and_store_triton(positions, q, k, v, cache, k_cache, v_cache, slots)
    assert out_q.data_ptr() == q.data_ptr()
    _close(q, ref_q)  # padding tokens' q too
    written = torch.zeros(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat_k, flat_ref_k, flat_original = k_cache.flatten(0, 1), ref_k.flatten(0, 1), original_cache.flatten(0, 1)
    _close(flat_k[written], flat_ref_k[written])
    torch.testing.assert_close(flat_k[~written], flat_original[~written], atol=0, rtol=0)
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=0)
    torch.testing.assert_close(k, original_k, atol=0, rtol=0)  # k itself is read only


FP8 = torch.float8_e4m3fn


def _close_fp8(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Two float8 e4m3 tensors rounded from values that agree to float32 (or the query dtype's) rounding: nearly all
    bit for bit, the rest one e4m3 step apart (3 mantissa bits: at most 1/8 of the value, or the least subnormal)
    where the value sat on a rounding boundary. NaN where the other has NaN."""
    assert actual.dtype == expected.dtype == FP8
    same = actual.view(torch.uint8) == expected.view(torch.uint8)
    assert float(same.float().mean()) > 0.99, f"{int((~same).sum())} of {same.numel()} differ"
    torch.testing.assert_close(actual.float(), expected.float(), atol=2.0**-9, rtol=0.125, equal_nan=True)


@pytest.mark.usefixtures("fp8_casts_as_on_the_gpu")
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(4, 2, 64), (9, 3, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_and_store_into_fp8_cache(num_q_heads: int, num_kv_heads: int, head_dim: int,
                                                   dtype: torch.dtype) -> None:
    """kv_cache_dtype="fp8": the kernel stores what the reference stores (rotated k, then rounded to e4m3), and q is
    as with any cache."""
    positions, q, k, v, cos_sin, caches, slots = _rotary_case(num_q_heads, num_kv_heads, head_dim, dtype, FP8)
    ref_caches = caches.clone()
    ref_q = rotary_embedding_and_store_ref(positions, q.clone(), k.clone(), v.clone(), cos_sin, ref_caches[0],
                                           ref_caches[1], slots)
    rotary_embedding_and_store_triton(positions, q, k, v, cos_sin, caches[0], caches[1], slots)
    _close(q, ref_q)
    _close_fp8(caches[0], ref_caches[0])
    assert torch.equal(caches[1].view(torch.uint8), ref_caches[1].view(torch.uint8))  # v is not rotated: exact


@pytest.mark.usefixtures("fp8_casts_as_on_the_gpu")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_into_fp8_cache_saturates(dtype: torch.dtype) -> None:
    """Keys and values beyond e4m3's +-448 land as +-448 (e4m3fn has no infinity), never NaN, in the kernel (whose
    fixture makes an unclamped cast NaN) and the reference alike."""
    positions, q, k, v, cos_sin, caches, slots = _rotary_case(4, 2, 64, dtype, FP8, magnitude=2000.0)
    ref_caches = caches.clone()
    rotary_embedding_and_store_ref(positions, q.clone(), k.clone(), v.clone(), cos_sin, ref_caches[0], ref_caches[1],
                                   slots)
    rotary_embedding_and_store_triton(positions, q, k, v, cos_sin, caches[0], caches[1], slots)
    stored, ref_stored = (c.flatten(1, 2)[:, slots[slots >= 0]] for c in (caches, ref_caches))
    assert not stored.float().isnan().any() and not ref_stored.float().isnan().any()
    assert (stored.float().abs() == 448).float().mean() > 0.5  # most of 2000 * randn is beyond 448
    _close_fp8(stored[0], ref_stored[0])  # (rotated k: the interpreter rounds to bfloat16 its own way)
    expected_v = v[slots >= 0].float().clamp(-448, 448).to(FP8)
    assert torch.equal(stored[1].float(), expected_v.float()) and torch.equal(ref_stored[1].float(), expected_v.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = (3 * torch.randn(5, 2 * 1100)).to(dtype)  # two column tiles, the second partial
    _close(silu_and_mul_triton(x), silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gelu_tanh_and_mul(dtype: torch.dtype) -> None:
    """Gemma 2's gate against the reference (transformers' gelu_pytorch_tanh): two column tiles, the second partial,
    and saturated gates, whose GELU is -0 or the gate itself, never NaN."""
    x = (3 * torch.randn(5, 2 * 1100)).to(dtype)
    x[0, :4] = torch.tensor([-60.0, 60.0, -1e4, 1e4])
    out = gelu_tanh_and_mul_triton(x)
    assert not out.isnan().any()
    _close(out, gelu_tanh_and_mul_ref(x))
    gate, up = x.float().chunk(2, dim=-1)
    tanh_form = 0.5 * gate * (1 + torch.tanh((2 / math.pi) ** 0.5 * (gate + 0.044715 * gate**3))) * up
    _close(gelu_tanh_and_mul_ref(x), tanh_form.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul_with_a_folded_norm(dtype: torch.dtype) -> None:
    """With a RowNorm (the RMSNorm before gate_up folded into it), gate and up are scaled by the stream row's 1/rms
    first: silu_and_mul(rms_norm(h) @ W^T) == silu_and_mul(h @ (W * g)^T, RowNorm(h)) for the norm's weight g."""
    x = (3 * torch.randn(5, 2 * 1100)).to(dtype)
    stream = (4 * torch.randn(5, 96)).to(dtype)  # a hidden size that is not a power of two
    norm = RowNorm(stream, 1e-5)
    _close(silu_and_mul_triton(x, norm), silu_and_mul_ref(x, norm))
    h, g, w = torch.randn(5, 96, dtype=torch.float64), torch.rand(96, dtype=torch.float64) + 0.5, torch.randn(8, 96)
    folded = silu_and_mul_ref((h @ (w.double() * g).t()).float(), RowNorm(h.float(), 1e-5))
    unfolded = silu_and_mul_ref((rms_norm_ref(h, g, 1e-5) @ w.double().t()).float())
    torch.testing.assert_close(folded, unfolded, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
def test_rope_store_with_a_folded_norm(cache_dtype: torch.dtype, fp8_casts_as_on_the_gpu: None) -> None:
    """With a RowNorm (the RMSNorm before qkv folded into it), q, k and v are scaled by the stream row's 1/rms before
    the rotation and the store, in the kernel as in the reference; without one, as before."""
    positions, q, k, v, cos_sin, caches, slots = _rotary_case(4, 2, 64, torch.float32, cache_dtype)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=-1)
    stream = 3 * torch.randn(qkv.shape[0], 80)
    norm = RowNorm(stream, 1e-6)
    outs = []
    for op in (rope_store_triton, rope_store_ref):
        cache_pair = caches.clone()
        rope = RopeStore(positions, cos_sin, cache_pair[0], cache_pair[1], slots, 4, 2)
        outs.append((op(qkv.clone(), rope, norm), cache_pair))
    (out, got), (ref, expected) = outs
    _close(out, ref)
    if cache_dtype == FP8:
        _close_fp8(got[0], expected[0])
        _close_fp8(got[1], expected[1])
    else:
        _close(got, expected)
    # the scale is the norm's: with the stream's rows all equal to 1 / their own rms, nothing changes
    unit = RowNorm(torch.ones(qkv.shape[0], 80), 0.0)
    rope = RopeStore(positions, cos_sin, caches[0].clone(), caches[1].clone(), slots, 4, 2)
    plain = RopeStore(positions, cos_sin, caches[0].clone(), caches[1].clone(), slots, 4, 2)
    _close(rope_store_triton(qkv.clone(), rope, unit), rope_store_ref(qkv.clone(), plain))


# ------------------------------------------------------------------------------------------------ attention


def _paged_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q and a paged cache whose blocks are a random permutation of the pool; every slot that no
    sequence owns (spare blocks, the tail of a partial last block) is NaN, so reading one fails."""
    blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks).tolist()
    block_tables = torch.zeros(len(query_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    for i, context_len in enumerate(context_lens):
        blocks, order = order[: blocks_per_seq[i]], order[blocks_per_seq[i] :]
        block_tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for j in range(context_len):
            k_cache[blocks[j // block_size], j % block_size] = torch.randn(num_kv_heads, head_dim).to(dtype)
            v_cache[blocks[j // block_size], j % block_size] = torch.randn(num_kv_heads, head_dim).to(dtype)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    # q as the model passes it: a view of the fused qkv projection, token rows not contiguous
    q = torch.randn(int(cu[-1]), num_q_heads + 2 * num_kv_heads, head_dim).to(dtype)[:, :num_q_heads]
    meta = AttentionMetadata(
        cu_query_lens=cu,
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=torch.zeros(int(cu[-1]), dtype=torch.int64),  # not read by attention
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
    )
    return q, k_cache, v_cache, meta


# (query heads, kv heads, head_dim, block_size, dtype): GQA ratios 1, 4, 8 and 3 (SmolLM2's 9/3)
_ATTENTION_SHAPES = [
    (2, 2, 64, 16, torch.float32),
    (8, 2, 64, 32, torch.float32),
    (8, 1, 128, 16, torch.float32),
    (6, 2, 64, 16, torch.float32),
    (4, 1, 64, 16, torch.float16),
]


@pytest.mark.parametrize("shape", _ATTENTION_SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv-d{s[2]}-bs{s[3]}-{s[4]}")
@pytest.mark.parametrize("num_splits,config", [(None, None), (3, None), (4, (32, 4, 1))],
                         ids=["default", "3-splits", "4-splits-block32"])
def test_paged_decode(shape: tuple, num_splits: int | None, config: tuple[int, int, int] | None) -> None:
    num_q_heads, num_kv_heads, head_dim, block_size, dtype = shape
    # ragged contexts, partial last blocks, one sequence shorter than a block, one without a token this
    # step, and a CUDA graph's padding row (one token, context 0: zeros, as the reference gives)
    query_lens, context_lens = [1, 1, 0, 1, 1], [5, 2 * block_size + 3, 9, 70, 0]
    q, k_cache, v_cache, meta = _paged_batch(
        query_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    expected = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    if num_splits is None:
        assert meta.is_decode
        out = paged_attention_triton(q, k_cache, v_cache, meta, scale)
    else:
        out = paged_decode_triton(q, k_cache, v_cache, meta, scale, num_splits=num_splits, config=config)
    _close(out, expected)


def test_paged_decode_grid_sized_for_longer_contexts() -> None:
    # a CUDA graph is captured once at the longest context: the grid (here 64 splits) must serve short ones
    q, k_cache, v_cache, meta = _paged_batch([1, 1, 1], [300, 17, 1000], 4, 2, 64, 16, torch.float32)
    meta.max_context_len = 8192
    assert decode_num_splits(3, 2, 8192) == 64
    expected = paged_attention_ref(q, k_cache, v_cache, meta, 0.125)
    _close(paged_attention_triton(q, k_cache, v_cache, meta, 0.125), expected)


def test_decode_combine_rounding_does_not_depend_on_heads_per_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """The combine kernel sums each row's splits slot after slot: the bits are the same whether a program merges
    one query head or several (the batch size picks how many), and close to the reference."""
    import tinyvllm.ops.attention as attention

    q, k_cache, v_cache, meta = _paged_batch([1, 1, 0, 1], [300, 17, 9, 1000], 8, 2, 64, 16, torch.float32)
    expected = paged_attention_ref(q, k_cache, v_cache, meta, 0.125)
    outs = []
    for heads in (1, 4, 8):
        monkeypatch.setattr(attention, "combine_heads", lambda num_seqs, num_q_heads, h=heads: h)
        outs.append(paged_decode_triton(q, k_cache, v_cache, meta, 0.125, num_splits=6))
    _close(outs[0], expected)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    monkeypatch.undo()
    assert attention.combine_heads(1, 32) == 1 and attention.combine_heads(256, 32) == 32


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn], ids=["float32", "fp8"])
def test_kernels_on_a_head_major_pool(cache_dtype: torch.dtype) -> None:
    """The kernels address the pool through its strides: a pool stored [blocks, heads, block_size, head_dim]
    (ops.kv_pool's default layout) gets the same values from the stores (the RoPE + KV-store kernel
    and store_kv_ref), and gives decode and prefill attention the same bits."""
    import tinyvllm.ops as ops

    def pools(head_major: bool, like: torch.Tensor) -> list[torch.Tensor]:
        """Two pools (K, V) holding `like`'s values: ops.kv_pool's (head-major), or plain token-major tensors."""
        if head_major:
            made = [ops.kv_pool(*like.shape[1:], cache_dtype, torch.device("cpu")) for _ in range(2)]
        else:
            made = [torch.zeros(like.shape[1:], dtype=cache_dtype) for _ in range(2)]
        for pool, values in zip(made, like):
            pool.copy_(values.to(cache_dtype))
        return made

    positions, q, k, v, cos_sin, caches, slots = _rotary_case(4, 2, 64, torch.float32, torch.float32)
    for store in (rotary_embedding_and_store_triton, rotary_embedding_and_store_ref):
        plain, head_major = pools(False, caches), pools(True, caches)
        assert plain[0].is_contiguous() and head_major[0].stride(2) == caches.shape[2] * caches.shape[4]
        store(positions, q.clone(), k, v, cos_sin, *plain, slots)
        store(positions, q.clone(), k, v, cos_sin, *head_major, slots)
        for a, b in zip(plain, head_major):
            assert torch.equal(a.float(), b.float()), store.__name__
    for query_lens, context_lens in (([1, 1, 1], [300, 17, 70]), ([5, 1, 16], [20, 33, 16])):
        q, k_cache, v_cache, meta = _paged_batch(query_lens, context_lens, 8, 2, 64, 16, torch.float32)
        caches = torch.stack([k_cache, v_cache])  # (unowned slots NaN, as _paged_batch makes them)
        plain, head_major = pools(False, caches), pools(True, caches)
        if meta.is_decode:
            out = paged_attention_triton(q, *plain, meta, 0.125)
            assert torch.equal(paged_attention_triton(q, *head_major, meta, 0.125), out)
        else:
            out = paged_prefill_triton(q, *plain, meta, 0.125, config=(16, 16, 4, 1))
            assert torch.equal(paged_prefill_triton(q, *head_major, meta, 0.125, config=(16, 16, 4, 1)), out)


def test_decode_config_heuristic() -> None:
    # 128 keys per step for a float8 cache read by half-precision queries once the batch fills the GPU unsplit;
    # 64 otherwise (bf16 caches, small batches, float32 queries)
    assert decode_config(64, torch.bfloat16, FP8, 64 * 8)[0] == 128
    assert decode_config(64, torch.bfloat16, FP8, 32 * 8)[0] == 64
    assert decode_config(64, torch.bfloat16, torch.bfloat16, 256 * 8)[0] == 64
    assert decode_config(64, torch.float32, FP8, 256 * 8)[0] == 64


def test_decode_rows_heuristic() -> None:
    # a program's query rows: its group padded to a power of two, at least 4 on a float8 cache and 16 on others
    assert [decode_rows(group, FP8) for group in (1, 2, 3, 4, 8, 32)] == [4, 4, 4, 4, 8, 32]
    assert [decode_rows(group, torch.bfloat16) for group in (1, 4, 8, 32)] == [16, 16, 16, 32]


def test_decode_num_splits_heuristic() -> None:
    # batch 1, long context: many splits, of at least one 64-key tile; a big batch: one split (no combine pass)
    assert 16 <= decode_num_splits(1, 8, 8192) <= 64
    assert decode_num_splits(256, 8, 8192) == 1
    assert decode_num_splits(64, 8, 4096) == 1  # 512 programs already fill the GPU
    assert decode_num_splits(1, 8, 64) == 1  # one tile of keys: nothing to split
    assert decode_num_splits(1, 8, 384) == 6  # batch 1 at latency-b1's contexts: a tile per split


# (query_lens, context_lens): full prefill of ragged prompts; chunked prefill with a context offset;
# a mixed batch of decodes (query_len 1), an idle sequence (query_len 0) and a prefill chunk
_PREFILL_BATCHES = {
    "ragged": ([5, 37, 20], [5, 37, 20]),
    "chunked": ([7, 20, 33], [40, 20, 70]),
    "mixed": ([1, 0, 12, 1], [25, 10, 30, 1]),
}


@pytest.mark.parametrize("shape", _ATTENTION_SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv-d{s[2]}-bs{s[3]}-{s[4]}")
@pytest.mark.parametrize("batch", list(_PREFILL_BATCHES))
@pytest.mark.parametrize("config", [None, (16, 16, 4, 1)], ids=["default-tiles", "small-tiles"])
def test_paged_prefill(shape: tuple, batch: str, config: tuple[int, int, int, int] | None) -> None:
    num_q_heads, num_kv_heads, head_dim, block_size, dtype = shape
    query_lens, context_lens = _PREFILL_BATCHES[batch]
    q, k_cache, v_cache, meta = _paged_batch(
        query_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    expected = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    if config is None:
        assert not meta.is_decode
        out = paged_attention_triton(q, k_cache, v_cache, meta, scale)
    else:
        out = paged_prefill_triton(q, k_cache, v_cache, meta, scale, config=config)
    _close(out, expected)


# A mixed step as the model runner orders it: its one-token sequences first (AttentionMetadata.num_decodes), which
# paged_attention_triton sends to the decode kernel, then the others (an idle one among them) for the prefill kernel
_DECODES_FIRST = ([1, 1, 1, 12, 0, 7], [25, 1, 40, 30, 10, 7])


@pytest.mark.parametrize("shape", _ATTENTION_SHAPES + [(8, 2, 64, 16, FP8)],
                         ids=lambda s: f"{s[0]}q{s[1]}kv-d{s[2]}-bs{s[3]}-{s[4]}")
def test_mixed_step_sends_its_decodes_to_the_decode_kernel(shape: tuple, monkeypatch: pytest.MonkeyPatch,
                                                            fp8_casts_as_on_the_gpu: None) -> None:
    if shape[4] == FP8:
        q, k_cache, v_cache, meta = _fp8_paged_batch(*_DECODES_FIRST, (*shape[:4], torch.bfloat16))
    else:
        q, k_cache, v_cache, meta = _paged_batch(*_DECODES_FIRST, *shape)
    scale = shape[2] ** -0.5
    expected = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    calls: list[tuple[str, int]] = []

    def counted(name: str) -> Callable[..., torch.Tensor]:
        kernel = getattr(attention, name)

        def run(*args: object, **kwargs: object) -> torch.Tensor:
            calls.append((name, args[3].num_seqs))  # (its metadata: which sequences it took)
            return kernel(*args, **kwargs)
        return run

    for name in ("paged_decode_triton", "paged_prefill_triton"):
        monkeypatch.setattr(attention, name, counted(name))
    out = paged_attention_triton(q, k_cache, v_cache, dataclasses.replace(meta, num_decodes=3), scale)
    assert calls == [("paged_decode_triton", 3), ("paged_prefill_triton", 3)]
    _close_fp8_attention(out, expected)


# paged_attention_ref's batching (the CPU engine's path): one call for a decode step (here with a CUDA graph's
# padding row, context 0), one-token and longer sequences apart in a mixed step, prompts padded to the longest, or one
# call each where padding would more than double the rows ("imbalanced"), a lone sequence without padding or mask
_REF_BATCHES = {
    **_PREFILL_BATCHES,
    "decode": ([1, 1, 1, 1], [9, 40, 0, 17]),
    "imbalanced": ([40, 3, 2, 1, 1], [40, 30, 2, 8, 50]),
    "one-prompt": ([23], [23]),
    "one-decode": ([1], [33]),
}


@pytest.mark.parametrize("batch", list(_REF_BATCHES))
def test_paged_attention_ref_equals_each_sequence_alone(batch: str) -> None:
    """Against each sequence's causal attention in float64 over its own keys, read position by position."""
    query_lens, context_lens = _REF_BATCHES[batch]
    q, k_cache, v_cache, meta = _paged_batch(query_lens, context_lens, 6, 2, 32, 16, torch.float32)
    out = paged_attention_ref(q, k_cache, v_cache, meta, 0.2)
    cu = meta.cu_query_lens.tolist()
    for i, (query_len, context_len) in enumerate(zip(query_lens, context_lens)):
        rows = out[cu[i]:cu[i + 1]]
        if context_len == 0:
            assert rows.eq(0).all()
            continue
        slots = [(int(meta.block_tables[i, j // 16]), j % 16) for j in range(context_len)]
        k = torch.stack([k_cache[b, o] for b, o in slots]).double().repeat_interleave(3, dim=1)  # [L, Hq, D]
        v = torch.stack([v_cache[b, o] for b, o in slots]).double().repeat_interleave(3, dim=1)
        scores = torch.einsum("qhd,lhd->hql", q[cu[i]:cu[i + 1]].double(), k) * 0.2
        positions = torch.arange(context_len - query_len, context_len)
        scores = scores.masked_fill(torch.arange(context_len)[None, None, :] > positions[None, :, None], float("-inf"))
        expected = torch.einsum("hql,lhd->qhd", scores.softmax(-1), v)
        torch.testing.assert_close(rows.double(), expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ sliding window and logit soft-capping


def _naive_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, sliding_window: int | None = None,
                     logit_softcap: float | None = None) -> torch.Tensor:
    """Each sequence's attention in float64 from its whole score matrix, keys read position by position: the token
    at position p sees key j iff j <= p and p - j < sliding_window (transformers' sliding_window_causal_mask_function),
    its scores capped to cap * tanh(score / cap) before the softmax. A token without keys gets zeros."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    cu = meta.cu_query_lens.tolist()
    for i, context_len in enumerate(meta.context_lens.tolist()):
        query_len = cu[i + 1] - cu[i]
        if query_len == 0 or context_len == 0:
            continue
        slots = [(int(meta.block_tables[i, j // block_size]), j % block_size) for j in range(context_len)]
        k = torch.stack([k_cache[b, o] for b, o in slots]).double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = torch.stack([v_cache[b, o] for b, o in slots]).double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,lhd->hql", q[cu[i]:cu[i + 1]].double(), k) * scale
        if logit_softcap is not None:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        positions = torch.arange(context_len - query_len, context_len)[:, None]
        keys = torch.arange(context_len)[None, :]
        visible = keys <= positions
        if sliding_window is not None:
            visible &= positions - keys < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[cu[i]:cu[i + 1]] = torch.einsum("hql,lhd->qhd", scores.softmax(-1), v)
    return out


# The optional features, alone and together. Against contexts of 5 to 70 tokens, a window of 1 (each token sees
# itself alone), 7 (inside a block), 20 (shorter than most contexts, equal to one of _PREFILL_BATCHES' "chunked"),
# 100 (longer than every context: no effect); a cap of 2 bends scores of the test's size (about +-1 .. 4).
_FEATURES = {
    "window1": dict(sliding_window=1),
    "window7": dict(sliding_window=7),
    "window20": dict(sliding_window=20),
    "window100": dict(sliding_window=100),
    "softcap": dict(logit_softcap=2.0),
    "window7-softcap": dict(sliding_window=7, logit_softcap=2.0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("features", list(_FEATURES))
@pytest.mark.parametrize("batch", [*_REF_BATCHES, "decodes-first"])
def test_paged_attention_ref_with_window_and_softcap_equals_naive(batch: str, features: str,
                                                                  dtype: torch.dtype) -> None:
    """The reference's batched paths (prefill, chunked prefill, decode, mixed steps, one sequence alone) against
    each sequence's whole score matrix with the window's mask and the cap."""
    query_lens, context_lens = _DECODES_FIRST if batch == "decodes-first" else _REF_BATCHES[batch]
    q, k_cache, v_cache, meta = _paged_batch(query_lens, context_lens, 6, 2, 32, 16, dtype)
    if batch == "decodes-first":
        meta.num_decodes = 3
    q = (3 * q.float()).to(dtype)  # (scores of a few units, so that the cap bends them)
    out = paged_attention_ref(q, k_cache, v_cache, meta, 0.2, **_FEATURES[features])
    expected = _naive_attention(q, k_cache, v_cache, meta, 0.2, **_FEATURES[features])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


def test_window_and_softcap_change_the_result() -> None:
    """The features are not vacuous in these tests: a window shorter than the context and the cap each change the
    output; a window longer than every context changes nothing."""
    q, k_cache, v_cache, meta = _paged_batch(*_PREFILL_BATCHES["chunked"], 6, 2, 32, 16, torch.float32)
    q = 3 * q
    plain = paged_attention_ref(q, k_cache, v_cache, meta, 0.2)
    for features in ("window7", "window20", "softcap"):
        changed = paged_attention_ref(q, k_cache, v_cache, meta, 0.2, **_FEATURES[features])
        assert (changed - plain).abs().max() > 1e-2, features
    assert torch.equal(paged_attention_ref(q, k_cache, v_cache, meta, 0.2, sliding_window=100), plain)


_FEATURE_SHAPES = [(6, 2, 64, 16, torch.float32), (4, 1, 64, 16, torch.float16)]


@pytest.mark.parametrize("shape", _FEATURE_SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv-d{s[2]}-bs{s[3]}-{s[4]}")
@pytest.mark.parametrize("features", list(_FEATURES))
@pytest.mark.parametrize("batch", ["ragged", "chunked"])
@pytest.mark.parametrize("config", [None, (16, 16, 4, 1)], ids=["default-tiles", "small-tiles"])
def test_paged_prefill_with_window_and_softcap(shape: tuple, features: str, batch: str,
                                               config: tuple[int, int, int, int] | None) -> None:
    """The prefill kernel against the reference: windows that start inside a tile, at a tile's first key, before
    the tile's first row (tiles that its window skips) and not at all."""
    q, k_cache, v_cache, meta = _paged_batch(*_PREFILL_BATCHES[batch], *shape)
    q = (3 * q.float()).to(shape[4])
    expected = paged_attention_ref(q, k_cache, v_cache, meta, 0.125, **_FEATURES[features])
    out = paged_prefill_triton(q, k_cache, v_cache, meta, 0.125, config=config, **_FEATURES[features])
    _close(out, expected)


def _poison_outside_windows(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                            sliding_window: int) -> None:
    """NaN in every key and value that all of a sequence's new tokens' windows leave out (a kernel that reads one
    fails): for a decode token, those before the window of its one token."""
    block_size = k_cache.shape[1]
    cu = meta.cu_query_lens.tolist()
    for i, context_len in enumerate(meta.context_lens.tolist()):
        first_position = context_len - max(cu[i + 1] - cu[i], 1)
        for j in range(max(first_position - sliding_window + 1, 0)):
            block = int(meta.block_tables[i, j // block_size])
            k_cache[block, j % block_size] = float("nan")
            v_cache[block, j % block_size] = float("nan")


@pytest.mark.parametrize("shape", _FEATURE_SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv-d{s[2]}-bs{s[3]}-{s[4]}")
@pytest.mark.parametrize("features", list(_FEATURES))
@pytest.mark.parametrize("num_splits,config", [(None, None), (3, None), (4, (32, 4, 1))],
                         ids=["default", "3-splits", "4-splits-block32"])
def test_paged_decode_with_window_and_softcap(shape: tuple, features: str, num_splits: int | None,
                                              config: tuple[int, int, int] | None) -> None:
    """The decode kernel and its combine against the reference, on the contexts of test_paged_decode and one of
    300 tokens (19 blocks). Every key outside a token's window is NaN: the splits must start at the window."""
    query_lens, context_lens = [1, 1, 0, 1, 1, 1], [5, 2 * shape[3] + 3, 9, 70, 0, 300]
    q, k_cache, v_cache, meta = _paged_batch(query_lens, context_lens, *shape)
    q = (3 * q.float()).to(shape[4])
    options = _FEATURES[features]
    expected = paged_attention_ref(q, k_cache, v_cache, meta, 0.125, **options)
    if "sliding_window" in options:
        _poison_outside_windows(k_cache, v_cache, meta, options["sliding_window"])
    if num_splits is None:
        out = paged_attention_triton(q, k_cache, v_cache, meta, 0.125, **options)
    else:
        out = paged_decode_triton(q, k_cache, v_cache, meta, 0.125, num_splits=num_splits, config=config, **options)
    _close(out, expected)


# The engine gives back the blocks that fell out of a window (BlockManager.remove_skipped_blocks), so another
# sequence's K/V, even NaN, may sit before a step's windows: chunks whose window starts inside a tile of keys, before
# the tile of their first query, and (window 7 under 32- or 64-key tiles) inside the causal band's first tile.
_WINDOW_BATCHES = {"chunked": _PREFILL_BATCHES["chunked"], "one-chunk": ([10], [70]), "mixed": _DECODES_FIRST,
                   "decode": _REF_BATCHES["decode"]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("features", ["window1", "window7", "window20", "window7-softcap"])
@pytest.mark.parametrize("batch", list(_WINDOW_BATCHES))
def test_paged_attention_ref_reads_nothing_before_the_windows(batch: str, features: str, dtype: torch.dtype) -> None:
    """The reference's paths (one sequence's chunk, a padded batch of chunks, decodes, a mixed step) with every key
    before a sequence's windows NaN: what it gave with them whole."""
    q, k_cache, v_cache, meta = _paged_batch(*_WINDOW_BATCHES[batch], 6, 2, 32, 16, dtype)
    q = (3 * q.float()).to(dtype)
    expected = paged_attention_ref(q, k_cache, v_cache, meta, 0.2, **_FEATURES[features])
    _poison_outside_windows(k_cache, v_cache, meta, _FEATURES[features]["sliding_window"])
    _close(paged_attention_ref(q, k_cache, v_cache, meta, 0.2, **_FEATURES[features]), expected)


@pytest.mark.parametrize("shape", _FEATURE_SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv-d{s[2]}-bs{s[3]}-{s[4]}")
@pytest.mark.parametrize("features", ["window7", "window20", "window7-softcap"])
@pytest.mark.parametrize("batch", ["chunked", "one-chunk"])
@pytest.mark.parametrize("config", [None, (16, 16, 4, 1)], ids=["default-tiles", "small-tiles"])
def test_paged_prefill_reads_nothing_before_the_windows(shape: tuple, features: str, batch: str,
                                                        config: tuple[int, int, int, int] | None) -> None:
    """The prefill kernel with every key before a sequence's windows NaN, against the reference on the whole keys."""
    q, k_cache, v_cache, meta = _paged_batch(*_WINDOW_BATCHES[batch], *shape)
    q = (3 * q.float()).to(shape[4])
    expected = paged_attention_ref(q, k_cache, v_cache, meta, 0.125, **_FEATURES[features])
    _poison_outside_windows(k_cache, v_cache, meta, _FEATURES[features]["sliding_window"])
    _close(paged_prefill_triton(q, k_cache, v_cache, meta, 0.125, config=config, **_FEATURES[features]), expected)


@pytest.mark.parametrize("sliding_window", [1, 40, 64, 65, 1000])
def test_long_decode_reads_only_its_window(sliding_window: int) -> None:
    """A context of 2,000 tokens (125 blocks) under windows of one token, of less than, exactly and just over one
    64-key tile, and longer than the context: the grid sized for the batch's longest context (a CUDA graph's) or
    for the window, the keys outside the window NaN."""
    q, k_cache, v_cache, meta = _paged_batch([1, 1], [2000, 50], 4, 2, 64, 16, torch.float32)
    expected = paged_attention_ref(q, k_cache, v_cache, meta, 0.125, sliding_window=sliding_window)
    _poison_outside_windows(k_cache, v_cache, meta, sliding_window)
    _close(paged_attention_triton(q, k_cache, v_cache, meta, 0.125, sliding_window=sliding_window), expected)
    meta.max_context_len = 8192
    _close(paged_decode_triton(q, k_cache, v_cache, meta, 0.125, num_splits=64, sliding_window=sliding_window),
           expected)


@pytest.mark.parametrize("shape", _FEATURE_SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv-d{s[2]}-bs{s[3]}-{s[4]}")
@pytest.mark.parametrize("features", list(_FEATURES))
def test_mixed_step_with_window_and_softcap(shape: tuple, features: str) -> None:
    """A mixed step whose decodes come first (meta.num_decodes: they go to the decode kernel, the others to the
    prefill kernel), against the reference."""
    q, k_cache, v_cache, meta = _paged_batch(*_DECODES_FIRST, *shape)
    q = (3 * q.float()).to(shape[4])
    expected = paged_attention_ref(q, k_cache, v_cache, meta, 0.125, **_FEATURES[features])
    meta = dataclasses.replace(meta, num_decodes=3)
    _close(paged_attention_triton(q, k_cache, v_cache, meta, 0.125, **_FEATURES[features]), expected)


# kv_cache_dtype="fp8": the kernels read the float8 cache as the query's dtype (exact: every e4m3 value is one of
# float16's, bfloat16's and float32's; a bfloat16 query is multiplied as float16, attention._query_for), the
# reference as float32, so they agree as closely as with a cache of the query's dtype. Unowned slots stay NaN
# (e4m3fn has a NaN).
_FP8_SHAPES = [(8, 2, 64, 32, torch.float32), (6, 2, 64, 16, torch.float32), (4, 1, 64, 16, torch.float16),
               (8, 2, 64, 16, torch.bfloat16)]


def _close_fp8_attention(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """_close, but a bfloat16 output as the GPU tests judge attention (assert_bf16_attention_close)."""
    if actual.dtype != torch.bfloat16:
        return _close(actual, expected)
    assert_bf16_attention_close(actual, expected)


def _fp8_paged_batch(query_lens: list[int], context_lens: list[int], shape: tuple) -> tuple:
    num_q_heads, num_kv_heads, head_dim, block_size, dtype = shape
    q, k_cache, v_cache, meta = _paged_batch(query_lens, context_lens, num_q_heads, num_kv_heads, head_dim,
                                             block_size, torch.float32)
    return q.to(dtype), k_cache.to(FP8), v_cache.to(FP8), meta


@pytest.mark.usefixtures("fp8_casts_as_on_the_gpu")
@pytest.mark.parametrize("shape", _FP8_SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv-d{s[2]}-bs{s[3]}-{s[4]}")
@pytest.mark.parametrize("num_splits,config", [(None, None), (3, None), (4, (32, 4, 1)), (1, (128, 4, 1))],
                         ids=["default", "3-splits", "4-splits-block32", "block128"])
def test_paged_decode_fp8_cache(shape: tuple, num_splits: int | None, config: tuple[int, int, int] | None) -> None:
    q, k_cache, v_cache, meta = _fp8_paged_batch([1, 1, 0, 1, 1], [5, 2 * shape[3] + 3, 9, 70, 0], shape)
    scale = shape[2] ** -0.5
    expected = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    if num_splits is None:
        out = paged_attention_triton(q, k_cache, v_cache, meta, scale)
    else:
        out = paged_decode_triton(q, k_cache, v_cache, meta, scale, num_splits=num_splits, config=config)
    assert out.dtype == q.dtype
    _close_fp8_attention(out, expected)


@pytest.mark.usefixtures("fp8_casts_as_on_the_gpu")
@pytest.mark.parametrize("shape", _FP8_SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv-d{s[2]}-bs{s[3]}-{s[4]}")
@pytest.mark.parametrize("batch", list(_PREFILL_BATCHES))
@pytest.mark.parametrize("config", [None, (16, 16, 4, 1)], ids=["default-tiles", "small-tiles"])
def test_paged_prefill_fp8_cache(shape: tuple, batch: str, config: tuple[int, int, int, int] | None) -> None:
    q, k_cache, v_cache, meta = _fp8_paged_batch(*_PREFILL_BATCHES[batch], shape)
    scale = shape[2] ** -0.5
    expected = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    out = (paged_attention_triton(q, k_cache, v_cache, meta, scale) if config is None
           else paged_prefill_triton(q, k_cache, v_cache, meta, scale, config=config))
    _close_fp8_attention(out, expected)


# ------------------------------------------------------------------------------------------------- sampling


def _params(rows: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    return (
        torch.full((rows,), temperature),
        torch.full((rows,), top_k, dtype=torch.int64),
        torch.full((rows,), top_p),
        torch.full((rows,), min_p),
    )


def test_sample_greedy_and_top_k_1_are_argmax() -> None:
    logits = torch.randn(6, 5000)  # two vocabulary tiles per row
    temperature, top_k, top_p, min_p = _params(6, top_p=0.9)
    temperature[:3] = 0.0  # greedy rows beside sampled ones
    top_k[3:] = 1  # top_k = 1 leaves only the argmax
    out = sample_triton(logits, temperature, top_k, top_p, min_p, torch.arange(6))
    assert out.tolist() == logits.argmax(-1).tolist()
    temperature.zero_()
    out = sample_triton(logits, temperature, top_k, top_p, min_p, torch.arange(6))
    assert out.tolist() == logits.argmax(-1).tolist()


def test_sample_depends_only_on_own_row_and_seed() -> None:
    logits = torch.randn(5, 300)
    temperature, top_k, top_p, min_p = _params(5, temperature=1.5, top_k=40)
    top_p[1], min_p[2], top_k[3] = 0.7, 0.05, 0
    seeds = torch.tensor([11, 22, 33, 44, 55])
    together = sample_triton(logits, temperature, top_k, top_p, min_p, seeds)
    for row in range(5):
        alone = sample_triton(
            logits[row : row + 1], temperature[row : row + 1], top_k[row : row + 1], top_p[row : row + 1],
            min_p[row : row + 1], seeds[row : row + 1],
        )
        assert alone.item() == together[row].item()
    flipped = sample_triton(
        logits.flip(0), temperature.flip(0), top_k.flip(0), top_p.flip(0), min_p.flip(0), seeds.flip(0)
    )
    assert flipped.flip(0).tolist() == together.tolist()


# chi-square critical values at p = 1e-4 for 1..7 degrees of freedom
_CHI2_CRITICAL = [15.14, 18.42, 21.11, 23.51, 25.74, 27.86, 29.88]


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(0.7, 0, 0.8, 0.0), (1.3, 5, 1.0, 0.0), (1.0, 0, 1.0, 0.1), (2.0, 6, 0.9, 0.02)],
)
def test_sample_frequencies_follow_truncated_softmax(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    draws = 2000
    logits = torch.tensor([0.3, -1.2, 1.1, 2.0, 2.4, -0.2, 0.9, 0.0])
    # the truncated tempered distribution, from the reference's rules
    probs = (logits / temperature).softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    rank = torch.arange(8)
    drop = (rank >= (top_k if top_k > 0 else 8)) | (sorted_probs.cumsum(0) - sorted_probs >= top_p)
    drop |= sorted_probs < min_p * sorted_probs[0]
    drop[0] = False
    expected = torch.zeros(8).scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    expected = expected / expected.sum()

    params = _params(draws, temperature, top_k, top_p, min_p)
    out = sample_triton(logits.repeat(draws, 1), *params, torch.arange(draws) * 7919 + 1)
    counts = torch.bincount(out, minlength=8).double()
    kept = expected > 0
    assert counts[~kept].sum() == 0, f"masked tokens drawn: {counts.tolist()}"
    chi2 = float(((counts[kept] - draws * expected[kept]) ** 2 / (draws * expected[kept])).sum())
    assert chi2 < _CHI2_CRITICAL[int(kept.sum()) - 2], f"chi2={chi2:.1f}, counts={counts.tolist()}"


# The kernels split each row into chunks of chunk_size tokens (separate programs), then reduce the chunks'
# winners: the tests force small chunks and blocks so that a row spans several chunks and a chunk several blocks.


def _mixed_params() -> tuple[torch.Tensor, ...]:
    """Ten rows: greedy ones (row 7 with top-k/top-p/min-p set, ignored), temperature alone, top-k, top-p,
    min-p, their mixtures, and T < 0 (sampled at T = 1)."""
    return (
        torch.tensor([0.0, 0.6, 1.0, 1.5, -1.0, 0.8, 0.9, 0.0, 1.2, 0.7]),
        torch.tensor([0, 0, 40, 0, 0, 5, 0, 7, 30, 0]),
        torch.tensor([1.0, 1.0, 1.0, 0.8, 1.0, 0.9, 1.0, 0.5, 0.95, 1.0]),
        torch.tensor([0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.05, 0.2, 0.02, 0.3]),
        torch.arange(10) * 7919 + 3,
    )


@pytest.mark.parametrize("vocab,chunkings", [
    (300, [(64, None), (100, 32)]),  # the whole row in one program packs 4 rows per program
    (3000, [(None, None), (1000, None), (768, 256)]),
])
def test_sample_chunking_does_not_change_the_draw(vocab: int, chunkings: list) -> None:
    logits = 3 * torch.randn(10, vocab, generator=torch.Generator().manual_seed(vocab))
    temperature, top_k, top_p, min_p, seeds = params = _mixed_params()
    whole = sample_triton(logits, *params, chunk_size=vocab)
    assert logits[temperature == 0].argmax(-1).tolist() == whole[temperature == 0].tolist()
    assert len(set(whole[temperature != 0].tolist())) > 4  # sampled rows do not all collapse to the argmax
    for chunk_size, block in chunkings:
        chunked = sample_triton(logits, *params, True, 40, True, chunk_size=chunk_size, block=block)
        assert chunked.tolist() == whole.tolist(), (chunk_size, block)


@pytest.mark.parametrize("vocab,chunk_size,block", [(3000, None, None), (3000, 1024, None), (3000, 700, 128),
                                                    (300, None, None), (300, 64, 16)])
def test_sample_greedy_rows_are_argmax_with_ties(vocab: int, chunk_size: int | None, block: int | None) -> None:
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(1))
    logits[0] = torch.randint(-3, 4, (vocab,), generator=torch.Generator().manual_seed(2)).float()  # many ties
    logits[1, [vocab - 1, vocab // 3, vocab // 2]] = 9.0  # the first of three maxima, spread over the chunks
    boundary = 1024 if vocab > 1024 else 64
    logits[2, [boundary, boundary - 1]] = 9.0  # tied across a chunk (or a block) boundary
    logits[3] = 0.5  # all equal: token 0
    logits[4] = float("-inf")  # torch.argmax says 0
    logits[5, vocab - 1] = 9.0  # the last token
    logits[6] = -logits[6].abs() - 1  # sampled at T = 1e-39: every x/T is -inf, so the race falls back to argmax
    temperature, top_k, top_p, min_p = _params(8)
    temperature[:6], temperature[6] = 0.0, 1e-39  # row 7 is sampled beside the greedy ones
    for dtype in (torch.float32, torch.float16):
        x = logits.to(dtype)
        expected = x.argmax(-1)
        out = sample_triton(x, temperature, top_k, top_p, min_p, torch.arange(8), chunk_size=chunk_size, block=block)
        assert out[:7].tolist() == expected[:7].tolist(), dtype
        greedy = sample_triton(x, torch.zeros(8), top_k, top_p, min_p, torch.arange(8), False, 0, False,
                               chunk_size=chunk_size, block=block)
        assert greedy.tolist() == expected.tolist(), dtype


def test_sample_min_p_rows_beside_others() -> None:
    rows, vocab = 24, 3000
    logits = 2 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3))
    # min_p 0.3 at T = 1 keeps the few tokens within log(0.3) of the max: without it most of the mass is below
    min_p = torch.tensor([0.0, 0.3, 0.05, 1.5, 0.2, 0.0] * 4)
    temperature = torch.tensor([1.0, 1.0, 0.7, 1.0, 0.0, 1.3] * 4)
    top_k = torch.tensor([0, 0, 20, 0, 0, 0] * 4)
    top_p, seeds = torch.ones(rows), torch.arange(rows) + 100
    hinted = sample_triton(logits, temperature, top_k, top_p, min_p, seeds, False, 20, True, chunk_size=1000)
    assert sample_triton(logits, temperature, top_k, top_p, min_p, seeds, chunk_size=1000).tolist() == hinted.tolist()
    assert sample_triton(logits, temperature, top_k, top_p, min_p, seeds, False, 20, chunk_size=1000).tolist() == (
        hinted.tolist()
    )
    assert sample_triton(logits, temperature, top_k, top_p, min_p, seeds, chunk_size=vocab).tolist() == hinted.tolist()
    chosen = logits.gather(1, hinted[:, None]).squeeze(1)
    row_max = logits.max(-1).values
    with_min_p = min_p > 0
    # p_token >= min_p * p_max: x >= x_max + T log(min_p), and only the argmax above min_p = 1
    threshold = row_max + temperature.clamp(min=1e-6) * min_p.clamp(max=1).log()
    assert (chosen[with_min_p] >= threshold[with_min_p] - 1e-5).all()
    assert hinted[min_p > 1].tolist() == logits[min_p > 1].argmax(-1).tolist()
    assert hinted[temperature == 0].tolist() == logits[temperature == 0].argmax(-1).tolist()
    assert (chosen[min_p == 0.3] < row_max[min_p == 0.3]).any()  # min_p = 0.3 rows do not all take the argmax
    # the rows without min-p draw the same tokens from the one-pass kernel (use_min_p=False), without the others
    plain = ~with_min_p
    alone = sample_triton(logits[plain], temperature[plain], top_k[plain], top_p[plain], min_p[plain], seeds[plain],
                          False, 20, False, chunk_size=1000)
    assert alone.tolist() == hinted[plain].tolist()


_SYNCING = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def test_sample_with_hints_reads_nothing_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine launches the next step before it reads this one's tokens: given the hints, the wrapper must
    not read a tensor back to the host (the interpreter itself does, on the CPU; only sampling.py is counted)."""
    reads: list[str] = []
    for name in _SYNCING:
        original = getattr(torch.Tensor, name)

        def spy(self: torch.Tensor, *args, _name: str = name, _original=original, **kwargs):
            import sys

            if sys._getframe(1).f_code.co_filename.endswith("sampling.py"):
                reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    logits = torch.randn(3, 2000)
    temperature, top_k, top_p, min_p = _params(3, temperature=0.8, top_k=10, top_p=0.9, min_p=0.05)
    seeds = torch.arange(3)
    sample_triton(logits, temperature, top_k, top_p, min_p, seeds, True, 10, True, chunk_size=512)
    sample_triton(logits, temperature, top_k, top_p, min_p, seeds, True, 10, chunk_size=512)  # use_min_p unknown
    assert reads == []
    sample_triton(logits, temperature, top_k, top_p, min_p, seeds, chunk_size=512)
    assert reads == ["tolist"]  # without the hints: the one sync, which the spy does see


# ---------------------------------------------------------------------------------------------- decode graph inputs

@pytest.mark.parametrize("width", [0, 3, 7])
def test_unpack_decode_inputs(width: int) -> None:
    """The decode graphs' first op: tokens in flight gathered from the step before's, the packed [B, width] block
    tables spread into the [B, max_blocks] buffer (entries past width kept), width read from device memory."""
    from tinyvllm.ops.decode_inputs import unpack_decode_inputs_ref, unpack_decode_inputs_triton

    num_rows, max_blocks = 5, 7
    ids = torch.randint(0, 1000, (num_rows,))
    pending = torch.tensor([-1, 3, -1, 0, 5])
    tokens = torch.randint(0, 1000, (8,))
    packed = torch.randint(0, 100, (num_rows * max_blocks,), dtype=torch.int32)
    tables = torch.randint(0, 100, (num_rows, max_blocks), dtype=torch.int32)
    width_t = torch.tensor([width], dtype=torch.int32)
    results = []
    for op in (unpack_decode_inputs_ref, unpack_decode_inputs_triton):
        out_ids, out_tables = ids.clone(), tables.clone()
        op(out_ids, pending, tokens, packed, width_t, out_tables)
        results.append((out_ids, out_tables))
    expected_ids = torch.where(pending >= 0, tokens[pending.clamp(min=0)], ids)
    expected_tables = tables.clone()
    expected_tables[:, :width] = packed[: num_rows * width].view(num_rows, width)
    for out_ids, out_tables in results:
        assert torch.equal(out_ids, expected_ids)
        assert torch.equal(out_tables, expected_tables)


@triton.jit
def _exponential_kernel(out_ptr, r_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    r = tl.load(r_ptr + offs, mask=offs < n, other=0).to(tl.uint32)
    tl.store(out_ptr + offs, _exponential(r, False), mask=offs < n)


def test_race_noise_is_exponential_to_1e_6() -> None:
    """The sampler's E = -ln(U) from 32-bit integers, against float64, where it matters most (U near 1: the race's
    winners), where its two formulas meet (d = 1/8) and at both ends. (The GPU takes log2 from lg2.approx instead
    of tl.log2, in the same formula.)"""
    switch = 2**32 - 2**29  # d = 1 - U crosses 1/8 here
    edges = [0, 1, 2, 1000, 2**31, switch - 2, switch - 1, switch, switch + 1, 2**32 - 1000, 2**32 - 2, 2**32 - 1]
    r = torch.tensor(edges + torch.randint(0, 2**32, (500,), generator=torch.Generator().manual_seed(0)).tolist(),
                     dtype=torch.int64)
    out = torch.full(r.shape, float("nan"))
    _exponential_kernel[(1,)](out, r, r.numel(), BLOCK=triton.next_power_of_2(r.numel()))
    d = (2**32 - 1 - r.double() + 0.5) / 2**32
    expected = -torch.log1p(-d)
    error = ((out.double() - expected) / expected).abs()
    assert float(error.max()) < 1e-6, (r[error.argmax()].item(), float(error.max()))
