"""Rotary position embedding (the rotate-half layout of Hugging Face Llama), with Llama 3 scaling."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from tinyvllm.ops.layernorm import RowNorm, row_inv_rms, row_inv_rms_ref, row_norm_args
from tinyvllm.ops.pdl import pdl_options, pdl_wait
from tinyvllm.ops.triton_import import tl, triton

# The rope scaling types (config.json's rope_scaling.rope_type, or its older `type`) rope_inv_freq implements.
ROPE_SCALING_TYPES = ("default", "llama3")


def check_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """A config's rope_scaling as rope_inv_freq takes it (None for plain rope); ValueError for a type it does not
    implement."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported (supported: {', '.join(ROPE_SCALING_TYPES)})")
    return dict(scaling) if kind != "default" else None


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2]; Llama 3 stretches the low frequencies by `factor` and blends
    the band between low_freq_factor and high_freq_factor smoothly (as transformers' _compute_llama3)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    if "freq_factors" in scaling:  # GGUF's rope_freqs tensor: Llama 3 scaling precomputed as divisors
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def build_cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None, device: torch.device
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half of each row, sin in the second."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)


# The largest finite float8 e4m3fn (torch.finfo(torch.float8_e4m3fn).max). The format has no infinity, and what a
# cast makes of a larger value depends on who casts (older torch gives NaN, the torch of these tests +-448): every
# store into a float8 KV cache clamps to +-448 itself first, so that it never depends on the cast.
FP8_E4M3_MAX = 448.0


def to_cache_dtype_ref(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as the KV cache stores it: rounded to cache_dtype, saturating at +-448 for a float8 e4m3 cache
    (kv_cache_dtype="fp8"; no scale factor, as vLLM's default k_scale = v_scale = 1). The one rule of the
    references; the kernels' is cast_for_store."""
    if cache_dtype == torch.float8_e4m3fn:
        x = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(cache_dtype)


def _once_per_step(memo: dict | None, key: tuple, make: Callable[[], Any]) -> Any:
    """make(), or what it gave the step's first layer where a memo (AttentionMetadata.memo) keeps it under key."""
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _store_index(slot_mapping: torch.Tensor, block_size: int) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(the rows of slot_mapping that store, None for all; their blocks; their offsets in the block)."""
    rows = None if bool((slot_mapping >= 0).all()) else (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping if rows is None else slot_mapping[rows]
    return rows, slots // block_size, slots % block_size  # (indexed so: any layout of the pool)


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    memo: dict | None = None,
) -> None:
    """k, v [T, Hk, D] into k_cache, v_cache [num_blocks, block_size, Hk, D] at flat slot
    slot_mapping[t] = block * block_size + offset (converted by to_cache_dtype_ref); a slot of -1 (padding) is
    skipped. In place. memo: the step's AttentionMetadata.memo, to find the slots' blocks once per step."""
    block_size = k_cache.shape[1]
    rows, blocks, offsets = _once_per_step(memo, ("store_index", block_size),
                                           lambda: _store_index(slot_mapping, block_size))
    if rows is not None:
        k, v = k[rows], v[rows]
    k_cache[blocks, offsets] = to_cache_dtype_ref(k, k_cache.dtype)
    v_cache[blocks, offsets] = to_cache_dtype_ref(v, v_cache.dtype)


def _cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor,
             memo: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, 1, D] of each token's position, each half of a head's D with the same angles and sin negated
    on the first half, so that _rotate is two products; once per step where a memo keeps them."""
    def make() -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)

    return _once_per_step(memo, ("cos_sin", positions.data_ptr(), cos_sin_cache.data_ptr()), make)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by _cos_sin's (cos, sin), in float32: with (x1, x2) its halves,
    (x1*cos - x2*sin, x2*cos + x1*sin) = x * (cos, cos) + (x2, x1) * (-sin, sin)."""
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat([x2, x1], dim=-1), sin)


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] rotated by their token's position; returns new (q, k).

    With x = (x1, x2) the two halves of a head: out = (x1*cos - x2*sin, x2*cos + x1*sin)."""
    cos, sin = _cos_sin(positions, cos_sin_cache)
    return _rotate(q, cos, sin).to(q.dtype), _rotate(k, cos, sin).to(k.dtype)


def rotary_embedding_and_store_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   slot_mapping: torch.Tensor) -> torch.Tensor:
    """rotary_embedding_ref, then store_kv_ref of the rotated k and of v (padding slots, -1, are skipped;
    their q is rotated all the same); returns the new q. Attention reads k only from the cache."""
    q, k = rotary_embedding_ref(positions, q, k, cos_sin_cache)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


class RopeStore(NamedTuple):
    """What follows a qkv product in a decoder layer: the rotary embedding of q and k at `positions`, and k and v
    stored at their cache slots. ops.rope_store does it after the product; gemv.py's GEMV in its epilogue."""

    positions: torch.Tensor  # [T]
    cos_sin_cache: torch.Tensor  # build_cos_sin_cache's
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [T], -1: store nothing
    num_q_heads: int
    num_kv_heads: int
    memo: dict | None = None  # the step's AttentionMetadata.memo (the references' indices, once per step)


def _qkv_heads(qkv: torch.Tensor, rope: RopeStore) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [T, heads, D]: views of a qkv product's columns."""
    head_dim = rope.k_cache.shape[-1]
    sizes = [rope.num_q_heads * head_dim, rope.num_kv_heads * head_dim, rope.num_kv_heads * head_dim]
    q, k, v = qkv.split(sizes, dim=-1)
    return tuple(t.view(qkv.shape[0], -1, head_dim) for t in (q, k, v))  # type: ignore[return-value]


def rope_store_ref(qkv: torch.Tensor, rope: RopeStore, norm: RowNorm | None = None) -> torch.Tensor:
    """rotary_embedding_and_store_ref on the q, k and v columns of qkv [T, (Hq + 2 Hk) * D], with the rotated q
    written back in place (as the Triton kernel rotates it): qkv holds q rotated, and k and v as they were. With
    `norm`, q, k and v are first scaled by row_inv_rms_ref(norm), in float32 (rounded once, after the rotation).
    q and k are rotated together, as one row of Hq + Hk heads (the CPU engine's path: fewer, larger ops)."""
    num_tokens, head_dim = qkv.shape[0], rope.k_cache.shape[-1]
    x = qkv.float()
    if norm is not None:
        x = x * row_inv_rms_ref(norm)[:, None]
    qk_cols = (rope.num_q_heads + rope.num_kv_heads) * head_dim
    qk = _rotate(x[:, :qk_cols].view(num_tokens, -1, head_dim),
                 *_cos_sin(rope.positions, rope.cos_sin_cache, rope.memo))
    qk = qk.to(qkv.dtype)
    q, k = qk.split([rope.num_q_heads, rope.num_kv_heads], dim=1)
    store_kv_ref(k, x[:, qk_cols:].view(num_tokens, -1, head_dim).to(qkv.dtype), rope.k_cache, rope.v_cache,
                 rope.slot_mapping, rope.memo)
    qkv[:, :rope.num_q_heads * head_dim] = q.flatten(1)
    return qkv


def rope_store_triton(qkv: torch.Tensor, rope: RopeStore, norm: RowNorm | None = None) -> torch.Tensor:
    """rope_store_ref through rotary_embedding_and_store_triton (for a qkv product whose kernel did not do it)."""
    q, k, v = _qkv_heads(qkv, rope)
    rotary_embedding_and_store_triton(rope.positions, q, k, v, rope.cos_sin_cache, rope.k_cache, rope.v_cache,
                                      rope.slot_mapping, norm)
    return qkv


if triton is not None:
    _FP8_E4M3_MAX = tl.constexpr(FP8_E4M3_MAX)

    @triton.jit
    def cast_for_store(x, dst_ptr):
        """to_cache_dtype_ref in a kernel: x as dst_ptr's element type, clamped to +-448 first when that is float8
        e4m3 (a KV cache of kv_cache_dtype="fp8"). The test is on types, at compile time: for any other type this
        is the plain cast it replaces, and no code is added."""
        if dst_ptr.dtype.element_ty == tl.float8e4nv:
            x = tl.clamp(x.to(tl.float32), -_FP8_E4M3_MAX, _FP8_E4M3_MAX)
        return x.to(dst_ptr.dtype.element_ty)

    # One program per token rotates all its heads of q and k; with (x1, x2) the halves of a head,
    # (cos, sin) = cos_sin_cache[position]:   x1' = x1*cos - x2*sin,   x2' = x2*cos + x1*sin   (in float32).
    # _rotate_heads reads the heads at src, times `scale` (a RowNorm's 1/rms, else 1), and writes them rotated at dst
    # (dst = src: in place), rounded to src's dtype and then to dst's (cast_for_store), as rotating k in place and
    # then storing it would.
    @triton.jit
    def _rotate_heads(
        src_ptr, src_stride_head, dst_ptr, dst_stride_head, num_heads, cos, sin, scale,
        HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    ):
        heads = tl.arange(0, BLOCK_HEADS)[:, None]
        cols = tl.arange(0, HALF)[None, :]
        src = src_ptr + heads * src_stride_head + cols
        dst = dst_ptr + heads * dst_stride_head + cols
        mask = heads < num_heads
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32) * scale
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32) * scale
        out1 = (x1 * cos - x2 * sin).to(src_ptr.dtype.element_ty)
        out2 = (x2 * cos + x1 * sin).to(src_ptr.dtype.element_ty)
        tl.store(dst, cast_for_store(out1, dst_ptr), mask=mask)
        tl.store(dst + HALF, cast_for_store(out2, dst_ptr), mask=mask)

    @triton.jit
    def _load_cos_sin(positions_ptr, cache_ptr, token, stride_cache, HALF: tl.constexpr):
        position = tl.load(positions_ptr + token).to(tl.int64)
        cols = tl.arange(0, HALF)
        cos = tl.load(cache_ptr + position * stride_cache + cols)[None, :]
        sin = tl.load(cache_ptr + position * stride_cache + HALF + cols)[None, :]
        return cos, sin

    # One program per token rotates q in place; for slot = slot_mapping[t] >= 0 the rotated k and v go to the cache at
    # [slot // block_size, slot % block_size] (k itself is left as it was). NORM: q, k and v are first scaled by
    # the token's 1/rms of the stream (a RowNorm), in float32.
    @triton.jit
    def _rotary_and_store_kernel(
        q_ptr, k_ptr, v_ptr, positions_ptr, cache_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, stream_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cache,
        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_stream,
        num_q_heads, num_kv_heads, block_size, hidden, eps,
        HALF: tl.constexpr, BLOCK_Q_HEADS: tl.constexpr, BLOCK_KV_HEADS: tl.constexpr, NORM: tl.constexpr,
        BLOCK_HIDDEN: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        token = tl.program_id(0).to(tl.int64)
        cos, sin = _load_cos_sin(positions_ptr, cache_ptr, token, stride_cache, HALF)
        scale = 1.0
        if NORM:
            scale = row_inv_rms(stream_ptr, token, stride_stream, hidden, eps, BLOCK_HIDDEN)
        q = q_ptr + token * stride_qt
        _rotate_heads(q, stride_qh, q, stride_qh, num_q_heads, cos, sin, scale, HALF, BLOCK_Q_HEADS)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            block, offset = slot // block_size, slot % block_size
            k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs
            _rotate_heads(k_ptr + token * stride_kt, stride_kh, k_dst, stride_kch, num_kv_heads, cos, sin, scale,
                          HALF, BLOCK_KV_HEADS)
            heads = tl.arange(0, BLOCK_KV_HEADS)[:, None]
            dims = tl.arange(0, 2 * HALF)[None, :]
            mask = heads < num_kv_heads
            v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
            if NORM:
                v = (v.to(tl.float32) * scale).to(v_ptr.dtype.element_ty)
            v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims
            tl.store(v_dst, cast_for_store(v, v_cache_ptr), mask=mask)


def rotary_embedding_and_store_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                      cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                      slot_mapping: torch.Tensor, norm: RowNorm | None = None) -> torch.Tensor:
    """rotary_embedding_and_store_ref in one kernel: q rotated IN PLACE (views of a fused qkv output are
    fine as long as each head's values are contiguous), the rotated k and v written to their cache slots,
    k itself untouched; returns q. With `norm`, as rope_store_ref scales q, k and v first."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    if half & (half - 1) or q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError("rotary_embedding_and_store_triton needs a power-of-two head_dim and contiguous heads")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("rotary_embedding_and_store_triton needs a KV cache with contiguous heads")
    if num_tokens == 0:
        return q
    block_q = triton.next_power_of_2(num_q_heads)
    stream, eps, block_hidden = row_norm_args(norm, num_tokens, q)
    _rotary_and_store_kernel[(num_tokens,)](
        q, k, v, positions.contiguous(), cos_sin_cache, k_cache, v_cache, slot_mapping.contiguous(), stream,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), stream.stride(0),
        num_q_heads, num_kv_heads, k_cache.shape[1], stream.shape[-1], eps,
        HALF=half, BLOCK_Q_HEADS=block_q, BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
        NORM=norm is not None, BLOCK_HIDDEN=block_hidden,
        num_warps=4 if block_q * half <= 1024 else 8, **pdl_options(q),
    )
    return q
