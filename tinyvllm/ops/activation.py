"""SiLU-and-mul, the gate of Llama's MLP: out = silu(x[:, :I]) * x[:, I:]."""

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU engine imports the reference on machines without Triton
    triton = None

from tinyvllm.ops.pdl import pdl_options, pdl_wait


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate then up, as the merged gate_up projection writes them) -> [T, I]."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


if triton is not None:

    # out[t, i] = silu(g) * u with g = x[t, i], u = x[t, I + i], silu(g) = g / (1 + exp(-g)), in float32;
    # one program per (token, column tile).
    @triton.jit
    def _silu_and_mul_kernel(out_ptr, x_ptr, inter, stride_x, stride_out, BLOCK: tl.constexpr,
                             USE_PDL: tl.constexpr):
        pdl_wait(USE_PDL)
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + token * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + token * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """The Triton kernel of silu_and_mul_ref: x [T, 2I] -> [T, I]."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        block = min(triton.next_power_of_2(inter), 1024)
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](out, x2, inter, x2.stride(0), out.stride(0), BLOCK=block, num_warps=4,
                                   **pdl_options(x2))
    return out.reshape(*x.shape[:-1], inter)
