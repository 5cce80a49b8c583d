"""Float8 weights (tinyvllm/ops/fp8.py) on the CPU: the weight and per-token quantizations and fp8_linear's reference,
then, under the Triton interpreter (conftest sets TRITON_INTERPRET=1; skipped where Triton is missing), the per-token
quantization kernel and the decode kernels (fused_linear.py, gemv.py) reading float8 weights with a scale per output
channel: the plain product, the RMSNorm prologue with and without the residual, the SiLU·mul epilogue (gate and up
with scales of their own), the rotary embedding + KV store epilogue and the LM head's argmax, on the GEMV, the
CUDA-core tiles and tl.dot's tiles, with K split or not, in both weight layouts. Each is checked against its
reference on the same float8 weight (the same math: float32 tolerances) and against the bfloat16-rounded weight the
float8 one was quantized from (within float8's rounding: ||y - ref|| / ||ref|| <= 0.05). Shapes are tiny and not
multiples of the tiles; outputs the wrappers allocate are poisoned with NaN (or -1)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from tests.utils import relative_error
from tinyvllm.ops.fp8 import (
    FP8_DTYPE,
    MIN_TOKEN_SCALE,
    dequantize_fp8_weight,
    fp8_linear_ref,
    per_channel_scale,
    quantize_fp8_per_token,
    quantize_fp8_weight,
)
from tinyvllm.ops.fused_linear import (
    fused_linear_ref,
    fused_linear_triton,
    fused_norm_linear_ref,
    fused_norm_linear_triton,
    linear_argmax_ref,
    linear_argmax_triton,
)
from tinyvllm.ops.gemv import GemvConfig
from tinyvllm.ops.linear import SkinnyConfig

# The Triton tests: run under the interpreter, with the unwritten outputs poisoned and float8 conversions as the GPU
# makes them (conftest's fp8_casts_as_on_the_gpu: the interpreter's own flush float8 subnormals to zero)
TRITON = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter)"),
          pytest.mark.usefixtures("poison_outputs", "fp8_casts_as_on_the_gpu")]



def _kernel_test(fn: Any) -> Any:
    """TRITON's marks on a test."""
    for mark in TRITON:
        fn = mark(fn)
    return fn


K, N = 48, 40  # K: three 16-wide steps; N: three 16-wide column tiles, the last one partial
EPS = 1e-5
E4M3_STEP = 2.0**-3  # e4m3's 3 mantissa bits: a step is 1/8 to 1/16 of the value, a rounding at most half that
FP8_TOLERANCE = 0.05  # ||y - ref|| / ||ref|| of a product of quantized weights against the unquantized ones
# silu(gate) * up multiplies two such products, whose errors add; and with K = 48 a few outputs dominate the norm
SILU_TOLERANCE = 2 * FP8_TOLERANCE


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    """A bfloat16 weight [n, k] whose rows differ in magnitude by up to 100x (so that a scale applied to the wrong
    channel shows), quantized by the tests to float8."""
    generator = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** (torch.rand(n, 1, generator=generator) - 0.5)
    return (torch.randn(n, k, generator=generator) * magnitude).to(torch.bfloat16)


def _fp8(weight: torch.Tensor, input_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(w8, scale) of weight, w8 output-major as the layers store it or (input_major) stored [k, n] and transposed."""
    w8, scale = quantize_fp8_weight(weight)
    return (w8.t().contiguous().t() if input_major else w8), scale


def _tiles(m: int, split: int) -> SkinnyConfig:
    """16-wide tiles; the CUDA-core path of the tiled kernel for one row, tl.dot's 16-row tiles otherwise."""
    return SkinnyConfig(block_m=1 if m == 1 else 16, block_n=16, block_k=16, split_k=split)


def _close_to_both(y: torch.Tensor, ref_fp8: torch.Tensor, ref_original: torch.Tensor, silu_and_mul: bool = False,
                   ) -> None:
    """y as its reference on the float8 weight computes it (float32: the same math up to the order of the sums) and
    within float8's rounding of the reference on the original weight."""
    torch.testing.assert_close(y, ref_fp8, atol=1e-4, rtol=1e-4)
    assert relative_error(y, ref_original) <= (SILU_TOLERANCE if silu_and_mul else FP8_TOLERANCE)


# ------------------------------------------------------------------------------------- quantization, reference


def test_weight_quantization_round_trip() -> None:
    """Each row's largest magnitude becomes 448; every element is within half an e4m3 step of its value (or of e4m3's
    smallest subnormal step, scaled, below its normal range); a row of zeros gets scale 1 and zeros."""
    weight = _weight(N, K, seed=0)
    weight[3] = 0
    w8, scale = quantize_fp8_weight(weight)
    assert w8.dtype == FP8_DTYPE and w8.shape == (N, K) and w8.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (N,)
    nonzero = torch.arange(N) != 3
    assert torch.equal(w8.float().abs().amax(1)[nonzero], torch.full((N - 1,), 448.0))
    assert scale[3] == 1 and not w8[3].float().any()
    w = weight.float()
    error = (dequantize_fp8_weight(w8, scale) - w).abs()
    bound = torch.maximum(w.abs() * E4M3_STEP / 2, scale[:, None] * 2.0**-10)
    assert bool((error <= bound * (1 + 1e-6)).all())
    assert relative_error(dequantize_fp8_weight(w8, scale), w) < 0.03


def test_per_channel_scale() -> None:
    """A checkpoint's per-tensor scale (0-d or one element) repeated per channel, a per-channel one as it is; any
    other count (block-wise scales) is refused with a message."""
    assert torch.equal(per_channel_scale(torch.tensor(0.5), 4), torch.full((4,), 0.5))
    assert torch.equal(per_channel_scale(torch.tensor([0.25], dtype=torch.bfloat16), 3), torch.full((3,), 0.25))
    channel = torch.rand(5, 1)
    assert torch.equal(per_channel_scale(channel, 5), channel.reshape(5))
    with pytest.raises(ValueError, match="per output channel"):
        per_channel_scale(torch.rand(2, 2), 5)


def test_per_token_quantization_reference() -> None:
    """Each row's scale is its largest magnitude / 448, at least MIN_TOKEN_SCALE (a row of zeros: zeros); the
    round trip is within half an e4m3 step (of the scale times e4m3's subnormal step below the normal range)."""
    torch.manual_seed(1)
    x = torch.randn(2, 3, K).to(torch.bfloat16)
    x[1, 2] = 0
    x8, scale = quantize_fp8_per_token(x)
    rows = x.reshape(6, K).float()
    assert x8.shape == (6, K) and x8.dtype == FP8_DTYPE and scale.shape == (6, 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale[:5, 0], rows[:5].abs().amax(1) / 448, atol=0, rtol=0)
    assert scale[5, 0] == MIN_TOKEN_SCALE and not x8[5].float().any()
    error = (x8.float() * scale - rows).abs()
    assert bool((error <= torch.maximum(rows.abs() * E4M3_STEP / 2, scale * 2.0**-10) * (1 + 1e-6)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_linear_reference(dtype: torch.dtype, with_bias: bool) -> None:
    """fp8_linear_ref is the float32 product of the dequantized weight (+ bias), in x's dtype, on [..., K] inputs;
    close to the product of the original weight; ops.fp8_linear is it on CPU tensors."""
    from tinyvllm import ops

    torch.manual_seed(2)
    weight = _weight(N, K, seed=2)
    w8, scale = quantize_fp8_weight(weight)
    x = torch.randn(2, 3, K).to(dtype)
    bias = torch.randn(N).to(dtype) if with_bias else None
    y = fp8_linear_ref(x, w8, scale, bias)
    assert y.shape == (2, 3, N) and y.dtype == dtype
    exact = x.float() @ (w8.float() * scale[:, None]).t() + (0 if bias is None else bias.float())
    torch.testing.assert_close(y, exact.to(dtype), atol=1e-5, rtol=1e-5)
    original = x.float() @ weight.float().t() + (0 if bias is None else bias.float())
    assert relative_error(y, original) <= FP8_TOLERANCE
    assert torch.equal(ops.fp8_linear(x, w8, scale, bias), y)


def test_decode_references_take_the_scale() -> None:
    """fused_linear_ref, fused_norm_linear_ref and linear_argmax_ref with weight_scale multiply by the dequantized
    weight: the same as the references given that weight in float32."""
    torch.manual_seed(3)
    w8, scale = quantize_fp8_weight(_weight(2 * N, K, seed=3))
    w = dequantize_fp8_weight(w8, scale)
    x, residual, norm_weight = torch.randn(3, K), torch.randn(3, K), torch.rand(K) + 0.5
    assert torch.equal(fused_linear_ref(x, w8, True, weight_scale=scale), fused_linear_ref(x, w, True))
    y, new_residual = fused_norm_linear_ref(x, residual, norm_weight, EPS, w8, weight_scale=scale)
    y_ref, new_residual_ref = fused_norm_linear_ref(x, residual, norm_weight, EPS, w)
    assert torch.equal(y, y_ref) and torch.equal(new_residual, new_residual_ref)
    assert torch.equal(linear_argmax_ref(x, w8, weight_scale=scale), linear_argmax_ref(x, w))


# ------------------------------------------------------------------------------------- kernels (interpreter)


@_kernel_test
@pytest.mark.parametrize("block", [None, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_quantization_kernel(dtype: torch.dtype, block: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's bytes and scales are the reference's exactly (both divide in float32 rounded to nearest, and
    round to e4m3 to nearest even), with rows of zeros, of one huge value among small ones (e4m3 subnormals), and
    (block 16) K in three steps, the last partial."""
    from tinyvllm.ops import fp8

    if block is not None:
        monkeypatch.setattr(fp8, "_QUANT_BLOCK", block)
    torch.manual_seed(4)
    x = torch.randn(5, K).to(dtype)
    x[1] = 0
    x[2, 7] = 3000.0
    x8, scale = fp8.quantize_fp8_per_token_triton(x[None])
    ref8, ref_scale = quantize_fp8_per_token(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(x8.view(torch.uint8), ref8.view(torch.uint8))


@_kernel_test
@pytest.mark.parametrize("input_major", [False, True])
@pytest.mark.parametrize("m, split", [(1, 1), (1, 3), (5, 1), (17, 3)])
@pytest.mark.parametrize("silu_and_mul", [False, True])
def test_tiled_product(silu_and_mul: bool, m: int, split: int, input_major: bool) -> None:
    """o / down (and gate_up with SiLU·mul: gate and up columns each scaled by their own rows' scales) on the tiled
    kernel: the CUDA-core path at one row, tl.dot's tiles (17: two m tiles), K whole or split in three (the scales
    applied once, by the tile's last program, after the split sums)."""
    torch.manual_seed(m * 10 + split)
    weight = _weight(2 * N if silu_and_mul else N, K, seed=m + split)
    w8, scale = _fp8(weight, input_major)
    x = torch.randn(m, K)
    y = fused_linear_triton(x, w8, silu_and_mul, _tiles(m, split), weight_scale=scale)
    assert y.shape == (m, N)
    _close_to_both(y, fused_linear_ref(x, w8, silu_and_mul, weight_scale=scale),
                   fused_linear_ref(x, weight.float(), silu_and_mul), silu_and_mul)


@_kernel_test
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("block_n", [1, 8])
@pytest.mark.parametrize("silu_and_mul", [False, True])
def test_gemv_product(silu_and_mul: bool, block_n: int, m: int) -> None:
    """The same products on gemv.py's GEMV (output-major weights, a few rows)."""
    torch.manual_seed(m + block_n)
    weight = _weight(2 * N if silu_and_mul else N, K, seed=10 + m + block_n)
    w8, scale = _fp8(weight)
    x = torch.randn(m, K)
    y = fused_linear_triton(x, w8, silu_and_mul, GemvConfig(block_n), weight_scale=scale)
    _close_to_both(y, fused_linear_ref(x, w8, silu_and_mul, weight_scale=scale),
                   fused_linear_ref(x, weight.float(), silu_and_mul), silu_and_mul)


@_kernel_test
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("silu_and_mul", [False, True])
@pytest.mark.parametrize("config", [GemvConfig(8), GemvConfig(8, fuse_norm=False), SkinnyConfig(1, 16, 16, 3),
                                    SkinnyConfig(16, 16, 16, 1)], ids=["gemv", "gemv-norm-apart", "cuda-cores",
                                                                       "dot"])
def test_norm_prologue(config: Any, silu_and_mul: bool, with_residual: bool) -> None:
    """qkv and gate_up after RMSNorm with float8 weights: the product of rms_norm(x + residual) and the new residual
    stream (unchanged by the weight's format); without a residual the stream is x itself."""
    m = 1 if isinstance(config, SkinnyConfig) and config.block_m == 1 else 3
    torch.manual_seed(20 + m + 2 * silu_and_mul + with_residual)
    weight = _weight(2 * N if silu_and_mul else N, K, seed=20 + silu_and_mul)
    w8, scale = _fp8(weight)
    x, norm_weight = torch.randn(m, K), torch.rand(K) + 0.5
    residual = torch.randn(m, K) if with_residual else None
    y, new_residual = fused_norm_linear_triton(x, residual, norm_weight, EPS, w8, silu_and_mul, config,
                                               weight_scale=scale)
    ref, ref_residual = fused_norm_linear_ref(x, residual, norm_weight, EPS, w8, silu_and_mul, weight_scale=scale)
    original, _ = fused_norm_linear_ref(x, residual, norm_weight, EPS, weight.float(), silu_and_mul)
    _close_to_both(y, ref, original, silu_and_mul)
    if with_residual:
        torch.testing.assert_close(new_residual, ref_residual, atol=0, rtol=0)
    else:
        assert new_residual is x


def _rope_case(m: int, seed: int) -> tuple[Any, ...]:
    """A qkv product of 4 q heads and 1 KV head of dim 8 (48 outputs: 24 pairs of head halves) with a float8 weight,
    a cache of 3 blocks of 4 slots with random contents, and slots that include -1 (nothing stored)."""
    from tinyvllm.ops.rotary import RopeStore, build_cos_sin_cache

    torch.manual_seed(seed)
    weight = _weight(48, K, seed=seed)
    x, residual, norm_weight = torch.randn(m, K), torch.randn(m, K), 1 + 0.1 * torch.randn(K)
    caches = torch.randn(2, 3, 4, 1, 8)
    cos_sin = build_cos_sin_cache(8, 256, 10000.0, None, torch.device("cpu"))
    rope = RopeStore(torch.tensor([17, 3, 250][:m]), cos_sin, caches[0], caches[1], torch.tensor([5, -1, 11][:m]),
                     4, 1)
    return weight, x, residual, norm_weight, caches, rope


@_kernel_test
@pytest.mark.parametrize("m, config", [(1, GemvConfig(16)), (2, GemvConfig(4)), (2, SkinnyConfig(16, 16, 16, 1))],
                         ids=["gemv-1", "gemv-2", "tiled"])
def test_rope_store_epilogue(m: int, config: Any) -> None:
    """qkv with the rotary embedding and the KV store: each half of a head scaled by its own rows' scales before the
    rotation (on the GEMV; on the tiled kernel rotary.py's kernel rotates the scaled product after it); y and the
    stored k, v as the reference computes them from the float8 weight, and close to the original weight's."""
    weight, x, residual, norm_weight, caches, rope = _rope_case(m, seed=30 + m)
    w8, scale = _fp8(weight)
    ref_caches, original_caches = caches.clone(), caches.clone()
    ref, _ = fused_norm_linear_ref(x, residual, norm_weight, EPS, w8, weight_scale=scale,
                                   rope=rope._replace(k_cache=ref_caches[0], v_cache=ref_caches[1]))
    original, _ = fused_norm_linear_ref(x, residual, norm_weight, EPS, weight.float(),
                                        rope=rope._replace(k_cache=original_caches[0], v_cache=original_caches[1]))
    y, _ = fused_norm_linear_triton(x, residual, norm_weight, EPS, w8, config=config, rope=rope, weight_scale=scale)
    _close_to_both(y, ref, original)
    stored = rope.slot_mapping[rope.slot_mapping >= 0]
    _close_to_both(caches.flatten(1, 2)[:, stored], ref_caches.flatten(1, 2)[:, stored],
                   original_caches.flatten(1, 2)[:, stored])
    torch.testing.assert_close(caches, ref_caches, atol=1e-4, rtol=1e-4)


@_kernel_test
@pytest.mark.parametrize("input_major", [False, True])
@pytest.mark.parametrize("m", [1, 4, 17])
def test_argmax(m: int, input_major: bool) -> None:
    """The LM head's greedy tokens with a float8 weight equal the reference's; the scales are applied before the
    comparison: every row of w8 is the same up to its sign, so only the scales tell the columns apart."""
    vocab = 100  # 7 column tiles of 16
    torch.manual_seed(m)
    w8, scale = _fp8(_weight(vocab, K, seed=40 + m), input_major)
    x = torch.randn(m, K)
    tokens = linear_argmax_triton(x, w8, _tiles(m, 1), weight_scale=scale)
    assert tokens.dtype == torch.int64 and torch.equal(tokens, linear_argmax_ref(x, w8, weight_scale=scale))
    row = torch.randn(K).to(FP8_DTYPE)
    same_rows = (row[None, :].float() * torch.where(torch.arange(vocab) % 2 == 0, 1.0, -1.0)[:, None]).to(FP8_DTYPE)
    if input_major:
        same_rows = same_rows.t().contiguous().t()
    scale = torch.rand(vocab) + 0.5
    tokens = linear_argmax_triton(x, same_rows, _tiles(m, 1), weight_scale=scale)
    expected = linear_argmax_ref(x, same_rows, weight_scale=scale)
    assert torch.equal(tokens, expected)
    assert len(set(expected.tolist())) <= 2  # (the largest scale of the even rows or of the odd rows)


@_kernel_test
def test_default_configs_and_the_entry_points() -> None:
    """The wrappers' own choice (the GEMV for a few rows of an output-major weight, tiles with split K above: K of
    1024 for 132 SMs) and ops' dispatch, which on CPU tensors is the reference."""
    from tinyvllm import ops

    torch.manual_seed(50)
    k = 1024
    weight, gate_up = _weight(24, k, seed=50), _weight(48, k, seed=51)
    (w8, scale), (gate_up8, gate_up_scale) = _fp8(weight), _fp8(gate_up)
    for m in (2, 6):
        x, residual, norm_weight = torch.randn(m, k), torch.randn(m, k), torch.rand(k) + 0.5
        _close_to_both(fused_linear_triton(x, w8, weight_scale=scale), fused_linear_ref(x, w8, weight_scale=scale),
                       fused_linear_ref(x, weight.float()))
        y, _ = fused_norm_linear_triton(x, residual, norm_weight, EPS, gate_up8, True, weight_scale=gate_up_scale)
        ref, _ = fused_norm_linear_ref(x, residual, norm_weight, EPS, gate_up8, True, weight_scale=gate_up_scale)
        original, _ = fused_norm_linear_ref(x, residual, norm_weight, EPS, gate_up.float(), True)
        _close_to_both(y, ref, original, silu_and_mul=True)
        tokens = linear_argmax_triton(x, w8, weight_scale=scale)
        assert torch.equal(tokens, linear_argmax_ref(x, w8, weight_scale=scale))
        assert torch.equal(ops.fused_linear(x, w8, weight_scale=scale), fused_linear_ref(x, w8, weight_scale=scale))

