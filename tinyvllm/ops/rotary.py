"""Rotary position embedding (the rotate-half layout of Hugging Face Llama), with Llama 3 scaling."""

from __future__ import annotations

import math
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU engine imports the reference on machines without Triton
    triton = None


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


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] rotated by their token's position; returns new (q, k).

    With x = (x1, x2) the two halves of a head: out = (x1*cos - x2*sin, x2*cos + x1*sin)."""
    half = q.shape[-1] // 2
    cos, sin = cos_sin_cache[positions].unsqueeze(1).split(half, dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().split(half, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


if triton is not None:

    # One program per token rotates all its heads of q and k in place; with (x1, x2) the halves of a head,
    # (cos, sin) = cos_sin_cache[position]:   x1' = x1*cos - x2*sin,   x2' = x2*cos + x1*sin   (in float32).
    @triton.jit
    def _rotate_heads(x_ptr, stride_head, num_heads, cos, sin, HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr):
        heads = tl.arange(0, BLOCK_HEADS)
        cols = tl.arange(0, HALF)
        first = x_ptr + heads[:, None] * stride_head + cols[None, :]
        mask = heads[:, None] < num_heads
        x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(
        q_ptr, k_ptr, positions_ptr, cache_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_cache, num_q_heads, num_kv_heads,
        HALF: tl.constexpr, BLOCK_Q_HEADS: tl.constexpr, BLOCK_KV_HEADS: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        position = tl.load(positions_ptr + token).to(tl.int64)
        cols = tl.arange(0, HALF)
        cos = tl.load(cache_ptr + position * stride_cache + cols)[None, :]
        sin = tl.load(cache_ptr + position * stride_cache + HALF + cols)[None, :]
        _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, cos, sin, HALF, BLOCK_Q_HEADS)
        _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, cos, sin, HALF, BLOCK_KV_HEADS)


def rotary_embedding_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_embedding_ref's rotation, done IN PLACE on q and k (views of a fused qkv output are fine
    as long as each head's values are contiguous); returns (q, k)."""
    num_tokens, num_q_heads, head_dim = q.shape
    half = head_dim // 2
    if half & (half - 1) or q.stride(2) != 1 or k.stride(2) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError("rotary_embedding_triton needs a power-of-two head_dim and contiguous heads")
    if num_tokens == 0:
        return q, k
    block_q = triton.next_power_of_2(num_q_heads)
    _rotary_kernel[(num_tokens,)](
        q, k, positions.contiguous(), cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0), num_q_heads, k.shape[1],
        HALF=half, BLOCK_Q_HEADS=block_q, BLOCK_KV_HEADS=triton.next_power_of_2(k.shape[1]),
        num_warps=4 if block_q * half <= 1024 else 8,
    )
    return q, k
