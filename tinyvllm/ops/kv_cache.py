"""KV store: write this step's new keys and values into their paged-cache slots."""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU engine imports the reference on machines without Triton
    triton = None

from tinyvllm.ops.pdl import pdl_options, pdl_wait


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v [T, Hk, D] into k_cache, v_cache [num_blocks, block_size, Hk, D] at flat slot
    slot_mapping[t] = block * block_size + offset; a slot of -1 (padding) is skipped. In place."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[valid].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[valid].to(v_cache.dtype)


if triton is not None:

    # One program per token t with slot = slot_mapping[t] >= 0:
    #   k_cache[slot // block_size, slot % block_size, :, :] = k[t]   (and the same for v)
    @triton.jit
    def _store_kv_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
        num_kv_heads, block_size,
        HEAD_DIM: tl.constexpr, BLOCK_HEADS: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            block, offset = slot // block_size, slot % block_size
            heads = tl.arange(0, BLOCK_HEADS)[:, None]
            dims = tl.arange(0, HEAD_DIM)[None, :]
            mask = heads < num_kv_heads
            k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
            v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
            k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims
            v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims
            tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The Triton kernel of store_kv_ref: one program per token, padding slots (-1) skipped. In place."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if head_dim & (head_dim - 1) or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("store_kv_triton needs a power-of-two head_dim and contiguous heads")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("store_kv_triton needs a KV cache with contiguous heads")
    if num_tokens == 0:
        return
    block_heads = triton.next_power_of_2(num_kv_heads)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping.contiguous(),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads, k_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_HEADS=block_heads, num_warps=4 if block_heads * head_dim <= 2048 else 8,
        **pdl_options(k_cache),
    )
