"""Decode-sized matrix products y = x @ W^T (x [M, K], M up to ~64) with what surrounds them in a decoder layer
fused into the same launch:

- `fused_norm_linear`: the residual add and RMSNorm as the prologue (qkv_proj after input_layernorm, gate_up_proj
  after post_attention_layernorm). Every program recomputes its rows' rms over the whole K (small: the hidden
  size) instead of waiting for a separate norm kernel; the programs of the first column tile write the new
  residual stream.
- `silu_and_mul=True` (gate_up): each program's column tile covers gate columns j and the matching up columns
  I + j of W, so it writes silu(gate) * up [M, I] and never the [M, 2I] product.
- `linear_argmax`: the LM head with greedy argmax. Each program takes the max of its vocabulary tile's logits and
  packs (value, index) into one int64 whose order is the argmax's; a 64-bit atomic max gathers the rows' keys,
  and the last program to arrive unpacks them into token ids: no logits are written.
- `fused_linear`: the plain product (o_proj, down_proj), as linear.py's kernel, with the early weight loads below.

Each takes float8 weights too (fp8.py's layout): weight float8_e4m3fn [N, K] and `weight_scale` float32 [N], the
weight being weight * weight_scale[:, None]. The kernels then read the float8 bytes (half the bf16 path's), convert
them exactly to x's dtype (or float32) for the products, keep x as it is, and multiply each output column's float32
sum by its scale (a factor of the whole K sum) before the epilogue: before SiLU·mul (gate and up columns each by
their own), the argmax's comparison and the rotary embedding.

Up to gemv.GEMV_MAX_ROWS rows of an output-major weight, the same entry points launch gemv.py's GEMV instead (one
program per few whole rows of W, every weight loaded before the PDL wait): at batch 1 it is faster than both
cuBLAS and this tiled kernel (benchmarks/RESULTS.md).

Tiles and split-K are linear.py's (skinny_matmul_config; the split partials summed in the launch by the last
program of each tile, in split order). With programmatic dependent launch (ops/pdl.py) each program loads its
first weight tile before it waits for the kernel before: weights never depend on it, so their stream starts while
that kernel drains; x and the residual are read after the wait.

Each op has a plain-PyTorch reference (`*_ref`) beside it. tinyvllm/ops/__init__.py says when the model uses
these kernels (use_decode_kernel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinyvllm.ops.activation import silu_and_mul_ref
from tinyvllm.ops.fp8 import FP8_DTYPE, dequantize_fp8_weight
from tinyvllm.ops.gemv import GEMV_MAX_ROWS, GemvConfig, launch_gemv
from tinyvllm.ops.layernorm import _launch_rms_norm, fused_add_rms_norm_ref, rms_norm_ref
from tinyvllm.ops.linear import SkinnyConfig, _counters, _num_sms, _weight_layout, skinny_matmul_config
from tinyvllm.ops.pdl import pdl_options, pdl_wait
from tinyvllm.ops.rotary import RopeStore, rope_store_ref, rope_store_triton
from tinyvllm.ops.triton_import import tl, triton

_EMPTY_KEY = -(2**63 - 1)  # below every packed (value, index) key: what the argmax keys hold between launches
_NORM_ELEMENTS = 4096  # elements of x per step of the prologue's sum of squares (BLOCK_M rows x NORM_BLOCK)


# ------------------------------------------------------------------------------------------------- references


def _float_weight(weight: torch.Tensor, weight_scale: torch.Tensor | None) -> torch.Tensor:
    """The weight the references multiply by, in float32: weight, or float8 weight times its per-channel scale."""
    return weight.float() if weight_scale is None else dequantize_fp8_weight(weight, weight_scale)


def fused_linear_ref(x: torch.Tensor, weight: torch.Tensor, silu_and_mul: bool = False, *,
                     weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight^T (weight [N, K]) in float32, rounded to x's dtype; silu_and_mul: then the MLP's gate,
    silu(y[:, :N/2]) * y[:, N/2:]. weight_scale [N] float32: weight is float8 e4m3 and the product's weight
    weight * weight_scale[:, None] (fp8.py)."""
    y = F.linear(x.float(), _float_weight(weight, weight_scale)).to(x.dtype)
    return silu_and_mul_ref(y) if silu_and_mul else y


def fused_norm_linear_ref(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    silu_and_mul: bool = False, rope: RopeStore | None = None, *, weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fused_linear(rms_norm(x + residual)), x + residual): the norm and the product as the model runs them one
    after the other, each rounded to x's dtype. Without a residual (the first layer) the stream is x itself. With
    rope (qkv_proj): then rotary.rope_store_ref, which rotates q in the product and stores k and v in the cache.
    weight_scale: a float8 weight, as fused_linear_ref takes it."""
    if residual is None:
        normed, new_residual = rms_norm_ref(x, norm_weight, eps), x
    else:
        normed, new_residual = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
    y = fused_linear_ref(normed, weight, silu_and_mul, weight_scale=weight_scale)
    return (y if rope is None else rope_store_ref(y, rope)), new_residual


def linear_argmax_ref(x: torch.Tensor, weight: torch.Tensor, *,
                      weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """argmax over the vocabulary of the logits x @ weight^T, computed in float32 and rounded to x's dtype (as the
    logits the sampler reads): int64 [M], the lowest index on a tie. weight_scale: a float8 weight, as
    fused_linear_ref takes it."""
    return torch.argmax(F.linear(x.float(), _float_weight(weight, weight_scale)).to(x.dtype), dim=-1)


# ---------------------------------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _inv_rms(x_ptr, residual_ptr, offs_m, M, K, stride_x, stride_r, eps,
                 HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, NORM_BLOCK: tl.constexpr):
        """rsqrt(mean(h^2) + eps) per row, h = x + residual rounded to x's dtype (as the residual stream is)."""
        squares = tl.zeros((BLOCK_M, NORM_BLOCK), dtype=tl.float32)
        for k0 in range(0, K, NORM_BLOCK):
            cols = k0 + tl.arange(0, NORM_BLOCK)
            mask = (offs_m[:, None] < M) & (cols[None, :] < K)
            h = tl.load(x_ptr + offs_m[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(residual_ptr + offs_m[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
                h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            h = h.to(tl.float32)
            squares += h * h
        return tl.rsqrt(tl.sum(squares, axis=1) / K + eps)

    @triton.jit
    def _activation(x_ptr, residual_ptr, new_residual_ptr, norm_weight_ptr, rows, cols, inv_rms, residual_rows,
                    M, K, stride_x, stride_r, stride_nr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        """The product's input at [rows, cols] (index tensors that broadcast to the tile), in x's dtype: x, or
        NORM: rms_norm(x + residual) rounded as the separate norm kernel rounds it. Rows below residual_rows (M in
        the first column tile's programs, else 0) write x + residual to the new residual stream."""
        mask = (rows < M) & (cols < K)
        x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
        if NORM:
            if HAS_RESIDUAL:
                r = tl.load(residual_ptr + rows * stride_r + cols, mask=mask, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
                tl.store(new_residual_ptr + rows * stride_nr + cols, x, mask=(rows < residual_rows) & (cols < K))
            w = tl.load(norm_weight_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * inv_rms * w).to(x_ptr.dtype.element_ty)
        return x

    @triton.jit
    def _multiply_add(acc, activation, w, GEMV: tl.constexpr, PRECISION: tl.constexpr):
        """GEMV: acc[k, n] += w[k, n] * x[k] (activation [BLOCK_K, 1]); else acc += activation @ w. (A float8 weight
        becomes float32, or x's dtype for tl.dot: exact, e4m3's values are all bf16, fp16 and float32 values; the
        weight in x's dtype is a no-op.)"""
        if GEMV:
            acc = acc + w.to(tl.float32) * activation.to(tl.float32)
        else:
            acc = tl.dot(activation, w.to(activation.dtype), acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def _scale_columns(acc, acc_up, scale_ptr, offs_n, N, SILU_MUL: tl.constexpr):
        """A float8 weight's per-channel scale on the sums: W[n, k] = w8[n, k] * scale[n], so column n's K sum is
        scale[n] * sum_k x[k] w8[n, k]; the up columns' scales are those of W's rows N + n."""
        acc = acc * tl.load(scale_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
        if SILU_MUL:
            acc_up = acc_up * tl.load(scale_ptr + N + offs_n, mask=offs_n < N, other=0.0)[None, :]
        return acc, acc_up

    @triton.jit
    def _store_product(y_ptr, acc, acc_up, rows, cols, M, N, stride_y, SILU_MUL: tl.constexpr):
        """y = acc, or SILU_MUL: silu(gate) * up with gate and up rounded to y's dtype first (as the separate
        product writes them and silu_and_mul reads them)."""
        if SILU_MUL:
            gate = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
            up = acc_up.to(y_ptr.dtype.element_ty).to(tl.float32)
            acc = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(y_ptr + rows * stride_y + cols, acc.to(y_ptr.dtype.element_ty), mask=(rows < M) & (cols < N))

    @triton.jit
    def _weight_tiles(w_cols, up_shift, w_k_stride, k0, offs_n, N, K, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr):
        """W^T[k0 .. k0 + BLOCK_K, the program's columns] as [BLOCK_K, BLOCK_N], and (SILU_MUL) the up columns."""
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w_ptrs = w_cols + offs_k.to(tl.int64)[:, None] * w_k_stride
        mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
        w = tl.load(w_ptrs, mask=mask, other=0.0)
        w_up = w
        if SILU_MUL:
            w_up = tl.load(w_ptrs + up_shift, mask=mask, other=0.0)
        return w, w_up

    @triton.jit
    def _k_step(acc, acc_up, w, w_up, k0, x_ptr, residual_ptr, new_residual_ptr, norm_weight_ptr, rows, inv_rms,
                residual_rows, M, K, stride_x, stride_r, stride_nr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr, GEMV: tl.constexpr, PRECISION: tl.constexpr):
        """One K step: the activation tile at k0 .. k0 + BLOCK_K times the weight tiles, into the accumulators."""
        offs_k = k0 + tl.arange(0, BLOCK_K)
        cols = offs_k[:, None] if GEMV else offs_k[None, :]
        a = _activation(x_ptr, residual_ptr, new_residual_ptr, norm_weight_ptr, rows, cols, inv_rms, residual_rows,
                        M, K, stride_x, stride_r, stride_nr, NORM, HAS_RESIDUAL)
        acc = _multiply_add(acc, a, w, GEMV, PRECISION)
        if SILU_MUL:
            acc_up = _multiply_add(acc_up, a, w_up, GEMV, PRECISION)
        return acc, acc_up

    # y[m, n] = sum_k a[m, k] * W[n, k] with a = x, or (NORM) rms_norm(x + residual) * norm_weight; float32
    # accumulation. Program (n tile, k split, m tile) covers output columns n0 .. n0 + BLOCK_N over the k range
    # [k0, k0 + k_per_split), on the CUDA cores (BLOCK_M == 1, acc[k, n]) or through tl.dot (acc[m, n]).
    #   SILU_MUL: N = I output columns; the program also accumulates W's rows I + n (up) and writes silu(gate)*up.
    #   ARGMAX:   per row, the tile's max logit v and its first column j become the key
    #             (order-preserving int32 of v) << 32 | (2^32 - 1 - j), so that the largest key is the largest v
    #             and, on a tie, the lowest j (as torch.argmax); atomic max into keys[m]; the program that arrives
    #             last (a counter per m tile) writes j of the final key to y[m] and resets keys and counter.
    #   SPLIT_K > 1: partials to partial[split, m, :], summed in split order by the tile's last program (linear.py's
    #             serial reduce), which then stores as SPLIT_K == 1 does.
    #   W_SCALED: W is float8 with a float32 scale per row (output column): the sums are scaled before the epilogue
    #             (by the tile's last program, with split K).
    @triton.jit(do_not_specialize=["M"])  # the batch varies per step: one compile for every M
    def _fused_linear_kernel(
        y_ptr, x_ptr, w_ptr, residual_ptr, new_residual_ptr, norm_weight_ptr, partial_ptr, counter_ptr, keys_ptr,
        scale_ptr, M, N, K, stride_x, stride_r, stride_nr, stride_y, stride_w, k_per_split, eps,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr,
        SPLIT_K: tl.constexpr, W_K_CONTIGUOUS: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
        SILU_MUL: tl.constexpr, ARGMAX: tl.constexpr, W_SCALED: tl.constexpr, PRECISION: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        GEMV: tl.constexpr = BLOCK_M == 1  # the CUDA-core path
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        k_start = pid_k * k_per_split  # a multiple of BLOCK_K, below K: only k >= K needs a mask
        k_end = tl.minimum(k_start + k_per_split, K)
        if W_K_CONTIGUOUS:  # W[n, k] at n * stride_w + k
            w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_w
            up_shift = N * stride_w
            w_k_stride = 1
        else:  # W[n, k] at k * stride_w + n
            w_cols = w_ptr + offs_n[None, :]
            up_shift = N
            w_k_stride = stride_w

        # The first K step's weights: independent of the kernel before, so loaded before the PDL wait.
        w, w_up = _weight_tiles(w_cols, up_shift, w_k_stride, k_start, offs_n, N, K, BLOCK_K, SILU_MUL)
        pdl_wait(USE_PDL)

        inv_rms = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if NORM:
            inv_rms = _inv_rms(x_ptr, residual_ptr, offs_m, M, K, stride_x, stride_r, eps, HAS_RESIDUAL, BLOCK_M,
                               NORM_BLOCK)
        if GEMV:  # the activation as a column [BLOCK_K, 1] against W's [BLOCK_K, BLOCK_N]
            rows, inv_rms_2d = offs_m[None, :], inv_rms[None, :]
            acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        else:
            rows, inv_rms_2d = offs_m[:, None], inv_rms[:, None]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        residual_rows = tl.where(pid_n == 0, M, 0)  # rows of the new residual this program writes
        acc, acc_up = _k_step(acc, acc, w, w_up, k_start, x_ptr, residual_ptr, new_residual_ptr, norm_weight_ptr,
                              rows, inv_rms_2d, residual_rows, M, K, stride_x, stride_r, stride_nr,
                              BLOCK_K, NORM, HAS_RESIDUAL, SILU_MUL, GEMV, PRECISION)
        for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
            # (new names: only the accumulators are carried from one step to the next)
            w_k, w_up_k = _weight_tiles(w_cols, up_shift, w_k_stride, k0, offs_n, N, K, BLOCK_K, SILU_MUL)
            acc, acc_up = _k_step(acc, acc_up, w_k, w_up_k, k0, x_ptr, residual_ptr, new_residual_ptr, norm_weight_ptr,
                                  rows, inv_rms_2d, residual_rows, M, K, stride_x, stride_r, stride_nr,
                                  BLOCK_K, NORM, HAS_RESIDUAL, SILU_MUL, GEMV, PRECISION)
        if GEMV:
            acc = tl.sum(acc, axis=0)[None, :]
            if SILU_MUL:
                acc_up = tl.sum(acc_up, axis=0)[None, :]

        out_rows, out_cols = offs_m[:, None], offs_n[None, :]
        if W_SCALED and SPLIT_K == 1:
            acc, acc_up = _scale_columns(acc, acc_up, scale_ptr, offs_n, N, SILU_MUL)
        if ARGMAX:  # (SPLIT_K == 1: the wrapper never splits the LM head)
            # (rounded to the model's dtype first, as cuBLAS writes the logits the sampler's argmax reads: the two
            # paths then pick the same token when the top two logits round to one value)
            logits = tl.where(out_cols < N, acc.to(x_ptr.dtype.element_ty).to(tl.float32), float("-inf"))
            tile_max = tl.max(logits, axis=1)
            index = tl.min(tl.where(logits == tile_max[:, None], out_cols, 2147483647), axis=1)
            bits = tile_max.to(tl.int32, bitcast=True)
            ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # negative floats: larger magnitude, smaller key
            key = (ordered.to(tl.int64) << 32) | (4294967295 - index.to(tl.int64))
            row_mask = offs_m < M
            tl.atomic_max(keys_ptr + offs_m, key, mask=row_mask, sem="relaxed")
            tl.debug_barrier()  # every thread's atomic issued before the release below
            arrived = tl.atomic_add(counter_ptr + pid_m, 1, sem="acq_rel")
            if arrived == tl.num_programs(0) - 1:
                final = tl.atomic_xchg(keys_ptr + offs_m, -9223372036854775807, mask=row_mask)  # (_EMPTY_KEY)
                tl.store(y_ptr + offs_m, 4294967295 - (final & 4294967295), mask=row_mask)
                tl.atomic_xchg(counter_ptr + pid_m, 0)  # ready for the next launch
        elif SPLIT_K == 1:
            _store_product(y_ptr, acc, acc_up, out_rows, out_cols, M, N, stride_y, SILU_MUL)
        else:
            width = 2 * N if SILU_MUL else N  # a partial row: the gate columns, then (SILU_MUL) the up columns
            out_mask = (out_rows < M) & (out_cols < N)
            mn = out_rows * width + out_cols
            tl.store(partial_ptr + pid_k * M * width + mn, acc, mask=out_mask)
            if SILU_MUL:
                tl.store(partial_ptr + pid_k * M * width + mn + N, acc_up, mask=out_mask)
            tl.debug_barrier()  # every thread's partial stored before the release below
            tile = pid_m * tl.num_programs(0) + pid_n
            arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                total_up = total
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(partial_ptr + s * M * width + mn, mask=out_mask, other=0.0,
                                     cache_modifier=".cg")
                    if SILU_MUL:
                        total_up += tl.load(partial_ptr + s * M * width + mn + N, mask=out_mask, other=0.0,
                                            cache_modifier=".cg")
                if W_SCALED:
                    total, total_up = _scale_columns(total, total_up, scale_ptr, offs_n, N, SILU_MUL)
                _store_product(y_ptr, total, total_up, out_rows, out_cols, M, N, stride_y, SILU_MUL)
                tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next launch


_KEYS: dict[torch.device, torch.Tensor] = {}


def _argmax_keys(device: torch.device, rows: int) -> torch.Tensor:
    """The argmax's packed keys, one per row, _EMPTY_KEY between launches (the last program resets them). One
    buffer per device, shared as linear.py's counters are: LM heads on one stream run one after the other."""
    keys = _KEYS.get(device)
    if keys is None or keys.numel() < rows:
        keys = torch.full((max(rows, 256),), _EMPTY_KEY, dtype=torch.int64, device=device)
        _KEYS[device] = keys
    return keys


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, last dim] with contiguous rows (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(
    x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None, eps: float = 0.0, silu_and_mul: bool = False, argmax: bool = False,
    config: SkinnyConfig | GemvConfig | None = None, rope: RopeStore | None = None,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, new residual or None) of one fused product. y: [M, N] (silu_and_mul: [M, N / 2]; argmax: int64 [M]).
    Up to GEMV_MAX_ROWS rows of an output-major weight (but the LM head's argmax) run on gemv.py's kernel, the
    rest on the tiled one here. `config` overrides the choice, the tiles and the split (the tests and the
    benchmark): a GemvConfig takes the GEMV (with fuse_norm=False after layernorm.py's kernel); a SkinnyConfig's
    block_n counts output columns. rope (a qkv product): the GEMV's epilogue rotates q and stores k and v; the tiled
    kernel leaves that to rotary.py's. weight_scale: weight is float8 e4m3 with this float32 scale per row."""
    k = x.shape[-1]
    n_weight = weight.shape[0]
    scaled = weight_scale is not None
    assert weight.shape[1] == k and weight.dtype == (FP8_DTYPE if scaled else x.dtype), (
        x.shape, x.dtype, weight.shape, weight.dtype)
    assert not scaled or (weight_scale.shape == (n_weight,) and weight_scale.dtype == torch.float32
                          and weight_scale.is_contiguous()), "weight_scale: float32 [N], contiguous"
    x2 = _rows(x)
    m = x2.shape[0]
    n = n_weight // 2 if silu_and_mul else n_weight
    norm = norm_weight is not None
    res2 = _rows(residual) if residual is not None else x2
    new_residual = torch.empty_like(res2) if residual is not None else None
    if argmax:
        out = torch.empty(m, dtype=torch.int64, device=x.device)
    else:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out, new_residual
    weight, k_contiguous, stride_w = _weight_layout(weight)
    if isinstance(config, GemvConfig) or (config is None and not argmax and k_contiguous and m <= GEMV_MAX_ROWS):
        assert k_contiguous and not argmax, "the GEMV takes output-major weights, and no argmax"
        if norm and config is not None and not config.fuse_norm:  # the norm's own kernel, then a plain GEMV
            normed, normed_residual = _launch_rms_norm(x2, residual, norm_weight, eps)
            launch_gemv(out, normed, weight, stride_w, normed, None, None, eps, silu_and_mul, config, rope,
                        weight_scale)
            return out, (normed_residual if residual is not None else None)
        launch_gemv(out, x2, weight, stride_w, res2, new_residual, norm_weight, eps, silu_and_mul, config, rope,
                    weight_scale)
        return out, new_residual
    if config is None:
        # silu_and_mul: the grid of the whole [M, 2I] product, each program's columns half gate, half up
        config = skinny_matmul_config(m, n_weight, k, k_contiguous, _num_sms(x.device))
        if silu_and_mul:
            config = config._replace(block_n=config.block_n // 2)
        if argmax:
            config = config._replace(split_k=1)  # (the vocabulary gives programs enough)
        if x.dtype == torch.float32 and config.block_m >= 64:
            # (three float32 stages of 64-row tiles, with the norm, fill a Hopper SM's shared memory)
            config = config._replace(num_stages=2)
    assert config.block_m > 1 or m == 1, "the GEMV path (block_m == 1) takes one row"
    assert not (argmax and config.split_k > 1), "the argmax reduces over column tiles, never split K"
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    split = triton.cdiv(k, k_per_split)  # rounding k_per_split up can leave fewer splits than asked
    grid = (triton.cdiv(n, config.block_n), split, triton.cdiv(m, config.block_m))
    partial = out
    if split > 1:
        partial = torch.empty((split, m, 2 * n if silu_and_mul else n), dtype=torch.float32, device=x.device)
    # (the argmax counts arrivals per m tile, the split-K reduce per output tile; both fit the buffer linear.py sizes
    # at first use, so that it is never replaced under CUDA graphs that captured it)
    counters = _counters(x.device, grid[2] if argmax else grid[0] * grid[2]) if split > 1 or argmax else out
    keys = _argmax_keys(x.device, m) if argmax else out
    norm_block = min(triton.next_power_of_2(k), max(_NORM_ELEMENTS // config.block_m, 16))
    nres = new_residual if new_residual is not None else x2
    _fused_linear_kernel[grid](
        out, x2, weight, res2, nres, norm_weight if norm else x2, partial, counters, keys,
        weight_scale if scaled else x2,
        m, n, k, x2.stride(0), res2.stride(0), nres.stride(0), out.stride(0), stride_w, k_per_split, eps,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, NORM_BLOCK=norm_block,
        SPLIT_K=split, W_K_CONTIGUOUS=k_contiguous, NORM=norm, HAS_RESIDUAL=residual is not None,
        SILU_MUL=silu_and_mul, ARGMAX=argmax, W_SCALED=scaled, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_options(x2),
    )
    if rope is not None:
        rope_store_triton(out, rope)
    return out, new_residual


def fused_linear_triton(x: torch.Tensor, weight: torch.Tensor, silu_and_mul: bool = False,
                        config: SkinnyConfig | GemvConfig | None = None, *,
                        weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel of fused_linear_ref: x [..., K], weight [N, K] in either layout the engine stores (a few
    rows and an output-major weight: gemv.py's kernel)."""
    y, _ = _launch(x, weight, silu_and_mul=silu_and_mul, config=config, weight_scale=weight_scale)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def fused_norm_linear_triton(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    silu_and_mul: bool = False, config: SkinnyConfig | GemvConfig | None = None, rope: RopeStore | None = None, *,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel of fused_norm_linear_ref: one launch reads x and residual, writes the product and the
    new residual stream (a few rows and an output-major weight: gemv.py's kernel, which with rope also rotates q
    and stores k and v)."""
    y, new_residual = _launch(x, weight, residual=residual, norm_weight=norm_weight, eps=eps,
                              silu_and_mul=silu_and_mul, config=config, rope=rope, weight_scale=weight_scale)
    new_residual = x if new_residual is None else new_residual.reshape(x.shape)
    return y.reshape(*x.shape[:-1], y.shape[-1]), new_residual


def linear_argmax_triton(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None, *,
                         weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel of linear_argmax_ref: x [M, K], weight [vocab, K] -> int64 token ids [M]."""
    return _launch(x, weight, argmax=True, config=config, weight_scale=weight_scale)[0]
