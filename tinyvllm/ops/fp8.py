"""Linear layers with float8 weights (e4m3, the format Hopper's tensor cores multiply): quantization of the weights
at load time and of the activations per token, and the product y = x @ W^T for any number of rows.

A weight is stored w8 [N, K] float8_e4m3fn, rows of K contiguous (output-major), with one float32 scale per output
channel: W[n, k] = w8[n, k] * weight_scale[n]. Half the bytes of bfloat16, so a decode step, which reads every weight
once, has half as much to read; the per-channel scale is a factor of each output's K sum, so every kernel applies it
once per output, after the sum. Activations stay in the model's dtype.

- fp8_linear_ref: the product of the dequantized weight in float32 (what the CPU engine runs).
- fp8_linear_cuda: x quantized per token (one scale per row, quantize_fp8_per_token_triton), then torch._scaled_mm
  on the fp8 tensor cores with both scales applied in its epilogue (row-wise scaling), written in bfloat16 (the
  output type every torch build's row-wise kernels take; a float16 model's result is converted). Where _scaled_mm
  cannot take the case (a float32 model, whose results must be the reference's; K or N not a multiple of 16; a GPU
  before Hopper), the reference runs instead.
The decode kernels (fused_linear.py, gemv.py) take the same weights through their weight_scale argument and keep x
as it is: at a few rows the weight bytes are the cost, not the arithmetic."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tinyvllm.ops.pdl import pdl_options, pdl_wait
from tinyvllm.ops.rotary import FP8_E4M3_MAX
from tinyvllm.ops.triton_import import tl, triton

FP8_DTYPE = torch.float8_e4m3fn
# The smallest per-token scale: a row of zeros (or of tiny values) gets this one instead of 0, so that quantizing it
# divides by a finite number (vLLM uses the same floor).
MIN_TOKEN_SCALE = 1.0 / (FP8_E4M3_MAX * 512.0)
_QUANT_BLOCK = 4096  # elements of a row per step of the per-token quantization kernel


# ------------------------------------------------------------------------------------------------- references


def quantize_fp8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w8 [N, K] float8_e4m3fn contiguous, scale [N] float32) with weight ~ w8 * scale[:, None]: each output channel's
    largest magnitude maps to 448, the largest e4m3 value. A row of zeros gets scale 1 (and zeros)."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    w8 = (w / scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return w8.contiguous(), scale.contiguous()


def per_channel_scale(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's scale of an fp8 weight of `rows` output channels as the ops take it, float32 [rows]: a
    per-tensor scale (one number) repeated, a per-channel one ([rows] or [rows, 1]) as it is. Merged projections
    (qkv, gate_up) concatenate their parts' per_channel_scale, so parts with different per-tensor scales need no
    requantization."""
    scale = scale.float().reshape(-1)
    if scale.numel() == 1:
        return scale.expand(rows).contiguous()
    if scale.numel() != rows:
        raise ValueError(f"an fp8 weight scale of {scale.numel()} values for {rows} output channels: expected one "
                         "per tensor or one per output channel (block-wise scales are not supported)")
    return scale.contiguous()


def dequantize_fp8_weight(w8: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The weight w8 * scale[:, None] in float32 [N, K]: what every reference multiplies by."""
    return w8.float() * weight_scale.float()[:, None]


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8 [M, K] float8_e4m3fn, scale [M, 1] float32) of x [..., K] (M: the leading dims flattened), x ~ x8 * scale:
    each row's largest magnitude maps to 448 (scale at least MIN_TOKEN_SCALE), the division in float32, rounded to
    nearest even."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    scale = (x2.abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX).clamp_min(MIN_TOKEN_SCALE)
    x8 = (x2 / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return x8, scale


def fp8_linear_ref(x: torch.Tensor, w8: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ (w8 * scale[:, None])^T + bias for x [..., K], w8 [N, K] float8_e4m3fn, weight_scale [N] float32:
    computed in float32 and returned in x's dtype."""
    y = F.linear(x.float(), dequantize_fp8_weight(w8, weight_scale), None if bias is None else bias.float())
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------------- kernels

if triton is not None:

    # One program per row m: scale = max(max_k |x[m, k]| / 448, MIN_TOKEN_SCALE), x8[m, k] = x[m, k] / scale, both
    # divisions rounded to nearest as torch's are (div_rn), so that the kernel and the reference agree bit for bit.
    # Two passes over the row (max, then quantize); the second reads it from the cache.
    @triton.jit
    def _quantize_per_token_kernel(x8_ptr, scale_ptr, x_ptr, K, stride_x, stride_x8, MIN_SCALE: tl.constexpr,
                                   BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        pdl_wait(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), 448.0), MIN_SCALE)
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            x8 = tl.clamp(tl.div_rn(x, scale), -448.0, 448.0)
            tl.store(x8_ptr + row * stride_x8 + cols, x8.to(x8_ptr.dtype.element_ty), mask=cols < K)


def quantize_fp8_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel of quantize_fp8_per_token: x [..., K] -> (x8 [M, K], scale [M, 1] float32)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    x8 = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m > 0 and k > 0:
        block = min(triton.next_power_of_2(k), _QUANT_BLOCK)
        _quantize_per_token_kernel[(m,)](x8, scale, x2, k, x2.stride(0), x8.stride(0), MIN_SCALE=MIN_TOKEN_SCALE,
                                         BLOCK=block, num_warps=4 if block <= 2048 else 8, **pdl_options(x2))
    return x8, scale


@functools.cache
def _has_fp8_tensor_cores(device_index: int) -> bool:
    """Hopper or later: torch._scaled_mm's row-wise scaling runs there (cuBLASLt or CUTLASS, by torch's build)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def scaled_mm_takes(x: torch.Tensor, w8: torch.Tensor) -> bool:
    """Whether fp8_linear_cuda runs x [..., K] @ w8^T on torch._scaled_mm: a CUDA tensor of bfloat16 or float16 (a
    float32 model runs the reference, the engine's exact mode), K and N multiples of 16 (cuBLASLt's rule for float8
    operands), and a GPU with float8 tensor cores."""
    k, n = x.shape[-1], w8.shape[0]
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and k % 16 == 0 and n % 16 == 0
            and _has_fp8_tensor_cores(x.device.index or 0))


def fp8_linear_cuda(x: torch.Tensor, w8: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_linear_ref on the fp8 tensor cores: x quantized per token (its own error, up to half an e4m3 step of each
    element, on top of the weight's), then y[m, n] = scale_x[m] * scale_w[n] * sum_k x8[m, k] w8[n, k] (+ bias[n])
    through torch._scaled_mm, accumulated in float32, written in bfloat16 (then x's dtype). Cases it cannot take
    (scaled_mm_takes) run the reference."""
    if not scaled_mm_takes(x, w8):
        return fp8_linear_ref(x, w8, weight_scale, bias)
    k, n = x.shape[-1], w8.shape[0]
    assert w8.dtype == FP8_DTYPE and w8.shape[1] == k and weight_scale.numel() == n, (w8.shape, w8.dtype, x.shape)
    x8, x_scale = quantize_fp8_per_token_triton(x)
    # (w8 [N, K] with rows of K contiguous is the column-major [K, N] operand _scaled_mm wants as its second)
    w8 = w8 if w8.stride(1) == 1 and w8.stride(0) == k else w8.contiguous()
    y = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=weight_scale.float().reshape(1, n),
                         bias=None if bias is None else bias.to(torch.bfloat16), out_dtype=torch.bfloat16)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
