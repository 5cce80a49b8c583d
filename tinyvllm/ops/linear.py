"""Skinny matrix products y = x @ W^T at decode sizes: x [M, K] with M from 1 to ~64, W [N, K].

At decode the products read every weight once and do 2*M FLOPs per weight element, so they are copies of W
with a little arithmetic: their floor is W's bytes over the copy bandwidth. On the H200 cuBLAS reaches that on
the large shapes but not on the small ones (benchmarks/RESULTS.md): too few blocks, or a separate split-K reduce
kernel. The kernel here splits W into
enough tiles to keep every SM streaming (splitting K where N alone gives too few), and the last program of
each column tile to finish sums the split partials in the same launch (a counter per tile), so a product is
one launch whatever the split.

W comes as F.linear takes it, [N, K], in either layout the engine stores: output-major (rows of K
contiguous: the tied LM head) or input-major (stride (1, N): the projections on CUDA, model/loader.py).
The kernel has two paths: a GEMV on the CUDA cores (BLOCK_M = 1, M = 1) and tl.dot on tiles of BLOCK_M >= 16
rows; skinny_matmul_config picks the GEMV for one row of the LM head's layout only."""

from __future__ import annotations

from typing import NamedTuple

import torch

from tinyvllm.ops.pdl import pdl_options, pdl_wait
from tinyvllm.ops.triton_import import tl, triton


class SkinnyConfig(NamedTuple):
    """Launch parameters of one product. block_m == 1 selects the GEMV path (M must be 1)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


def skinny_matmul_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x @ weight^T (F.linear without bias): x [..., K], weight [N, K] -> [..., N], computed in float32
    and returned in x's dtype."""
    return (x.float() @ weight.float().t()).to(x.dtype)


_CPU_SMS = 132  # under the interpreter: an H100/H200's count, so that tests pick the splits a GPU would
_PROGRAMS_PER_SM = 2  # up to 32-row tiles; one per SM for 64-row tiles, which do four times the work
_MAX_SPLIT = 64


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def skinny_matmul_config(m: int, n: int, k: int, k_contiguous: bool, num_sms: int = _CPU_SMS) -> SkinnyConfig:
    """Tiles and split from the shape, as the H200 sweeps of benchmarks/bench_gemv.py --sweep ranked
    them (benchmarks/RESULTS.md). A GEMV for one row of the LM head's layout (rows of K contiguous: 16 rows of
    W per program, 512-byte runs of each). Otherwise tl.dot on 64 columns, 16-64 rows and K steps of 128: at
    M = 1 the rows padded to 16 cost no bandwidth, and its pipelined K loop (cp.async, 3 stages) streamed the
    input-major projections as well as or better than the CUDA-core GEMV did."""
    if m == 1 and k_contiguous:
        block_m, block_n, block_k = 1, 16, 256
    else:
        block_m, block_n, block_k = min(max(16, triton.next_power_of_2(m)), 64), 64, 128
    block_k = min(block_k, max(triton.next_power_of_2(k), 16))
    return SkinnyConfig(block_m, block_n, block_k, split_k_for(m, n, k, block_m, block_n, block_k, num_sms))


def split_k_for(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, num_sms: int) -> int:
    """The largest power-of-two split of K that keeps the grid within _PROGRAMS_PER_SM programs per SM (one
    for 64-row tiles) and leaves at least two BLOCK_K steps per split (the loop's loads then overlap): more,
    smaller programs each move less and leave a larger reduce to the last program of a tile."""
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    target = (1 if block_m >= 64 else _PROGRAMS_PER_SM) * num_sms
    split = 1
    while 2 * split <= _MAX_SPLIT and tiles * 2 * split <= target and k >= 2 * (2 * split) * block_k:
        split *= 2
    return split


if triton is not None:

    # y[m, n] = sum_k x[m, k] * W[n, k], float32 accumulation. Program (n tile, k split, m tile) covers
    # columns n0 .. n0 + BLOCK_N and the k range [k0, k0 + k_per_split):
    #   GEMV (BLOCK_M == 1):  acc[k, n] += x[k] * W[n, k] per step, summed over k once at the end;
    #   dot  (BLOCK_M >= 16): acc[m, n] += x[m, k-tile] @ W^T[k-tile, n].
    # SPLIT_K == 1 stores y; otherwise the partial goes to partial[split, m, n], and after a CTA barrier one
    # thread's acq_rel atomic counts the tile's arrivals (the pattern of CUTLASS's split-K semaphore: barrier, then
    # a release by one thread); the program that arrives last reads the SPLIT_K partials from L2, in split order
    # (deterministic), stores y and resets the counter.
    @triton.jit(do_not_specialize=["M"])  # the batch varies per step: one compile for every M
    def _skinny_matmul_kernel(
        y_ptr, x_ptr, w_ptr, partial_ptr, counter_ptr,
        M, N, K, stride_xm, stride_ym, stride_w, k_per_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        W_K_CONTIGUOUS: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        k_start = pid_k * k_per_split  # k_per_split is a multiple of BLOCK_K: only k >= K needs a mask
        k_end = tl.minimum(k_start + k_per_split, K)
        if W_K_CONTIGUOUS:
            w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_w  # W[n, k] at n * stride_w + k
        else:
            w_cols = w_ptr + offs_n[None, :]  # W[n, k] at k * stride_w + n
        if BLOCK_M == 1:
            acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if W_K_CONTIGUOUS:
                w_ptrs = w_cols + offs_k[:, None]
            else:
                w_ptrs = w_cols + offs_k.to(tl.int64)[:, None] * stride_w
            w = tl.load(w_ptrs, mask=(offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
            if BLOCK_M == 1:
                xk = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)
                acc += w.to(tl.float32) * xk.to(tl.float32)[:, None]
            else:
                x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
                xt = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
                acc = tl.dot(xt, w, acc, input_precision=PRECISION)
        if BLOCK_M == 1:
            acc = tl.sum(acc, axis=0)[None, :]

        out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
        else:
            mn = offs_m[:, None] * N + offs_n[None, :]
            tl.store(partial_ptr + pid_k * M * N + mn, acc, mask=out_mask)
            tl.debug_barrier()  # every thread's partial stored before the release below
            tile = pid_m * tl.num_programs(0) + pid_n
            arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(partial_ptr + s * M * N + mn, mask=out_mask, other=0.0, cache_modifier=".cg")
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next launch


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split-K reduce's arrival counters, one per output tile, zero between launches (the last program of
    each tile resets its own). One buffer per device, shared by every launch: products on one stream run
    one after the other (PDL too waits for the kernel before), but two products running at once on two
    streams must not both split K."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        counters = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def _weight_layout(weight: torch.Tensor) -> tuple[torch.Tensor, bool, int]:
    """(weight, k_contiguous, stride_w): W[n, k] lives at n * stride_w + k or at k * stride_w + n."""
    if weight.stride(1) == 1 and (weight.stride(0) >= weight.shape[1] or weight.shape[0] == 1):
        return weight, True, weight.stride(0)
    if weight.stride(0) == 1 and weight.stride(1) >= weight.shape[0]:
        return weight, False, weight.stride(1)
    weight = weight.contiguous()
    return weight, True, weight.stride(0)


def skinny_matmul_triton(
    x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The Triton kernel of skinny_matmul_ref: x [..., K], weight [N, K] in either layout -> [..., N].
    `config` overrides skinny_matmul_config (the sweep and the tests); `out` [M, N] (contiguous) receives y
    (the checks poison it first)."""
    k = x.shape[-1]
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.dtype == x.dtype, (x.shape, x.dtype, weight.shape, weight.dtype)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*x.shape[:-1], n)
    weight, k_contiguous, stride_w = _weight_layout(weight)
    cfg = config or skinny_matmul_config(m, n, k, k_contiguous, _num_sms(x.device))
    assert cfg.block_m > 1 or m == 1, "the GEMV path (block_m == 1) takes one row"
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # rounding k_per_split up can leave fewer splits than asked
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, cfg.block_m))
    partial = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    counters = _counters(x.device, grid[0] * grid[2]) if split > 1 else out
    pdl = pdl_options(x2)
    _skinny_matmul_kernel[grid](
        out, x2, weight, partial, counters,
        m, n, k, x2.stride(0), out.stride(0), stride_w, k_per_split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split, W_K_CONTIGUOUS=k_contiguous,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )
    return out.reshape(*x.shape[:-1], n)
