"""Decode products of a few rows (batch-1 decode) as GEMVs that fetch their weights before the kernel before them
has finished: y = x @ W^T for x [M, K] with M up to GEMV_MAX_ROWS, W [N, K] stored output-major (rows of K
contiguous), optionally with the residual add and RMSNorm before the product and SiLU·mul or, for qkv, the rotary
embedding and the KV-cache store after it, as fused_linear.py's references define them (fused_linear_ref,
fused_norm_linear_ref). fused_linear.py's entry points launch it (launch_gemv) for those row counts and that layout,
or when handed a GemvConfig.

Why: at batch 1 a decoder layer's four products read 120 MB of weights, a few microseconds of HBM time each,
and cuBLAS runs them as separate launches that each pay a ramp-up and a tail with HBM idle. Weights never
depend on the kernel before, so each program here loads its whole slab of W (16 KB: a few rows of K,
so no split-K and no reduction across programs) into registers first, and only then waits for the kernel
before (programmatic dependent launch, ops/pdl.py) to read x. Launched with PDL, the weight stream of one
product runs under the tail of the kernel before it: a layer becomes one stream of weight reads rather than
four ramps. Without PDL (before Hopper) the kernel is a plain GEMV.

Per program: rows n0 .. n0 + BLOCK_N of W (SILU_MUL: gate rows n and up rows N + n, as the merged gate_up
weight holds them; ROPE: pairs, rows j and j + D/2 of a head, so that the program rotates what it computed), all
of K at once (BLOCK_K = K padded to a power of two). Each x row is then
    a = x, s = 1                                                 (plain)
    h = x + residual (rounded, the new residual), a = h * norm_weight, s = rsqrt(mean(h^2) + eps)
                                                                 (NORM; program 0 writes h)
    y[m, n] = s * sum_k W[n, k] * a[k]   in float32, rounded to x's dtype
    y[m, n] = silu(gate) * up            (SILU_MUL; gate and up rounded first, as the unfused path rounds them)
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) for q and k heads; k, v to the cache slot   (ROPE, rotary.py's math)
With a float8 weight (W_SCALED: W[n, k] = w8[n, k] * w_scale[n], fp8.py) the sums are sum_k w8[n, k] * a[k] times
w_scale[n] (a factor of the whole sum), before SiLU·mul or the rotation; the program's slab is then twice the rows.
The norm's 1/rms is a factor of each row's sums rather than of its inputs, so the sum of squares runs beside the
products instead of before them; rms_norm(h) is then never rounded to x's dtype as the reference rounds it (in
float32 the two agree up to the order of the sums).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tinyvllm.ops.pdl import pdl_options, pdl_wait
from tinyvllm.ops.rotary import RopeStore
from tinyvllm.ops.triton_import import tl, triton

GEMV_MAX_ROWS = 4  # rows (tokens) a GEMV takes; more go to the tiled kernels or cuBLAS
_TILE_BYTES = 16384  # weight bytes per program (32 registers a thread at 4 warps): the fastest tile at M = 1


class GemvConfig(NamedTuple):
    block_n: int  # rows of W per program (gate and up rows each, with SILU_MUL; pairs of a head's halves, with ROPE)
    num_warps: int = 4
    # The RMSNorm prologue in the GEMV (each program computes the norm itself) or, False, in layernorm.py's kernel
    # before a plain GEMV (benchmarks/bench_fused.py times both)
    fuse_norm: bool = True
    # A cap on the registers a thread may use (ptxas spills the rest): fewer registers, more programs (and weight
    # bytes in flight) per SM. None: as many as ptxas likes. benchmarks/bench_fused.py --sweep times caps.
    max_registers: int | None = None


def gemv_config(n: int, k: int, paired: bool = False, element_size: int = 2,
                tile_elements: int | None = None) -> GemvConfig:
    """About _TILE_BYTES of weights (or tile_elements) per program, in whole rows of K; paired: the rows come in
    pairs (SILU_MUL's gate and up, ROPE's halves of a head), block_n counting pairs."""
    tile_elements = tile_elements or _TILE_BYTES // element_size
    block_k = triton.next_power_of_2(k)
    slabs = 2 if paired else 1
    block_n = max(1, min(triton.next_power_of_2(n), tile_elements // (block_k * slabs)))
    return GemvConfig(block_n)


if triton is not None:
    from tinyvllm.ops.rotary import cast_for_store

    @triton.jit(do_not_specialize=["M"])
    def _gemv_kernel(
        y_ptr, x_ptr, w_ptr, residual_ptr, new_residual_ptr, norm_weight_ptr,
        positions_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, w_scale_ptr,
        M, N, K, stride_x, stride_r, stride_nr, stride_y, stride_w, eps,
        stride_cs, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, block_size, num_q_heads,
        num_kv_heads,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
        SILU_MUL: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, EVEN_K: tl.constexpr,
        W_SCALED: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        rows = offs_n  # the rows of W this program reads (SILU_MUL, ROPE: and their partners, rows_2)
        rows_2 = offs_n + N  # SILU_MUL: up row N + n of gate row n
        if ROPE:  # offs_n counts pairs (x1, x2) of a head's halves: rows head * 2 HALF + j and that + HALF
            head = offs_n // HALF
            j = offs_n % HALF
            rows = head * (2 * HALF) + j
            rows_2 = rows + HALF
            n_mask = offs_n < N // 2
        offs_k = tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        if EVEN_K:  # (no mask along K: the loads are vectorized)
            k_mask = offs_k < BLOCK_K
        w_mask = n_mask[:, None] & k_mask[None, :]
        # The weights first: they do not depend on the kernel before, so their loads are in flight while it
        # finishes (streamed once: evict them first, keep x and the residual in L2).
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_w + offs_k[None, :], mask=w_mask, other=0.0,
                    eviction_policy="evict_first")
        w_2 = w
        if SILU_MUL or ROPE:
            w_2 = tl.load(w_ptr + rows_2.to(tl.int64)[:, None] * stride_w + offs_k[None, :], mask=w_mask,
                          other=0.0, eviction_policy="evict_first")
        if W_SCALED:  # (the rows' float32 scales, rows_2's for SILU_MUL's up and ROPE's second halves)
            w_scale = tl.load(w_scale_ptr + rows, mask=n_mask, other=0.0)
            w_scale_2 = w_scale
            if SILU_MUL or ROPE:
                w_scale_2 = tl.load(w_scale_ptr + rows_2, mask=n_mask, other=0.0)
        norm_weight = tl.zeros((BLOCK_K,), dtype=x_ptr.dtype.element_ty)
        if NORM:  # (a weight too: it does not depend on the kernel before either)
            norm_weight = tl.load(norm_weight_ptr + offs_k, mask=k_mask, other=0.0)
        pdl_wait(USE_PDL)

        for m in range(M):
            a = tl.load(x_ptr + m * stride_x + offs_k, mask=k_mask, other=0.0)
            scale = 1.0
            if NORM:
                if HAS_RESIDUAL:
                    r = tl.load(residual_ptr + m * stride_r + offs_k, mask=k_mask, other=0.0)
                    a = (a.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
                    if pid == 0:
                        tl.store(new_residual_ptr + m * stride_nr + offs_k, a, mask=k_mask)
                # rms_norm(h) = h * norm_weight * inv_rms, and inv_rms is one number per row: it scales the
                # products' sums instead of h, so the sum of squares is not on the way to the products.
                h = a.to(tl.float32)
                scale = tl.rsqrt(tl.sum(h * h, axis=0) / K + eps)
                a = h * norm_weight.to(tl.float32)
            a = a.to(tl.float32)[None, :]
            acc = tl.sum(w.to(tl.float32) * a, axis=1) * scale
            acc_2 = acc  # (SILU_MUL: up; ROPE: the heads' second halves)
            if SILU_MUL or ROPE:
                acc_2 = tl.sum(w_2.to(tl.float32) * a, axis=1) * scale
            if W_SCALED:
                acc, acc_2 = acc * w_scale, acc_2 * w_scale_2
            if SILU_MUL:
                gate = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
                up = acc_2.to(y_ptr.dtype.element_ty).to(tl.float32)
                acc = gate / (1.0 + tl.exp(-gate)) * up
            if ROPE:
                _rope_store(y_ptr + m * stride_y, acc, acc_2, rows, rows_2,
                            head, j, n_mask, tl.load(positions_ptr + m).to(tl.int64),
                            tl.load(slot_ptr + m).to(tl.int64), cos_sin_ptr, k_cache_ptr, v_cache_ptr, stride_cs,
                            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, block_size, num_q_heads,
                            num_kv_heads, HALF)
            else:
                tl.store(y_ptr + m * stride_y + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)

    @triton.jit
    def _rope_store(y_row, acc_1, acc_2, rows, rows_2, head, j, mask, position, slot, cos_sin_ptr, k_cache_ptr,
                    v_cache_ptr, stride_cs, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    block_size, num_q_heads, num_kv_heads, HALF: tl.constexpr):
        """One row's qkv outputs x1 = acc_1 (rows: the first halves of heads), x2 = acc_2 (rows_2: the second
        halves), as rotary.py's kernel treats a qkv product: rounded, then q and k heads rotated in float32 at
        `position`; y gets q rotated and k, v as they are, and for slot >= 0 the cache gets the rotated k and v."""
        x1 = acc_1.to(y_row.dtype.element_ty)
        x2 = acc_2.to(y_row.dtype.element_ty)
        cos = tl.load(cos_sin_ptr + position * stride_cs + j, mask=mask, other=1.0)
        sin = tl.load(cos_sin_ptr + position * stride_cs + HALF + j, mask=mask, other=0.0)
        rotate = head < num_q_heads + num_kv_heads  # (q and k; v is not rotated)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        r1 = tl.where(rotate, f1 * cos - f2 * sin, f1).to(y_row.dtype.element_ty)
        r2 = tl.where(rotate, f2 * cos + f1 * sin, f2).to(y_row.dtype.element_ty)
        is_q = head < num_q_heads
        tl.store(y_row + rows, tl.where(is_q, r1, x1), mask=mask)
        tl.store(y_row + rows_2, tl.where(is_q, r2, x2), mask=mask)
        if slot >= 0:
            block, offset = slot // block_size, slot % block_size
            kv_head = head - num_q_heads
            is_k = mask & (kv_head >= 0) & (kv_head < num_kv_heads)
            k_dst = k_cache_ptr + block * stride_kb + offset * stride_ks + kv_head * stride_kh + j
            tl.store(k_dst, cast_for_store(r1, k_cache_ptr), mask=is_k)
            tl.store(k_dst + HALF, cast_for_store(r2, k_cache_ptr), mask=is_k)
            v_head = kv_head - num_kv_heads
            is_v = mask & (v_head >= 0)
            v_dst = v_cache_ptr + block * stride_vb + offset * stride_vs + v_head * stride_vh + j
            tl.store(v_dst, cast_for_store(x1, v_cache_ptr), mask=is_v)
            tl.store(v_dst + HALF, cast_for_store(x2, v_cache_ptr), mask=is_v)


def launch_gemv(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stride_w: int, residual: torch.Tensor,
                new_residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float, silu_and_mul: bool,
                config: GemvConfig | None = None, rope: RopeStore | None = None,
                weight_scale: torch.Tensor | None = None) -> None:
    """Write y [M, N] (silu_and_mul: N = half of W's rows) for x [M, K] (rows contiguous) and W[n, k] at
    n * stride_w + k; with norm_weight, rms_norm(x + residual) multiplies W and, with new_residual, x + residual
    goes there (fused_linear._launch allocates the outputs and passes x as the residual when there is none); with
    rope (y a qkv product), q rotated in y and k, v into the cache, as rotary.rope_store_ref does; with weight_scale
    (float32, one per row of W), W is float8 and its rows' sums are scaled."""
    m, k = x.shape
    n = y.shape[1]
    config = config or gemv_config(n, k, silu_and_mul or rope is not None, weight.element_size())
    block_k = triton.next_power_of_2(k)
    nres = new_residual if new_residual is not None else x
    if rope is None:
        programs = triton.cdiv(n, config.block_n)
        tensors, strides, half = (x,) * 5, (0,) * 7, 1
        block_size = num_q_heads = num_kv_heads = 0
    else:
        kc, vc = rope.k_cache, rope.v_cache
        half = kc.shape[-1] // 2
        assert n == (rope.num_q_heads + 2 * rope.num_kv_heads) * 2 * half and half & (half - 1) == 0, (n, half)
        assert kc.stride(-1) == vc.stride(-1) == rope.cos_sin_cache.stride(-1) == 1
        programs = triton.cdiv(n // 2, config.block_n)  # (block_n counts pairs of a head's halves)
        tensors = (rope.positions, rope.cos_sin_cache, kc, vc, rope.slot_mapping)
        strides = (rope.cos_sin_cache.stride(0), kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0),
                   vc.stride(1), vc.stride(2))
        block_size, num_q_heads, num_kv_heads = kc.shape[1], rope.num_q_heads, rope.num_kv_heads
    _gemv_kernel[(programs,)](
        y, x, weight, residual, nres, norm_weight if norm_weight is not None else x, *tensors,
        weight_scale if weight_scale is not None else x,
        m, n, k, x.stride(0), residual.stride(0), nres.stride(0), y.stride(0), stride_w, eps, *strides,
        block_size, num_q_heads, num_kv_heads,
        BLOCK_N=config.block_n, BLOCK_K=block_k, NORM=norm_weight is not None, HAS_RESIDUAL=new_residual is not None,
        SILU_MUL=silu_and_mul, ROPE=rope is not None, HALF=half, EVEN_K=k == block_k,
        W_SCALED=weight_scale is not None, num_warps=config.num_warps,
        num_stages=1, **pdl_options(x), **({} if config.max_registers is None else {"maxnreg": config.max_registers}),
    )
