"""RMSNorm, alone and fused with the residual add that precedes it in every decoder layer; and RowNorm, what is
left of an RMSNorm whose weight was folded into the product after it."""

from typing import NamedTuple

import torch

from tinyvllm.ops.pdl import pdl_options, pdl_wait
from tinyvllm.ops.triton_import import tl, triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 and returned in x's dtype."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual'). The sum is rounded to x's dtype
    before the norm, as transformers does, so that the residual stream matches it bit for bit."""
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual


class RowNorm(NamedTuple):
    """An RMSNorm whose weight is folded into the product after it (LlamaForCausalLM.fold_norms): that product
    reads the residual stream itself, and since 1/rms is a factor of each row, the op after the product scales
    its row t by rsqrt(mean(stream[t]^2) + eps) (ops.rope_store, ops.silu_and_mul take one)."""

    stream: torch.Tensor  # [T, hidden], the product's input
    eps: float


def row_inv_rms_ref(norm: RowNorm) -> torch.Tensor:
    """rsqrt(mean(stream^2) + eps) of each row, float32 [T] (rms_norm_ref's factor)."""
    x32 = norm.stream.float()
    return torch.rsqrt(x32.pow(2).mean(-1) + norm.eps)


def row_norm_args(norm: RowNorm | None, rows: int, unused: torch.Tensor) -> tuple[torch.Tensor, float, int]:
    """(stream [rows, hidden] with contiguous rows, eps, BLOCK_HIDDEN) for a kernel that takes a RowNorm; without
    one, `unused` stands in for the stream pointer (never read), eps 0 and BLOCK_HIDDEN 1."""
    if norm is None:
        return unused, 0.0, 1
    stream = norm.stream.reshape(rows, norm.stream.shape[-1])
    stream = stream if stream.stride(-1) == 1 else stream.contiguous()
    return stream, norm.eps, triton.next_power_of_2(stream.shape[1])


row_inv_rms = None  # (a Triton device function: where Triton is not imported, a name the kernels' modules import)
if triton is not None:

    @triton.jit
    def row_inv_rms(stream_ptr, row, stride, hidden, eps, BLOCK: tl.constexpr):
        """row_inv_rms_ref of one row (BLOCK >= hidden), in float32."""
        cols = tl.arange(0, BLOCK)
        x = tl.load(stream_ptr + row * stride + cols, mask=cols < hidden, other=0.0).to(tl.float32)
        return tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)

    # ROWS rows per program, each whole in registers:
    #   s = x + residual (rounded to x's dtype, stored as the new residual)   if HAS_RESIDUAL
    #   y = s * rsqrt(mean(s^2) + eps) * weight                                in float32
    @triton.jit(do_not_specialize=["num_rows"])  # the token count varies per step: compile once
    def _rms_norm_kernel(
        out_ptr, new_residual_ptr, x_ptr, residual_ptr, weight_ptr,
        num_rows, hidden, stride_x, stride_residual, stride_out, stride_new_residual, eps,
        HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        mask = (rows < num_rows) & (cols < hidden)
        x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + rows * stride_residual + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
            tl.store(new_residual_ptr + rows * stride_new_residual + cols, x, mask=mask)
        x = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / hidden + eps)
        weight = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
        y = x * inv_rms[:, None] * weight
        tl.store(out_ptr + rows * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_config(num_rows: int, hidden: int) -> tuple[int, int]:
    """(ROWS per program, num_warps): one row, a warp per 512 columns. The sweep in benchmarks/bench_elementwise.py
    (--sweep: rows per program x warps, beside a copy kernel with the same grid) chose this at hidden
    2048, where the norm then runs as fast as that copy; figures in benchmarks/RESULTS.md."""
    block = triton.next_power_of_2(hidden)
    return 1, min(max(block // 512, 1), 16)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, hidden] with contiguous rows (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    config: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual); without a residual the second is the first (the caller drops it).
    `config` overrides rms_norm_config (the sweep and the tests)."""
    hidden = x.shape[-1]
    x2 = _rows(x)
    res2 = _rows(residual) if residual is not None else x2
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(out) if residual is not None else out
    num_rows = x2.shape[0]
    if num_rows > 0:
        rows, num_warps = config or rms_norm_config(num_rows, hidden)
        _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
            out, new_residual, x2, res2, weight,
            num_rows, hidden, x2.stride(0), res2.stride(0), out.stride(0), new_residual.stride(0), eps,
            HAS_RESIDUAL=residual is not None, ROWS=rows, BLOCK=triton.next_power_of_2(hidden), num_warps=num_warps,
            **pdl_options(x2),
        )
    return out.reshape(x.shape), new_residual.reshape(x.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton kernel of rms_norm_ref: one program per row, float32 inside."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel of fused_add_rms_norm_ref: one pass reads x and residual, writes both outputs."""
    return _launch_rms_norm(x, residual, weight, eps)
