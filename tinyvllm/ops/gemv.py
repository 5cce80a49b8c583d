"""Decode products of a few rows (batch-1 decode) as GEMVs that fetch their weights before the kernel before them
has finished: y = x @ W^T for x [M, K] with M up to GEMV_MAX_ROWS, W [N, K] stored output-major (rows of K
contiguous), optionally with the residual add and RMSNorm before the product and SiLU·mul after it, as
fused_linear.py's references define them (fused_linear_ref, fused_norm_linear_ref). fused_linear.py's entry points
launch it (launch_gemv) for those row counts and that layout, or when handed a GemvConfig.

Why: at batch 1 a decoder layer's four products read 120 MB of weights, a few microseconds of HBM time each,
and cuBLAS runs them as separate launches that each pay a ramp-up and a tail with HBM idle. Weights never
depend on the kernel before, so each program here loads its whole slab of W (16 KB: a few rows of K,
so no split-K and no reduction across programs) into registers first, and only then waits for the kernel
before (programmatic dependent launch, ops/pdl.py) to read x. Launched with PDL, the weight stream of one
product runs under the tail of the kernel before it: a layer becomes one stream of weight reads rather than
four ramps. Without PDL (before Hopper, or TINYVLLM_PDL=0) the kernel is a plain GEMV.

Per program: rows n0 .. n0 + BLOCK_N of W (SILU_MUL: gate rows n and up rows N + n, as the merged gate_up
weight holds them), all of K at once (BLOCK_K = K padded to a power of two). Each x row is then
    a = x                                                        (plain)
    h = x + residual (rounded, the new residual), a = rms_norm(h)  (NORM; program 0 writes h)
    y[m, n] = sum_k W[n, k] * a[k]       in float32, rounded to x's dtype
    y[m, n] = silu(gate) * up            (SILU_MUL; gate and up rounded first, as the unfused path rounds them)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU engine imports the references on machines without Triton
    triton = None

from tinyvllm.ops.pdl import pdl_options, pdl_wait

GEMV_MAX_ROWS = 4  # rows (tokens) a GEMV takes; more go to the tiled kernels or cuBLAS
_TILE_BYTES = 16384  # weight bytes per program (32 registers a thread at 4 warps): the fastest tile at M = 1


class GemvConfig(NamedTuple):
    block_n: int  # rows of W per program (gate and up rows each, with SILU_MUL)
    num_warps: int = 4


def gemv_config(n: int, k: int, silu_and_mul: bool = False, element_size: int = 2,
                tile_elements: int | None = None) -> GemvConfig:
    """About _TILE_BYTES of weights (or tile_elements) per program, in whole rows of K."""
    tile_elements = tile_elements or _TILE_BYTES // element_size
    block_k = triton.next_power_of_2(k)
    slabs = 2 if silu_and_mul else 1
    block_n = max(1, min(triton.next_power_of_2(n), tile_elements // (block_k * slabs)))
    return GemvConfig(block_n)


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _gemv_kernel(
        y_ptr, x_ptr, w_ptr, residual_ptr, new_residual_ptr, norm_weight_ptr,
        M, N, K, stride_x, stride_r, stride_nr, stride_y, stride_w, eps,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
        SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        if EVEN_K:  # (no mask along K: the loads are vectorized)
            k_mask = offs_k < BLOCK_K
        w_mask = (offs_n[:, None] < N) & k_mask[None, :]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + offs_k[None, :]
        # The weights first: they do not depend on the kernel before, so their loads are in flight while it
        # finishes (streamed once: evict them first, keep x and the residual in L2).
        w = tl.load(w_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
        w_up = w
        if SILU_MUL:
            w_up = tl.load(w_ptrs + N * stride_w, mask=w_mask, other=0.0, eviction_policy="evict_first")
        pdl_wait(USE_PDL)

        norm_weight = tl.zeros((BLOCK_K,), dtype=tl.float32)
        if NORM:
            norm_weight = tl.load(norm_weight_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        for m in range(M):
            a = tl.load(x_ptr + m * stride_x + offs_k, mask=k_mask, other=0.0)
            if NORM:
                if HAS_RESIDUAL:
                    r = tl.load(residual_ptr + m * stride_r + offs_k, mask=k_mask, other=0.0)
                    a = (a.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
                    if pid == 0:
                        tl.store(new_residual_ptr + m * stride_nr + offs_k, a, mask=k_mask)
                h = a.to(tl.float32)
                inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / K + eps)
                a = (h * inv_rms * norm_weight).to(x_ptr.dtype.element_ty)
            a = a.to(tl.float32)[None, :]
            acc = tl.sum(w.to(tl.float32) * a, axis=1)
            if SILU_MUL:
                gate = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
                up = tl.sum(w_up.to(tl.float32) * a, axis=1).to(y_ptr.dtype.element_ty).to(tl.float32)
                acc = gate / (1.0 + tl.exp(-gate)) * up
            tl.store(y_ptr + m * stride_y + offs_n, acc.to(y_ptr.dtype.element_ty), mask=offs_n < N)


def launch_gemv(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stride_w: int, residual: torch.Tensor,
                new_residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float, silu_and_mul: bool,
                config: GemvConfig | None = None) -> None:
    """Write y [M, N] (silu_and_mul: N = half of W's rows) for x [M, K] (rows contiguous) and W[n, k] at
    n * stride_w + k; with norm_weight, rms_norm(x + residual) multiplies W and, with new_residual, x + residual
    goes there (fused_linear._launch allocates the outputs and passes x as the residual when there is none)."""
    m, k = x.shape
    n = y.shape[1]
    config = config or gemv_config(n, k, silu_and_mul, x.element_size())
    block_k = triton.next_power_of_2(k)
    nres = new_residual if new_residual is not None else x
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        y, x, weight, residual, nres, norm_weight if norm_weight is not None else x,
        m, n, k, x.stride(0), residual.stride(0), nres.stride(0), y.stride(0), stride_w, eps,
        BLOCK_N=config.block_n, BLOCK_K=block_k, NORM=norm_weight is not None, HAS_RESIDUAL=new_residual is not None,
        SILU_MUL=silu_and_mul, EVEN_K=k == block_k, num_warps=config.num_warps, num_stages=1, **pdl_options(x),
    )
