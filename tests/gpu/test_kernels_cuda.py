"""Every Triton kernel against its PyTorch reference on a CUDA GPU, at real shapes (Llama-3.2-1B: hidden 2048,
32 query / 8 KV heads of dim 64, MLP 8192, vocabulary 128256, block size 16), in bfloat16 and float32, on fresh
random inputs. The reference runs in float32 on the same (rounded) inputs; the error is ||out - ref|| / ||ref||,
against 1e-2 for bfloat16 and 1e-5 for float32. Outputs the kernels allocate are poisoned with NaN (or -1 for
integers), so an unwritten element fails. The kernels that read or write the KV cache are checked with float8 e4m3
caches too (kv_cache_dtype="fp8", at the end).

    python -m pytest -m cuda tests/gpu/test_kernels_cuda.py      (on a GPU machine; skipped elsewhere)
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tests.utils import CUDA_ONLY, attention_metadata, relative_error  # noqa: E402
from tinyvllm.ops import kv_pool  # noqa: E402
from tinyvllm.ops.activation import (  # noqa: E402
    gelu_tanh_and_mul_ref,
    gelu_tanh_and_mul_triton,
    silu_and_mul_ref,
    silu_and_mul_triton,
)
from tinyvllm.ops.attention import AttentionMetadata, paged_attention_ref, paged_attention_triton  # noqa: E402
from tinyvllm.ops.bitmask import apply_token_bitmask_ref, apply_token_bitmask_triton  # noqa: E402
from tinyvllm.ops.cascade_attention import cascade_attention_triton  # noqa: E402
from tinyvllm.ops.decode_inputs import unpack_decode_inputs_ref, unpack_decode_inputs_triton  # noqa: E402
from tinyvllm.ops.embedding import embedding_ref, embedding_triton  # noqa: E402
from tinyvllm.ops.fused_linear import (  # noqa: E402
    fused_linear_ref,
    fused_linear_triton,
    fused_norm_linear_ref,
    fused_norm_linear_triton,
    linear_argmax_triton,
)
from tinyvllm.ops.layernorm import (  # noqa: E402
    RowNorm,
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm_ref,
    rms_norm_triton,
)
from tinyvllm.ops.logprobs import token_logprobs_ref, token_logprobs_triton  # noqa: E402
from tinyvllm.ops.rotary import (  # noqa: E402
    RopeStore,
    build_cos_sin_cache,
    rope_store_ref,
    rope_store_triton,
    rotary_embedding_and_store_ref,
    rotary_embedding_and_store_triton,
    rotary_embedding_ref,
    to_cache_dtype_ref,
)
from tinyvllm.ops.sampling import _exponential, sample_triton  # noqa: E402

pytestmark = CUDA_ONLY

DEVICE = "cuda"
HIDDEN, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, BLOCK_SIZE = 2048, 32, 8, 64, 8192, 128256, 16
LLAMA3_SCALING = {
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}
DTYPES = [pytest.param(torch.bfloat16, id="bfloat16"), pytest.param(torch.float32, id="float32")]
TOKEN_COUNTS = [1, 7, 1000, 8192]


@pytest.fixture(autouse=True)
def seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def cos_sin_cache() -> torch.Tensor:
    return build_cos_sin_cache(HEAD_DIM, 131072, 500000.0, LLAMA3_SCALING, torch.device(DEVICE))


_real_empty = torch.empty


def _poisoned_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
    """torch.empty whose memory is NaN (floats) or -1 (integers), so that an unwritten output shows."""
    t = _real_empty(*args, **kwargs)
    return t.fill_(float("nan") if t.is_floating_point() else -1)


@contextmanager
def poisoned_empty() -> Iterator[None]:
    torch.empty = _poisoned_empty
    try:
        yield
    finally:
        torch.empty = _real_empty


def poisoned(fn: Callable, *args: Any) -> Any:
    """fn(*args) with every torch.empty it calls poisoned."""
    with poisoned_empty():
        return fn(*args)


def assert_close(what: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """||out - ref|| / ||ref|| within the dtype's tolerance, and out finite."""
    out, ref = out.double(), ref.double()
    rel = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
    finite = bool(torch.isfinite(out).all())
    tol = TOLERANCE[dtype]
    assert finite, f"{what}: {int((~torch.isfinite(out)).sum())} non-finite output values (rel_err={rel:.2e})"
    assert rel <= tol, f"{what}: rel_err={rel:.2e} > tol {tol:.0e}"


def short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def captured(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """fn captured in a CUDA graph, and what the capture returned (its buffers, which replays rewrite): fn runs
    once first to compile its kernels and once on a side stream, as torch recommends before a capture."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def case_batch(spec: dict, build: Callable[..., tuple]) -> tuple:
    """build(**spec)'s batch (q, k_cache, v_cache, meta); a "max_context_len" in spec is set on meta afterwards,
    as a CUDA graph captured for longer contexts launches, and a "num_decodes" too (a mixed step whose one-token
    sequences come first, as the model runner orders them)."""
    spec = dict(spec)
    max_context_len = spec.pop("max_context_len", None)
    num_decodes = spec.pop("num_decodes", 0)
    batch = build(**spec)
    if max_context_len is not None:
        batch[3].max_context_len = max_context_len
    batch[3].num_decodes = num_decodes
    return batch


def assert_argmax_up_to_rounding(what: str, tokens: torch.Tensor, logits: torch.Tensor, dtype: torch.dtype) -> None:
    """The greedy tokens of float32 `logits` as the LM head's argmax kernel picks them: in float32 torch.argmax;
    in bfloat16 a token whose logit is the row's largest up to rounding (the kernel takes the max of the logits
    rounded to bfloat16, as the sampler reads cuBLAS's, which merges values within one bfloat16 step of each
    other, and accumulation order can swap near-ties)."""
    if dtype == torch.float32:
        assert torch.equal(tokens, logits.argmax(-1)), f"{what}: {tokens.tolist()} != {logits.argmax(-1).tolist()}"
    row_max = logits.max(-1).values
    gap = row_max - logits.gather(1, tokens[:, None]).squeeze(1)
    step = 0.0 if dtype == torch.float32 else 2.0 ** (torch.floor(torch.log2(row_max.abs())) - 7)  # bf16: 8 bits
    excess = (gap - step).max()
    assert float(excess) <= 1e-3 * float(logits.abs().max()), f"{what}: a token's logit is {gap.tolist()} below the max"


# ---------------------------------------------------------------------------------------------- elementwise


@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding(dtype: torch.dtype, tokens: int) -> None:
    weight = torch.randn(VOCAB, HIDDEN, device=DEVICE).to(dtype)
    ids = torch.randint(0, VOCAB, (tokens,), device=DEVICE)
    assert_close(f"embedding T={tokens} {short(dtype)}", poisoned(embedding_triton, ids, weight),
                 embedding_ref(ids, weight.float()), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_apply_token_bitmask(dtype: torch.dtype, rows: int) -> None:
    """Structured output's mask on a batch's logits (128,256-token vocabulary), half of the rows constrained: exactly
    the reference (it only writes -inf)."""
    logits = torch.randn(rows, VOCAB, device=DEVICE).to(dtype)
    constrained = torch.arange(0, rows, 2, device=DEVICE)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(constrained), (VOCAB + 31) // 32), dtype=torch.int32,
                            device=DEVICE)
    expected = apply_token_bitmask_ref(logits.clone(), bitmask, constrained)
    assert torch.equal(apply_token_bitmask_triton(logits.clone(), bitmask, constrained), expected)


def norm_inputs(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, a residual of larger scale, and an RMSNorm weight near 1."""
    norm_weight = (1 + 0.1 * torch.randn(HIDDEN, device=DEVICE)).to(dtype)
    x = torch.randn(tokens, HIDDEN, device=DEVICE).to(dtype)
    residual = (4 * torch.randn(tokens, HIDDEN, device=DEVICE)).to(dtype)
    return x, residual, norm_weight


@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype: torch.dtype, tokens: int) -> None:
    x, _, norm_weight = norm_inputs(tokens, dtype)
    assert_close(f"rms_norm T={tokens} {short(dtype)}", poisoned(rms_norm_triton, x, norm_weight, 1e-5),
                 rms_norm_ref(x.float(), norm_weight.float(), 1e-5), dtype)


@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype: torch.dtype, tokens: int) -> None:
    x, residual, norm_weight = norm_inputs(tokens, dtype)
    normed, new_residual = poisoned(fused_add_rms_norm_triton, x, residual, norm_weight, 1e-5)
    ref_normed, ref_residual = fused_add_rms_norm_ref(x.float(), residual.float(), norm_weight.float(), 1e-5)
    assert_close(f"fused_add_rms_norm T={tokens} {short(dtype)} (normed)", normed, ref_normed, dtype)
    assert_close(f"fused_add_rms_norm T={tokens} {short(dtype)} (residual)", new_residual, ref_residual, dtype)


@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype, tokens: int) -> None:
    gate_up = (2 * torch.randn(tokens, 2 * INTERMEDIATE, device=DEVICE)).to(dtype)
    assert_close(f"silu_and_mul T={tokens} {short(dtype)}", poisoned(silu_and_mul_triton, gate_up),
                 silu_and_mul_ref(gate_up.float()), dtype)


@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul(dtype: torch.dtype, tokens: int) -> None:
    gate_up = (2 * torch.randn(tokens, 2 * INTERMEDIATE, device=DEVICE)).to(dtype)
    assert_close(f"gelu_tanh_and_mul T={tokens} {short(dtype)}", poisoned(gelu_tanh_and_mul_triton, gate_up),
                 gelu_tanh_and_mul_ref(gate_up.float()), dtype)


@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_with_a_folded_norm(dtype: torch.dtype, tokens: int) -> None:
    """gate_up's product of the residual stream itself (the norm's weight folded into it): gate and up scaled by
    the stream row's 1/rms first, against the float32 reference."""
    gate_up = (2 * torch.randn(tokens, 2 * INTERMEDIATE, device=DEVICE)).to(dtype)
    stream = (5 * torch.randn(tokens, HIDDEN, device=DEVICE)).to(dtype)
    out = poisoned(silu_and_mul_triton, gate_up, RowNorm(stream, 1e-5))
    ref = silu_and_mul_ref(gate_up.float(), RowNorm(stream.float(), 1e-5))
    assert_close(f"silu_and_mul with a RowNorm T={tokens} {short(dtype)}", out, ref, dtype)


@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_with_a_folded_norm(dtype: torch.dtype, tokens: int, cos_sin_cache: torch.Tensor) -> None:
    """qkv's product of the residual stream itself: q, k and v scaled by the stream row's 1/rms, then q rotated in
    place and k, v stored at their slots, against the float32 reference."""
    k_cache, v_cache, slots = random_cache_slots(tokens, dtype)
    qkv = (3 * torch.randn(tokens, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device=DEVICE)).to(dtype)
    stream = (5 * torch.randn(tokens, HIDDEN, device=DEVICE)).to(dtype)
    positions = torch.randint(0, 131072, (tokens,), device=DEVICE)
    ref_k, ref_v = k_cache.float().clone(), v_cache.float().clone()  # (clones: .float() of float32 is itself)
    ref = rope_store_ref(qkv.float().clone(), RopeStore(positions, cos_sin_cache, ref_k, ref_v, slots, NUM_Q_HEADS,
                                                        NUM_KV_HEADS), RowNorm(stream.float(), 1e-5))
    out = rope_store_triton(qkv, RopeStore(positions, cos_sin_cache, k_cache, v_cache, slots, NUM_Q_HEADS,
                                           NUM_KV_HEADS), RowNorm(stream, 1e-5))
    name = f"rope_store with a RowNorm T={tokens} {short(dtype)}"
    q_cols = NUM_Q_HEADS * HEAD_DIM
    assert_close(f"{name} (q)", out[:, :q_cols], ref[:, :q_cols], dtype)
    written = slots[slots >= 0]
    for what, cache, ref_cache in (("k", k_cache, ref_k), ("v", v_cache, ref_v)):
        assert_close(f"{name} ({what} cache)", cache.flatten(0, 1)[written], ref_cache.flatten(0, 1)[written], dtype)


def random_pool(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A K or V pool of random values, laid out as the engine lays out its pools (ops.kv_pool)."""
    pool = kv_pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, torch.device(DEVICE))
    return pool.copy_(torch.randn(pool.shape, device=DEVICE))


def random_cache_slots(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random K and V cache with room to spare, and distinct slots for `tokens` tokens, 5% padding (-1)."""
    num_blocks = tokens // BLOCK_SIZE + 64
    k_cache = random_pool(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:tokens]
    slots[torch.rand(tokens, device=DEVICE) < 0.05] = -1
    return k_cache, torch.randn_like(k_cache), slots


@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_and_store(dtype: torch.dtype, tokens: int, cos_sin_cache: torch.Tensor) -> None:
    """The fused RoPE + KV store (the only RoPE and KV-store kernel): q rotated in place; the rotated k stored at
    its slots (close to the reference); v stored bit-exact; the other slots and k itself untouched."""
    k_cache, v_cache, slots = random_cache_slots(tokens, dtype)
    qkv = torch.randn(tokens, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device=DEVICE).to(dtype)
    q, k, v = qkv.split([NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1)
    q, k, v = (x.view(tokens, -1, HEAD_DIM) for x in (q, k, v))
    positions = torch.randint(0, 131072, (tokens,), device=DEVICE)
    ref_k, ref_v = k_cache.float().clone(), v_cache.float().clone()  # (clones: .float() of float32 is itself)
    ref_q = rotary_embedding_and_store_ref(positions, q.float().clone(), k.float(), v.float(), cos_sin_cache, ref_k,
                                           ref_v, slots)
    original_k, original_cache = k.clone(), k_cache.clone()
    rotary_embedding_and_store_triton(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slots)  # q in place
    name = f"rotary_embedding_and_store T={tokens} {short(dtype)}"
    assert_close(f"{name} (q)", q, ref_q, dtype)
    written = torch.zeros(k_cache.shape[0] * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    flat_k, flat_ref_k = k_cache.flatten(0, 1), ref_k.flatten(0, 1)
    assert_close(f"{name} (k cache)", flat_k[written], flat_ref_k[written], dtype)
    assert torch.equal(v_cache, ref_v.to(dtype)), f"{name}: the V cache differs from the reference's (bit-exact)"
    assert torch.equal(flat_k[~written], original_cache.flatten(0, 1)[~written]), \
        f"{name}: a K-cache slot not in slot_mapping changed"
    assert torch.equal(k, original_k), f"{name}: k itself changed (only the cache copy is rotated)"


# ------------------------------------------------------------------------------------------------ attention


def paged_batch(
    query_lens: list[int], context_lens: list[int], dtype: torch.dtype, num_q_heads: int = NUM_Q_HEADS,
    num_kv_heads: int = NUM_KV_HEADS, head_dim: int = HEAD_DIM, block_size: int = BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q and paged KV; blocks are a random permutation of the pool and every slot no sequence
    owns is NaN (reading one poisons the output)."""
    blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 16
    order = torch.randperm(num_blocks, device=DEVICE)
    block_tables = torch.zeros(len(context_lens), max(blocks_per_seq) + 2, dtype=torch.int32, device=DEVICE)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=DEVICE)
    start = 0
    for i, context_len in enumerate(context_lens):
        blocks = order[start : start + blocks_per_seq[i]]
        start += blocks_per_seq[i]
        block_tables[i, : len(blocks)] = blocks.int()
        positions = torch.arange(context_len, device=DEVICE)
        owned[blocks[positions // block_size], positions % block_size] = True
    k_cache, v_cache = (random_pool(num_blocks, block_size, num_kv_heads, head_dim, dtype) for _ in "kv")
    k_cache[~owned], v_cache[~owned] = float("nan"), float("nan")
    q = torch.randn(sum(query_lens), num_q_heads, head_dim, device=DEVICE).to(dtype)
    return q, k_cache, v_cache, attention_metadata(query_lens, context_lens, block_tables)


def rand_lens(n: int, low: int, high: int) -> list[int]:
    return torch.randint(low, high + 1, (n,)).tolist()


def eight_prompts() -> dict:
    lens = rand_lens(8, 1, 2048)
    lens[0] = 2048
    return dict(query_lens=lens, context_lens=lens)


def eight_chunks() -> dict:
    """Chunked prefill: chunks of up to 512 new tokens on top of cached prefixes up to 4096."""
    chunks = rand_lens(8, 1, 512)
    return dict(query_lens=chunks, context_lens=[c + p for c, p in zip(chunks, rand_lens(8, 0, 4096))])


def mixed_batch() -> dict:
    """Through the prefill path: 16 decodes, an idle sequence, 4 prefill chunks."""
    query_lens = [1] * 16 + [0] + rand_lens(4, 2, 300)
    context_lens = rand_lens(16, 1, 3000) + [50] + [q + p for q, p in zip(query_lens[17:], rand_lens(4, 0, 1000))]
    return dict(query_lens=query_lens, context_lens=context_lens)


def mixed_decodes_first() -> dict:
    """A mixed step as the runner orders it: 200 decodes first (to the decode kernel), then an idle sequence and
    4 prefill chunks (to the prefill kernel)."""
    spec = mixed_batch()
    query_lens = [1] * 184 + spec["query_lens"]
    return dict(query_lens=query_lens, context_lens=rand_lens(184, 1, 3000) + spec["context_lens"], num_decodes=200)


def decode_64() -> dict:
    contexts = rand_lens(64, 1, 8192)
    contexts[0] = 8192
    return dict(query_lens=[1] * 64, context_lens=contexts)


# Each case: a function of the (seeded) random state giving paged_batch's lengths and shape, and optionally a
# max_context_len larger than the batch's (as a CUDA graph captured for longer contexts launches).
ATTENTION_CASES: dict[str, Callable[[], dict]] = {
    "8 prompts <=2048": eight_prompts,
    "8 chunks <=512 on prefixes <=4096": eight_chunks,
    "mixed 16 decodes + idle + 4 chunks": mixed_batch,
    "mixed 200 decodes first + idle + 4 chunks": mixed_decodes_first,
    # head_dim 128 (Llama-3-8B shape) and a GQA group of 3 (SmolLM2: 9 query / 3 KV heads)
    "d128 4 prompts": lambda: dict(query_lens=[700, 64, 1, 300], context_lens=[700, 64, 1, 1300], head_dim=128),
    "9q-3kv 3 chunks": lambda: dict(query_lens=[257, 31, 1], context_lens=[1000, 31, 2000], num_q_heads=9,
                                    num_kv_heads=3),
    "decode batch 64 contexts <=8192": decode_64,
    "decode batch 1 context 8192": lambda: dict(query_lens=[1], context_lens=[8192]),
    "decode batch 1 context 37": lambda: dict(query_lens=[1], context_lens=[37]),
    "decode batch 4 contexts <=3000 grid for 131072": lambda: dict(query_lens=[1] * 4,
                                                                   context_lens=rand_lens(4, 1, 3000),
                                                                   max_context_len=131072),
    "decode batch 256 contexts <=2048": lambda: dict(query_lens=[1] * 256, context_lens=rand_lens(256, 1, 2048)),
    "decode batch 8 contexts <=32768": lambda: dict(query_lens=[1] * 8, context_lens=rand_lens(8, 16384, 32768)),
    "decode d128 batch 16": lambda: dict(query_lens=[1] * 16, context_lens=rand_lens(16, 1, 4096), head_dim=128),
    "decode 9q-3kv batch 5 with an idle sequence": lambda: dict(query_lens=[1, 1, 0, 1, 1],
                                                                context_lens=[3000, 17, 40, 1, 640], num_q_heads=9,
                                                                num_kv_heads=3),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention(dtype: torch.dtype, case: str) -> None:
    q, k_cache, v_cache, meta = case_batch(ATTENTION_CASES[case](), lambda query_lens, context_lens, **spec:
                                           paged_batch(query_lens, context_lens, dtype, **spec))
    scale = q.shape[-1] ** -0.5
    t0 = time.perf_counter()
    out = poisoned(paged_attention_triton, q, k_cache, v_cache, meta, scale)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    path = "decode" if meta.is_decode else "decode + prefill" if meta.num_decodes else "prefill"
    assert_close(f"attention ({path} path) {case}, {q.shape[0]} tokens, {short(dtype)} "
                 f"({elapsed * 1e3:.0f} ms first call)", out, ref, dtype)


def test_decode_attention_in_cuda_graph() -> None:
    """Decode attention captured in a CUDA graph at max_context_len 4096, replayed on new q and shorter contexts."""
    dtype = torch.bfloat16
    batch = 32
    q, k_cache, v_cache, meta = paged_batch([1] * batch, [4096] * batch, dtype)
    scale = HEAD_DIM**-0.5
    graph, out = captured(lambda: paged_attention_triton(q, k_cache, v_cache, meta, scale))
    new_lens = torch.randint(1, 4097, (batch,), dtype=torch.int32, device=DEVICE)
    meta.context_lens.copy_(new_lens)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    assert_close("attention decode in a CUDA graph, replayed on new contexts bf16", out, ref, dtype)


@pytest.mark.parametrize("m", [1, 4, 16])
def test_decode_attention_reads_the_kv_stored_just_before(m: int, cos_sin_cache: torch.Tensor) -> None:
    """qkv's product storing each sequence's newest K and V, then decode attention, in a CUDA graph as a decode step
    runs them (with PDL on Hopper attention reads the batch's layout and prefetches its keys before it waits for
    qkv): the newest slots are NaN before each replay, so attention reading one before the store shows; its output
    against the reference on the caches the replay left."""
    dtype = torch.bfloat16
    generator, seed = fresh_generator()
    context_lens = rand_lens(m, 1, 512)
    _, k_cache, v_cache, meta = paged_batch([1] * m, context_lens, dtype)
    n, k = FUSED_SHAPES["qkv"]
    w = rand(n, k, generator=generator, dtype=dtype)
    norm_weight = 1 + 0.1 * rand(k, generator=generator, dtype=dtype)
    x, residual = torch.empty(m, k, dtype=dtype, device=DEVICE), torch.empty(m, k, dtype=dtype, device=DEVICE)
    positions = torch.tensor(context_lens, device=DEVICE) - 1
    slots = (meta.block_tables[torch.arange(m, device=DEVICE), positions // BLOCK_SIZE].long() * BLOCK_SIZE
             + positions % BLOCK_SIZE)
    rope = RopeStore(positions, cos_sin_cache, k_cache, v_cache, slots, NUM_Q_HEADS, NUM_KV_HEADS)
    scale = HEAD_DIM**-0.5

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        qkv, _ = fused_norm_linear_triton(x, residual, norm_weight, EPS, w, rope=rope)
        q = qkv[:, : NUM_Q_HEADS * HEAD_DIM].view(m, NUM_Q_HEADS, HEAD_DIM)
        return q, paged_attention_triton(q, k_cache, v_cache, meta, scale)

    x.copy_(rand(m, k, generator=generator, dtype=dtype))
    residual.copy_(rand(m, k, generator=generator, dtype=dtype))
    graph, (q, out) = captured(step)
    for replay in range(2):
        x.copy_(rand(m, k, generator=generator, dtype=dtype))
        residual.copy_(rand(m, k, generator=generator, dtype=dtype))
        for cache in (k_cache, v_cache):
            cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE] = float("nan")
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, scale)
        assert_close(f"attention after the KV store, M={m}, replay {replay} (seed {seed})", out, ref, dtype)


def test_unpack_decode_inputs_in_cuda_graph() -> None:
    """The decode graphs' first op at the engine's sizes (256 sequences, 4,096-token contexts), captured once and
    replayed on a new width and new tokens in flight (both read from device memory), equal to its reference."""
    rows, max_blocks = 256, 4096 // BLOCK_SIZE

    def inputs(width: int) -> tuple[torch.Tensor, ...]:
        pending = torch.where(torch.rand(rows, device=DEVICE) < 0.7,
                              torch.randint(0, 512, (rows,), device=DEVICE), -1)
        return (torch.randint(0, VOCAB, (rows,), device=DEVICE), pending,
                torch.randint(0, VOCAB, (512,), device=DEVICE),
                torch.randint(0, 10**6, (rows * max_blocks,), dtype=torch.int32, device=DEVICE),
                torch.tensor([width], dtype=torch.int32, device=DEVICE))

    ids, pending, tokens, packed, width = inputs(max_blocks)
    tables = torch.zeros(rows, max_blocks, dtype=torch.int32, device=DEVICE)
    graph, _ = captured(lambda: unpack_decode_inputs_triton(ids, pending, tokens, packed, width, tables))
    for new_width in (max_blocks, 37, 1):
        new = inputs(new_width)
        start_ids, start_tables = new[0].clone(), torch.randint_like(tables, 0, 10**6)
        for buffer, value in zip((ids, pending, tokens, packed, width, tables), (*new, start_tables)):
            buffer.copy_(value)
        graph.replay()
        ref_ids, ref_tables = start_ids.clone(), start_tables.clone()
        unpack_decode_inputs_ref(ref_ids, pending, tokens, packed, width, ref_tables)
        assert torch.equal(ids, ref_ids) and torch.equal(tables, ref_tables), f"width {new_width}"


def shared_prefix_batch(
    prefix_len: int, suffix_lens: list[int], dtype: torch.dtype, num_q_heads: int = NUM_Q_HEADS,
    num_kv_heads: int = NUM_KV_HEADS, head_dim: int = HEAD_DIM, padding: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode step whose sequences all start with the same prefix_len // BLOCK_SIZE blocks (a prefix-cache
    hit), then hold suffix_lens tokens (the newest included) in blocks of their own; `padding` rows of context 0
    follow (a CUDA graph's). Blocks are a random permutation of the pool; slots no sequence owns are NaN."""
    prefix_blocks = prefix_len // BLOCK_SIZE
    own_blocks = [math.ceil(s / BLOCK_SIZE) for s in suffix_lens]
    num_blocks = prefix_blocks + sum(own_blocks) + 16
    order = torch.randperm(num_blocks, device=DEVICE)
    num_seqs = len(suffix_lens) + padding
    block_tables = torch.zeros(num_seqs, prefix_blocks + max(own_blocks) + 2, dtype=torch.int32, device=DEVICE)
    owned = torch.zeros(num_blocks, BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    owned[order[:prefix_blocks]] = True
    start = prefix_blocks
    for i, suffix_len in enumerate(suffix_lens):
        blocks = order[start:start + own_blocks[i]]
        start += own_blocks[i]
        block_tables[i, :prefix_blocks] = order[:prefix_blocks].int()
        block_tables[i, prefix_blocks:prefix_blocks + len(blocks)] = blocks.int()
        positions = torch.arange(suffix_len, device=DEVICE)
        owned[blocks[positions // BLOCK_SIZE], positions % BLOCK_SIZE] = True
    k_cache, v_cache = (random_pool(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype) for _ in "kv")
    k_cache[~owned], v_cache[~owned] = float("nan"), float("nan")
    q = torch.randn(num_seqs, num_q_heads, head_dim, device=DEVICE).to(dtype)
    meta = attention_metadata([1] * num_seqs, [prefix_len + s for s in suffix_lens] + [0] * padding, block_tables)
    meta.common_prefix_len = torch.tensor([prefix_len], dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, meta


def without_prefix(meta: AttentionMetadata) -> AttentionMetadata:
    return dataclasses.replace(meta, common_prefix_len=None)


# Each case: shared_prefix_batch's arguments (the suffixes drawn from the seeded random state), and optionally a
# max_context_len larger than the batch's (as a CUDA graph captured for longer contexts launches).
CASCADE_CASES: dict[str, Callable[[], dict]] = {
    "B=8 prefix 1024 suffixes 1..192": lambda: dict(prefix_len=1024, suffix_lens=rand_lens(8, 1, 192)),
    "B=64 prefix 256 suffixes 1..64": lambda: dict(prefix_len=256, suffix_lens=rand_lens(64, 1, 64)),
    "B=256 prefix 1024 suffixes 64..192": lambda: dict(prefix_len=1024, suffix_lens=rand_lens(256, 64, 192)),
    "B=32 prefix 4096 suffixes 1..2000": lambda: dict(prefix_len=4096, suffix_lens=rand_lens(32, 1, 2000)),
    "B=16 prefix 512 d128": lambda: dict(prefix_len=512, suffix_lens=rand_lens(16, 1, 300), head_dim=128),
    "9q-3kv B=12 prefix 768": lambda: dict(prefix_len=768, suffix_lens=rand_lens(12, 1, 100), num_q_heads=9,
                                           num_kv_heads=3),
    "B=20 prefix 1024 + 12 padding rows, grid for 131072": lambda: dict(prefix_len=1024,
                                                                        suffix_lens=rand_lens(20, 1, 192), padding=12,
                                                                        max_context_len=131072),
}


@pytest.mark.parametrize("case", list(CASCADE_CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_cascade_attention(dtype: torch.dtype, case: str) -> None:
    """Cascade attention against the float32 reference, and against the plain paged kernel."""
    check_cascade_attention(case, dtype, None)


def check_cascade_attention(case: str, dtype: torch.dtype, cache_dtype: torch.dtype | None) -> None:
    """CASCADE_CASES[case] in `dtype` (its caches converted to cache_dtype, if given), through cascade attention:
    against the float32 reference on the same caches, and against the plain paged kernel."""
    q, k_cache, v_cache, meta = case_batch(CASCADE_CASES[case](), lambda **spec: shared_prefix_batch(dtype=dtype,
                                                                                                      **spec))
    label = f"cascade attention {case} {short(dtype)}"
    if cache_dtype is not None:
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
        label += f", {cache_dtype} cache"
    scale = q.shape[-1] ** -0.5
    out = poisoned(cascade_attention_triton, q, k_cache, v_cache, meta, scale)
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), without_prefix(meta), scale)
    assert_close(label, out, ref, dtype)
    plain = paged_attention_triton(q, k_cache, v_cache, without_prefix(meta), scale)
    assert_close(f"{label} vs the plain kernel", out, plain, dtype)


def test_cascade_attention_in_cuda_graph() -> None:
    """Cascade attention captured in a CUDA graph at max_context_len 8192 with a 1,024-token prefix, replayed on
    new q, a 512-token prefix and new suffixes: the prefix length is read on the device."""
    dtype, batch = torch.bfloat16, 64
    q, k_cache, v_cache, meta = shared_prefix_batch(1024, rand_lens(batch, 1, 192), dtype)
    meta.max_context_len = 8192
    scale = HEAD_DIM**-0.5
    graph, out = captured(lambda: cascade_attention_triton(q, k_cache, v_cache, meta, scale))
    # only the first 512 tokens taken as shared now, and each sequence's context shortened within its own blocks
    meta.common_prefix_len.fill_(512)
    suffix_lens = meta.context_lens - 1024
    shorter = (torch.rand(batch, device=DEVICE) * suffix_lens).int().clamp(max=suffix_lens - 1)
    meta.context_lens.copy_(1024 + 1 + shorter)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), without_prefix(meta), scale)
    assert_close("cascade attention in a CUDA graph, replayed on a shorter prefix bf16", out, ref, dtype)


# Mistral's sliding window and Gemma 2's logit soft-capping, alone and together: a window of 1000 (shorter than
# most contexts here, so that decode splits skip blocks and prefill tiles start past the first keys) and a cap of 5
# (Gemma 2's is 50; 5 bends the scores of random inputs, which rarely pass 5).
FEATURES = {"window 1000": dict(sliding_window=1000), "softcap 5": dict(logit_softcap=5.0),
            "window 1000 + softcap 5": dict(sliding_window=1000, logit_softcap=5.0)}
FEATURE_CASES = ["8 chunks <=512 on prefixes <=4096", "mixed 200 decodes first + idle + 4 chunks", "9q-3kv 3 chunks",
                 "decode batch 8 contexts <=32768", "decode batch 1 context 8192",
                 "decode batch 4 contexts <=3000 grid for 131072", "decode batch 256 contexts <=2048"]


@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("case", FEATURE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_with_window_and_softcap(dtype: torch.dtype, case: str, features: str) -> None:
    q, k_cache, v_cache, meta = case_batch(ATTENTION_CASES[case](), lambda query_lens, context_lens, **spec:
                                           paged_batch(query_lens, context_lens, dtype, **spec))
    scale = q.shape[-1] ** -0.5
    out = poisoned(lambda: paged_attention_triton(q, k_cache, v_cache, meta, scale, **FEATURES[features]))
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, scale, **FEATURES[features])
    assert_close(f"attention {case}, {features}, {short(dtype)}", out, ref, dtype)


def test_decode_attention_with_a_window_in_cuda_graph() -> None:
    """Decode attention under a window of 1000 captured at max_context_len 8192 (its splits sized for the window),
    replayed on new q and contexts of 1 to 8192: each reads its last 1000 keys."""
    dtype, batch = torch.bfloat16, 32
    q, k_cache, v_cache, meta = paged_batch([1] * batch, [8192] * batch, dtype)
    scale = HEAD_DIM**-0.5
    graph, out = captured(lambda: paged_attention_triton(q, k_cache, v_cache, meta, scale, sliding_window=1000))
    meta.context_lens.copy_(torch.randint(1, 8193, (batch,), dtype=torch.int32, device=DEVICE))
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, scale, sliding_window=1000)
    assert_close("attention decode under a window in a CUDA graph, replayed on new contexts bf16", out, ref, dtype)


@pytest.mark.parametrize("case", ["B=8 prefix 1024 suffixes 1..192", "B=256 prefix 1024 suffixes 64..192",
                                  "B=20 prefix 1024 + 12 padding rows, grid for 131072"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cascade_attention_with_softcap(dtype: torch.dtype, case: str) -> None:
    """Cascade attention with Gemma 2's cap (in both passes) against the float32 reference with it."""
    q, k_cache, v_cache, meta = case_batch(CASCADE_CASES[case](), lambda **spec: shared_prefix_batch(dtype=dtype,
                                                                                                      **spec))
    scale = q.shape[-1] ** -0.5
    out = poisoned(lambda: cascade_attention_triton(q, k_cache, v_cache, meta, scale, logit_softcap=5.0))
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), without_prefix(meta), scale,
                              logit_softcap=5.0)
    assert_close(f"cascade attention {case}, softcap 5, {short(dtype)}", out, ref, dtype)


# ------------------------------------------------------------------------------------------ fused decode kernels

FUSED_ROWS = [1, 2, 4, 8, 16, 32, 64]
# (N, K) of the Llama-3.2-1B decode products; the weights input-major, as model/loader.py keeps them on CUDA
FUSED_SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (2 * INTERMEDIATE, 2048), "down": (2048, 8192)}
EPS = 1e-5


def fresh_generator() -> tuple[torch.Generator, int]:
    """A generator on a seed of its own each run (printed with a failure): fresh random inputs every time."""
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator(device=DEVICE).manual_seed(seed), seed


def rand(*shape: int, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, generator=generator).to(dtype)


def input_major(n: int, k: int, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return rand(k, n, generator=generator, dtype=dtype).t()


def run_fused_product(product: str, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None,
                      norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                                          torch.Tensor | None]:
    """(y, new residual, and their float32 references) of one product as the model calls it."""
    if product in ("qkv", "gate_up"):
        silu = product == "gate_up"
        y, new_residual = poisoned(fused_norm_linear_triton, x, residual, norm_weight, EPS, w, silu)
        ref, ref_residual = fused_norm_linear_ref(x.float(), None if residual is None else residual.float(),
                                                  norm_weight.float(), EPS, w.float(), silu)
        return y, new_residual, ref, ref_residual
    return poisoned(fused_linear_triton, x, w), None, fused_linear_ref(x.float(), w.float()), None


@pytest.mark.parametrize("m", FUSED_ROWS)
@pytest.mark.parametrize("product", list(FUSED_SHAPES))
@pytest.mark.parametrize("layout", ["input-major", "output-major"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_decode_product(dtype: torch.dtype, layout: str, product: str, m: int) -> None:
    """qkv and gate_up with the RMSNorm prologue and the residual add (gate_up with SiLU·mul), o and down plain,
    against the float32 references of the same inputs; with output-major weights up to GEMV_MAX_ROWS rows, the
    GEMV (gemv.py) runs them."""
    if dtype == torch.float32 and m not in (1, 4, 16):
        pytest.skip("float32 (the engine's exact-greedy check) at a few row counts")
    generator, seed = fresh_generator()
    n, k = FUSED_SHAPES[product]
    w = input_major(n, k, generator, dtype) if layout == "input-major" else rand(n, k, generator=generator,
                                                                                 dtype=dtype)
    x, residual = rand(m, k, generator=generator, dtype=dtype), rand(m, k, generator=generator, dtype=dtype)
    norm_weight = 1 + 0.1 * rand(k, generator=generator, dtype=dtype)
    y, new_residual, ref, ref_residual = run_fused_product(product, x, w, residual, norm_weight)
    what = f"{product} {n}x{k} {layout} M={m} {short(dtype)} (seed {seed})"
    assert_close(what, y, ref, dtype)
    if new_residual is not None:
        assert_close(what + " new residual", new_residual, ref_residual, dtype)


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("layout", ["input-major", "output-major"])
def test_fused_norm_without_residual(layout: str, m: int) -> None:
    """The first layer's input_layernorm: no residual; the stream is x itself."""
    generator, seed = fresh_generator()
    n, k = FUSED_SHAPES["qkv"]
    x = rand(m, k, generator=generator, dtype=torch.bfloat16)
    w = input_major(n, k, generator, torch.bfloat16) if layout == "input-major" else rand(
        n, k, generator=generator, dtype=torch.bfloat16)
    norm_weight = 1 + 0.1 * rand(k, generator=generator, dtype=torch.bfloat16)
    y, new_residual, ref, _ = run_fused_product("qkv", x, w, None, norm_weight)
    assert new_residual is x
    assert_close(f"qkv without residual M={m} (seed {seed})", y, ref, torch.bfloat16)


def run_qkv_rope_store(m: int, dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                       cos_sin_cache: torch.Tensor) -> tuple:
    """qkv with the norm prologue and the RoPE + KV-store epilogue on fresh inputs of m rows, storing into k_cache and
    v_cache at `slots`: (y, new residual) of the kernels, the float32 reference's, the caches the reference stored
    into (float32 copies of the ones given), the inputs' seed and the rows' positions."""
    generator, seed = fresh_generator()
    n, k = FUSED_SHAPES["qkv"]
    w = rand(n, k, generator=generator, dtype=dtype)
    x, residual = rand(m, k, generator=generator, dtype=dtype), rand(m, k, generator=generator, dtype=dtype)
    norm_weight = 1 + 0.1 * rand(k, generator=generator, dtype=dtype)
    positions = torch.randint(0, 131072, (m,), device=DEVICE, generator=generator)
    ref_caches = torch.stack([k_cache.float(), v_cache.float()])
    rope = RopeStore(positions, cos_sin_cache, k_cache, v_cache, slots, NUM_Q_HEADS, NUM_KV_HEADS)
    y, new_residual = poisoned(lambda: fused_norm_linear_triton(x, residual, norm_weight, EPS, w, rope=rope))
    ref, ref_residual = fused_norm_linear_ref(x.float(), residual.float(), norm_weight.float(), EPS, w.float(),
                                              rope=rope._replace(k_cache=ref_caches[0], v_cache=ref_caches[1]))
    return y, new_residual, ref, ref_residual, ref_caches, seed, positions


@pytest.mark.parametrize("m", [1, 2, 4, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_qkv_rope_store(dtype: torch.dtype, m: int, cos_sin_cache: torch.Tensor) -> None:
    """qkv with the norm prologue and the RoPE + KV-store epilogue (the GEMV's up to GEMV_MAX_ROWS rows, the tiled
    kernel then rotary.py's above), output-major weights, Llama 3 scaling at random positions: y (q rotated, k and
    v as the product gives them) and the stored slots against the float32 references; other slots untouched."""
    k_cache, v_cache, slots = random_cache_slots(m, dtype)
    original = torch.stack([k_cache, v_cache])
    y, new_residual, ref, ref_residual, ref_caches, seed, _ = run_qkv_rope_store(m, dtype, k_cache, v_cache, slots,
                                                                                 cos_sin_cache)
    what = f"qkv + RoPE + KV store M={m} {short(dtype)} (seed {seed})"
    assert_close(what, y, ref, dtype)
    assert_close(what + " new residual", new_residual, ref_residual, dtype)
    written = torch.zeros(k_cache.shape[0] * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    caches = torch.stack([k_cache, v_cache]).flatten(1, 2)
    assert_close(what + " K/V cache", caches[:, written], ref_caches.flatten(1, 2)[:, written], dtype)
    assert torch.equal(caches[:, ~written], original.flatten(1, 2)[:, ~written]), f"{what}: another slot changed"


def lm_head_weight(generator: torch.Generator, dtype: torch.dtype, tied: bool) -> torch.Tensor:
    """[vocab, hidden]: the tied embedding (rows contiguous) or an untied head, input-major as the loader keeps it."""
    return rand(VOCAB, HIDDEN, generator=generator, dtype=dtype) if tied else input_major(VOCAB, HIDDEN, generator,
                                                                                          dtype)


@pytest.mark.parametrize("m", FUSED_ROWS)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_head_argmax(dtype: torch.dtype, tied: bool, m: int) -> None:
    """The greedy tokens, against the float32 logits (assert_argmax_up_to_rounding)."""
    generator, seed = fresh_generator()
    w = lm_head_weight(generator, dtype, tied)
    x = rand(m, HIDDEN, generator=generator, dtype=dtype)
    tokens = poisoned(linear_argmax_triton, x, w)
    logits = x.float() @ w.float().t()
    what = f"lm_head argmax {'tied' if tied else 'untied'} M={m} {short(dtype)} (seed {seed})"
    assert tokens.dtype == torch.int64 and tokens.shape == (m,), what
    assert bool(((tokens >= 0) & (tokens < VOCAB)).all()), f"{what}: tokens out of range {tokens.tolist()}"
    assert_argmax_up_to_rounding(what, tokens, logits, dtype)


@pytest.mark.parametrize("m", [1, 5, 64])
def test_lm_head_argmax_ties(m: int) -> None:
    """Rows of W repeat every 64, so each row's max logit occurs ~2004 times, in every vocabulary tile: the packed
    key's low half must pick the first occurrence, below 64, as torch.argmax does."""
    generator, seed = fresh_generator()
    base = rand(64, HIDDEN, generator=generator, dtype=torch.float32)
    w = base.repeat(VOCAB // 64 + 1, 1)[:VOCAB].contiguous()
    x = rand(m, HIDDEN, generator=generator, dtype=torch.float32)
    tokens = linear_argmax_triton(x, w)
    expected = (x @ base.t()).argmax(-1)
    assert torch.equal(tokens, expected), f"ties (seed {seed}): {tokens.tolist()} != {expected.tolist()}"


@pytest.mark.parametrize("m", [1, 16])
def test_fused_layer_chain_in_cuda_graph(m: int) -> None:
    """A decoder layer's products and the LM head back to back, as the decode graph runs them (each launched with
    PDL on Hopper: its weights loaded before it waits, its inputs after): captured once, replayed twice on new
    inputs. Each stage's output matches its reference computed from the stage before's output (an input read
    before the kernel before had written it would not), and a second replay gives the same bits (the split-K
    counters and the argmax keys are reset by the kernels)."""
    dtype = torch.bfloat16
    generator, seed = fresh_generator()
    w_qkv = input_major(HIDDEN, HIDDEN, generator, dtype)  # square, so that o_proj can take its output
    w_o = input_major(HIDDEN, HIDDEN, generator, dtype)
    w_gate_up = input_major(2 * INTERMEDIATE, HIDDEN, generator, dtype)
    w_down, w_head = input_major(HIDDEN, INTERMEDIATE, generator, dtype), lm_head_weight(generator, dtype, tied=True)
    norm1, norm2 = (1 + 0.1 * rand(HIDDEN, generator=generator, dtype=dtype) for _ in range(2))
    x, residual = torch.empty(m, HIDDEN, dtype=dtype, device=DEVICE), torch.empty(m, HIDDEN, dtype=dtype, device=DEVICE)

    def chain() -> tuple[torch.Tensor, ...]:
        qkv, residual1 = fused_norm_linear_triton(x, residual, norm1, EPS, w_qkv)
        attn = fused_linear_triton(qkv, w_o)
        gated, residual2 = fused_norm_linear_triton(attn, residual1, norm2, EPS, w_gate_up, True)
        down = fused_linear_triton(gated, w_down)
        return qkv, residual1, attn, gated, residual2, down, linear_argmax_triton(down, w_head)

    x.copy_(rand(m, HIDDEN, generator=generator, dtype=dtype))
    residual.copy_(rand(m, HIDDEN, generator=generator, dtype=dtype))
    graph, out = captured(chain)
    for replay in range(2):
        x.copy_(rand(m, HIDDEN, generator=generator, dtype=dtype))
        residual.copy_(rand(m, HIDDEN, generator=generator, dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        qkv, residual1, attn, gated, residual2, down, tokens = (t.clone() for t in out)
        what = f"layer chain M={m} replay {replay} (seed {seed})"
        ref_qkv, ref_residual1 = fused_norm_linear_ref(x.float(), residual.float(), norm1.float(), EPS, w_qkv.float())
        assert_close(what + ": qkv", qkv, ref_qkv, dtype)
        assert_close(what + ": residual after attention", residual1, ref_residual1, dtype)
        assert_close(what + ": o", attn, fused_linear_ref(qkv.float(), w_o.float()), dtype)
        ref_gated, ref_residual2 = fused_norm_linear_ref(attn.float(), residual1.float(), norm2.float(), EPS,
                                                         w_gate_up.float(), True)
        assert_close(what + ": gate_up", gated, ref_gated, dtype)
        assert_close(what + ": residual after the MLP", residual2, ref_residual2, dtype)
        assert_close(what + ": down", down, fused_linear_ref(gated.float(), w_down.float()), dtype)
        assert_argmax_up_to_rounding(what + ": lm_head argmax", tokens, down.float() @ w_head.float().t(), dtype)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, (qkv, residual1, attn, gated, residual2, down, tokens))), \
            f"{what}: a second replay on the same inputs changed the bits"


# ------------------------------------------------------------------------------------------------- sampling


def params(rows: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    return (
        torch.full((rows,), temperature, device=DEVICE),
        torch.full((rows,), top_k, dtype=torch.int64, device=DEVICE),
        torch.full((rows,), top_p, device=DEVICE),
        torch.full((rows,), min_p, device=DEVICE),
    )


def test_sample_greedy_and_top_k_1_rows_are_argmax() -> None:
    batch = 64
    logits = 4 * torch.randn(batch, VOCAB, device=DEVICE)
    temperature, top_k, top_p, min_p = params(batch, top_p=0.9)
    temperature[: batch // 2] = 0.0
    top_k[batch // 2 :] = 1
    seeds = torch.arange(batch, device=DEVICE)
    out = poisoned(sample_triton, logits, temperature, top_k, top_p, min_p, seeds)
    expected = logits.argmax(-1)
    wrong = (out != expected).nonzero().flatten().tolist()
    assert not wrong, (f"sample B={batch} V={VOCAB}: greedy (rows 0-31) and top_k=1 (rows 32-63) rows {wrong} "
                       f"are not the argmax: {out[wrong].tolist()} != {expected[wrong].tolist()}")


def test_sample_row_alone_equals_in_batch() -> None:
    batch = 64
    logits = 4 * torch.randn(batch, VOCAB, device=DEVICE)
    seeds = torch.arange(batch, device=DEVICE)
    temperature, top_k, top_p, min_p = params(batch, temperature=0.8, top_k=50)
    top_p[::3], min_p[1::3], top_k[2::3] = 0.9, 0.05, 0
    together = sample_triton(logits, temperature, top_k, top_p, min_p, seeds)
    rows = list(range(0, batch, 7))
    alone = torch.cat([
        sample_triton(logits[i : i + 1], temperature[i : i + 1], top_k[i : i + 1], top_p[i : i + 1],
                      min_p[i : i + 1], seeds[i : i + 1])
        for i in rows
    ])
    assert torch.equal(alone, together[::7]), (f"rows {rows}: drawn alone {alone.tolist()}, "
                                               f"in the batch {together[::7].tolist()}")


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.719: p = 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


SMALL_LOGITS = [0.3, -1.2, 1.1, 2.0, 2.4, -0.2, 0.9, 0.0]


def wide_logits() -> torch.Tensor:
    wide = 2 * torch.randn(VOCAB, device=DEVICE)
    wide[:30] += 8  # a head of ~30 likely tokens above a long tail
    return wide


# name -> (logits, draws, temperature, top_k, top_p, min_p)
SAMPLING_CASES: dict[str, Callable[[], tuple]] = {
    "V=8 T=0.7 top_p=0.8": lambda: (torch.tensor(SMALL_LOGITS, device=DEVICE), 100_000, 0.7, 0, 0.8, 0.0),
    "V=8 T=1.3 top_k=5 min_p=0.05": lambda: (torch.tensor(SMALL_LOGITS, device=DEVICE), 100_000, 1.3, 5, 1.0, 0.05),
    f"V={VOCAB} T=1 top_k=20": lambda: (wide_logits(), 8192, 1.0, 20, 1.0, 0.0),
    f"V={VOCAB} T=0.9 top_p=0.6": lambda: (wide_logits(), 4096, 0.9, 0, 0.6, 0.0),
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sample_distribution(case: str) -> None:
    """Draws with `draws` different seeds from one row of logits; frequencies against the truncated tempered
    softmax computed by sample_ref's rules (chi-square, p = 1e-4), and no masked token ever drawn."""
    logits, draws, temperature, top_k, top_p, min_p = SAMPLING_CASES[case]()
    vocab = logits.shape[0]
    probs = (logits / temperature).softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    rank = torch.arange(vocab, device=DEVICE)
    drop = (rank >= (top_k if top_k > 0 else vocab)) | (sorted_probs.cumsum(0) - sorted_probs >= top_p)
    drop |= sorted_probs < min_p * sorted_probs[0]
    drop[0] = False
    expected = torch.zeros(vocab, device=DEVICE).scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    expected = (expected / expected.sum()).double()
    seeds = torch.randint(0, 2**62, (draws,), device=DEVICE)
    out = sample_triton(logits.expand(draws, vocab), *params(draws, temperature, top_k, top_p, min_p), seeds)
    counts = torch.bincount(out, minlength=vocab).double()
    kept = expected > 0
    masked_draws = int(counts[~kept].sum())
    # pool the categories expected fewer than 5 times into one, as the chi-square test asks
    exp_counts, obs_counts = draws * expected[kept], counts[kept]
    small = exp_counts < 5
    if small.any():
        exp_counts = torch.cat([exp_counts[~small], exp_counts[small].sum().view(1)])
        obs_counts = torch.cat([obs_counts[~small], obs_counts[small].sum().view(1)])
    chi2 = float(((obs_counts - exp_counts) ** 2 / exp_counts).sum())
    df = max(exp_counts.numel() - 1, 1)
    assert masked_draws == 0, f"sample {case}: {masked_draws} of {draws} draws are tokens the truncation masks"
    assert chi2 < chi2_critical(df), (f"sample {case}: chi2={chi2:.1f} df={df} >= critical {chi2_critical(df):.1f} "
                                      f"(p = 1e-4): the frequencies are not the truncated softmax's")


@triton.jit
def _exponential_kernel(out_ptr, r_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    r = tl.load(r_ptr + offs, mask=offs < n, other=0).to(tl.uint32)
    tl.store(out_ptr + offs, _exponential(r, True), mask=offs < n)


def test_race_noise_with_lg2_approx() -> None:
    """The sampler's E = -ln(U) as the GPU computes it (log2 from lg2.approx), against float64, on fresh random
    integers and the edges (both ends, and where the series and the log meet). lg2.approx's error, 2^-22 absolute
    for U in (1/2, 7/8] where |log2 U| >= 0.19, is 1.2e-6 of E at most there: 3e-6 leaves room for the rest."""
    generator, seed = fresh_generator()
    switch = 2**32 - 2**29
    edges = torch.tensor([0, 1, 1000, 2**31, switch - 1, switch, switch + 1, 2**32 - 1000, 2**32 - 1], device=DEVICE)
    r = torch.cat([edges, torch.randint(0, 2**32, (1 << 20,), device=DEVICE, generator=generator)])
    out = torch.full(r.shape, float("nan"), device=DEVICE)
    _exponential_kernel[(triton.cdiv(r.numel(), 1024),)](out, r, r.numel(), BLOCK=1024)
    expected = -torch.log1p(-(2**32 - 1 - r.double() + 0.5) / 2**32)
    error = ((out.double() - expected) / expected).abs()
    assert float(error.max()) < 3e-6, f"seed {seed}: r={r[error.argmax()].item()} relative error {float(error.max())}"


@pytest.mark.parametrize("top_k", [0, 1, 5, 20])
@pytest.mark.parametrize("rows", [1, 7, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=short)
def test_token_logprobs(dtype: torch.dtype, rows: int, top_k: int) -> None:
    """Prompt and sample logprobs from the LM head's logits, against the float32 log-softmax on the same (rounded)
    logits: the logprobs within float32's tolerance (both are float32 sums over the same values, in other orders),
    the ranks exactly those of the logits' order, the top k exactly the largest logits, lower ids first among ties
    (many, in bfloat16). A rank counted on the log-softmax (the reference's) may differ only where float32 rounding
    of x - lse merges a larger logit with the target's."""
    generator, seed = fresh_generator()
    logits = (4 * rand(rows, VOCAB, generator=generator, dtype=torch.float32)).to(dtype)
    targets = torch.randint(0, VOCAB, (rows,), device=DEVICE, generator=generator)
    targets[::3] = logits[::3].float().argmax(-1)  # some rows score their most likely token
    chosen, ranks, lse, top_ids, top_logprobs = poisoned(token_logprobs_triton, logits, targets, top_k)
    ref_chosen, ref_ranks, ref_lse, _, ref_top_logprobs = token_logprobs_ref(logits, targets, top_k)
    what = f"token_logprobs {short(dtype)} L={rows} k={top_k} seed {seed}"
    assert_close(f"{what} logprobs", chosen, ref_chosen, torch.float32)
    assert_close(f"{what} logsumexp", lse, ref_lse, torch.float32)
    x = logits.float()
    x_target = x.gather(1, targets[:, None])
    assert torch.equal(ranks, (x > x_target).sum(dim=1, dtype=torch.int32) + 1), f"{what}: ranks"
    logprobs = torch.log_softmax(x, dim=-1)
    merged = ((x > x_target) & (logprobs == logprobs.gather(1, targets[:, None]))).any(dim=1)
    differ = (ranks != ref_ranks) & ~merged
    assert not differ.any(), f"{what}: ranks {ranks[differ].tolist()} != reference {ref_ranks[differ].tolist()}"
    expected_ids = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :top_k]
    assert torch.equal(top_ids, expected_ids), f"{what}: top ids"
    if top_k:
        assert_close(f"{what} top logprobs", top_logprobs, ref_top_logprobs, torch.float32)


# ------------------------------------------------------------------------------------------ float8 KV cache
# kv_cache_dtype="fp8": the caches in float8 e4m3 (sm_89+). Attention reads them as the query's dtype, exactly, so
# against the float32 reference on the same float8 values it is held to the query dtype's tolerance. The stores
# round to e4m3 (saturating at +-448): checked against the reference's rule (to_cache_dtype_ref) applied to the
# float32 reference's values rounded to the activations' dtype, bit for bit but for values on a rounding boundary.
# (The references read the float8 caches through .float() copies, and the tests index their bytes (uint8 views):
# no float8 indexing on the GPU, which older torch lacks.)

FP8 = torch.float8_e4m3fn


def fp8_cache_slots(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """random_cache_slots with float8 caches (randn rounded to e4m3)."""
    k_cache, v_cache, slots = random_cache_slots(tokens, torch.float32)
    return k_cache.to(FP8), v_cache.to(FP8), slots


def stored_bytes(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """[2, slots, heads, head_dim] uint8: the bytes of float8 K and V caches, slot by slot (to index on any torch)."""
    return torch.stack([k_cache.view(torch.uint8), v_cache.view(torch.uint8)]).flatten(1, 2)


def assert_fp8_close(what: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    """Two float8 e4m3 tensors: at least 99% bit for bit, the rest within one e4m3 step (1/8 of the value, or the
    least subnormal), none NaN."""
    assert out.dtype == ref.dtype == FP8
    assert not out.float().isnan().any(), f"{what}: NaN stored"
    same = float((out.view(torch.uint8) == ref.view(torch.uint8)).float().mean())
    assert same >= 0.99, f"{what}: only {same:.2%} of the stored values are the reference's"
    torch.testing.assert_close(out.float(), ref.float(), atol=2.0**-9, rtol=0.125, msg=what)


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_paged_attention_fp8_cache(case: str) -> None:
    dtype = torch.bfloat16
    q, k_cache, v_cache, meta = case_batch(ATTENTION_CASES[case](), lambda query_lens, context_lens, **spec:
                                           paged_batch(query_lens, context_lens, dtype, **spec))
    k_cache, v_cache = k_cache.to(FP8), v_cache.to(FP8)  # (NaN stays NaN)
    scale = q.shape[-1] ** -0.5
    out = poisoned(paged_attention_triton, q, k_cache, v_cache, meta, scale)
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    path = "decode" if meta.is_decode else "decode + prefill" if meta.num_decodes else "prefill"
    assert_close(f"attention ({path} path) {case}, fp8 cache", out, ref, dtype)


@pytest.mark.parametrize("case", list(CASCADE_CASES))
def test_cascade_attention_fp8_cache(case: str) -> None:
    check_cascade_attention(case, torch.bfloat16, FP8)


def test_decode_attention_fp8_cache_in_cuda_graph() -> None:
    """Decode attention on a float8 cache captured in a CUDA graph, replayed on new q and new cache contents."""
    q, k_cache, v_cache, meta = paged_batch([1] * 32, rand_lens(32, 1, 4096), torch.bfloat16)
    k_cache, v_cache = k_cache.to(FP8), v_cache.to(FP8)
    meta.max_context_len = 4096
    scale = HEAD_DIM**-0.5
    graph, out = captured(lambda: paged_attention_triton(q, k_cache, v_cache, meta, scale))
    q.copy_(torch.randn_like(q))
    owned = ~k_cache.float().isnan()
    k_cache.copy_(torch.where(owned, torch.randn(k_cache.shape, device=DEVICE), float("nan")).to(FP8))
    graph.replay()
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    assert_close("decode attention, fp8 cache, CUDA graph replay", out, ref, torch.bfloat16)


@pytest.mark.parametrize("magnitude", [1.0, 1000.0], ids=["randn", "beyond-448"])
@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_and_store_fp8_cache(dtype: torch.dtype, tokens: int, magnitude: float,
                                              cos_sin_cache: torch.Tensor) -> None:
    """The RoPE + KV store into float8 caches: the rotated k and v as the reference stores them (beyond +-448:
    +-448, no NaN), q as with any cache, the other slots untouched."""
    k_cache, v_cache, slots = fp8_cache_slots(tokens)
    qkv = (magnitude * torch.randn(tokens, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device=DEVICE)).to(dtype)
    q, k, v = qkv.split([NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1)
    q, k, v = (x.view(tokens, -1, HEAD_DIM) for x in (q, k, v))
    positions = torch.randint(0, 131072, (tokens,), device=DEVICE)
    ref_k, ref_v = k_cache.float(), v_cache.float()  # (float32 caches: the reference's values before the rounding)
    ref_q = rotary_embedding_and_store_ref(positions, q.float(), k.float(), v.float(), cos_sin_cache, ref_k, ref_v,
                                           slots)
    original = stored_bytes(k_cache, v_cache)
    rotary_embedding_and_store_triton(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slots)
    name = f"rotary_embedding_and_store into fp8 T={tokens} {short(dtype)} x{magnitude:g}"
    assert_close(f"{name} (q)", q, ref_q, dtype)
    written = torch.zeros(k_cache.shape[0] * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    stored = stored_bytes(k_cache, v_cache)
    expected = to_cache_dtype_ref(torch.stack([ref_k, ref_v]).flatten(1, 2)[:, written].to(dtype), FP8)
    assert_fp8_close(name, stored[:, written].view(FP8), expected)
    assert torch.equal(stored[1, written], expected[1].view(torch.uint8)), f"{name}: V differs (v is not rotated)"
    if magnitude > 448:
        saturated = float((stored[:, written].view(FP8).float().abs() == 448).float().mean())
        assert saturated > 0.5, f"{name}: only {saturated:.0%} of 1000 * randn stored as +-448"
    assert torch.equal(stored[:, ~written], original[:, ~written]), f"{name}: a slot not in slot_mapping changed"


@pytest.mark.parametrize("m", [1, 2, 4, 16])
def test_fused_qkv_rope_store_fp8_cache(m: int, cos_sin_cache: torch.Tensor) -> None:
    """qkv with the RoPE + KV-store epilogue into float8 caches (the GEMV up to GEMV_MAX_ROWS rows, the tiled
    kernel then rotary.py's above): y as with any cache; each stored slot is the kernel's own bfloat16 k (rotated)
    or v rounded to e4m3 (v bit for bit), and all of them within e4m3's rounding of the float32 reference's values.
    (Against the reference alone a bit-for-bit count says little: the product's bfloat16 rounding, one step off the
    reference's in many values, moves some of those across an e4m3 rounding boundary.)"""
    dtype = torch.bfloat16
    k_cache, v_cache, slots = fp8_cache_slots(m)
    y, _, ref, _, ref_caches, seed, positions = run_qkv_rope_store(m, dtype, k_cache, v_cache, slots, cos_sin_cache)
    what = f"qkv + RoPE + KV store into fp8 M={m} (seed {seed})"
    assert_close(what, y, ref, dtype)
    valid = slots >= 0
    _, k, v = y.float().split([NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1)
    k, v = k.reshape(m, NUM_KV_HEADS, HEAD_DIM), v.reshape(m, NUM_KV_HEADS, HEAD_DIM)
    _, rotated_k = rotary_embedding_ref(positions, k, k, cos_sin_cache)
    stored = stored_bytes(k_cache, v_cache)[:, slots[valid]].view(FP8)  # [2, valid rows, heads, head_dim]
    own_k = to_cache_dtype_ref(rotated_k[valid].to(dtype), FP8)
    assert_fp8_close(what + " K from its own y", stored[0], own_k)
    own_v = to_cache_dtype_ref(v[valid].to(dtype), FP8)
    assert torch.equal(stored[1].view(torch.uint8), own_v.view(torch.uint8)), f"{what}: V is not its y rounded"
    # Against the float32 reference, as a whole: e4m3's rounding moves a normal value by at most 1/16 of itself (so
    # the norm of the error is at most 1/16 of the norm), bfloat16's adds ~1/256. Value by value it can be further:
    # RoPE's x1 cos - x2 sin of the product's bfloat16 outputs can cancel to a value far smaller than their errors.
    reference = ref_caches.flatten(1, 2)[:, slots[valid]]
    assert relative_error(stored.float(), reference) <= 1 / 16 + 1 / 256, f"{what}: far from the float32 reference"
