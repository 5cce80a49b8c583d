"""The gates of gated MLPs, on the merged gate_up product x [T, 2I]: SiLU-and-mul (Llama's), out = silu(x[:, :I]) *
x[:, I:], each row first scaled by a RowNorm's factor when the RMSNorm before gate_up is folded into it; and
GELU(tanh)-and-mul (Gemma 2's), out = gelu_tanh(x[:, :I]) * x[:, I:]."""

import torch
import torch.nn.functional as F

from tinyvllm.ops.layernorm import RowNorm, row_inv_rms, row_inv_rms_ref, row_norm_args
from tinyvllm.ops.pdl import pdl_options, pdl_wait
from tinyvllm.ops.triton_import import tl, triton


def silu_and_mul_ref(x: torch.Tensor, norm: RowNorm | None = None) -> torch.Tensor:
    """x [T, 2I] (gate then up, as the merged gate_up projection writes them) -> [T, I]; with `norm`, gate and up
    scaled by row_inv_rms_ref(norm) first, in float32."""
    x32 = x.float() if norm is None else x.float() * row_inv_rms_ref(norm)[:, None]
    gate, up = x32.chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


if triton is not None:

    # out[t, i] = act(g) * u with g = x[t, i], u = x[t, I + i], in float32; act is SiLU, g / (1 + exp(-g)), or with
    # GELU the tanh approximation g/2 * (1 + tanh(c)), c = sqrt(2/pi) * (g + 0.044715 g^3), written as
    # g / (1 + exp(-2c)) since 1 + tanh(c) = 2 / (1 + exp(-2c)): one exp, and no overflow to NaN (exp(-2c) -> inf
    # gives -0, as the saturated tanh does). NORM: g and u times the row's 1/rms of the stream (each program of the
    # row computes it: a row of the hidden size, read from L2). One program per (token, column tile).
    @triton.jit
    def _gated_mul_kernel(out_ptr, x_ptr, stream_ptr, inter, stride_x, stride_out, stride_stream, hidden, eps,
                          BLOCK: tl.constexpr, NORM: tl.constexpr, BLOCK_HIDDEN: tl.constexpr, GELU: tl.constexpr,
                          USE_PDL: tl.constexpr):
        pdl_wait(USE_PDL)
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + token * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
        if NORM:
            scale = row_inv_rms(stream_ptr, token, stride_stream, hidden, eps, BLOCK_HIDDEN)
            gate, up = gate * scale, up * scale
        if GELU:
            exponent = -2.0 * 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # -2 sqrt(2/pi) (...)
        else:
            exponent = -gate
        out = gate / (1.0 + tl.exp(exponent)) * up
        tl.store(out_ptr + token * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _gated_mul_triton(x: torch.Tensor, norm: RowNorm | None, gelu: bool) -> torch.Tensor:
    """x [T, 2I] -> [T, I] through _gated_mul_kernel."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    stream, eps, block_hidden = row_norm_args(norm, x2.shape[0], x2)
    if x2.shape[0] > 0:
        # With a norm every program reads its row of the stream: wider tiles keep those reads to a few a row
        # (1,024-column tiles read each row 8 times at Llama-3.2-1B's 8,192; benchmarks/RESULTS.md).
        block = min(triton.next_power_of_2(inter), 1024 if norm is None else 4096)
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _gated_mul_kernel[grid](out, x2, stream, inter, x2.stride(0), out.stride(0), stream.stride(0),
                                stream.shape[1], eps, BLOCK=block, NORM=norm is not None, BLOCK_HIDDEN=block_hidden,
                                GELU=gelu, num_warps=4 if block <= 1024 else 8, **pdl_options(x2))
    return out.reshape(*x.shape[:-1], inter)


def silu_and_mul_triton(x: torch.Tensor, norm: RowNorm | None = None) -> torch.Tensor:
    """The Triton kernel of silu_and_mul_ref: x [T, 2I] -> [T, I]."""
    return _gated_mul_triton(x, norm, gelu=False)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate then up) -> [T, I]: GELU with the tanh approximation (transformers' gelu_pytorch_tanh) of the
    gate times up, in float32, rounded once to x's dtype."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(x.dtype)


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """The Triton kernel of gelu_tanh_and_mul_ref: x [T, 2I] -> [T, I]."""
    return _gated_mul_triton(x, None, gelu=True)
