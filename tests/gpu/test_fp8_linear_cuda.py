"""Float8 weights (tinyvllm/ops/fp8.py) on a CUDA GPU at Llama-3.2-1B's shapes (hidden 2048, 32 query / 8 KV heads of
dim 64, MLP 8192, vocabulary 128256), on fresh random inputs (a new seed each run, printed with a failure). Weights are
random bfloat16 rows of different magnitudes, quantized per output channel as the loader does (quantize_fp8_weight).
The error is ||out - ref|| / ||ref||.

- fp8_linear (per-token quantization, then torch._scaled_mm) at M = 1..8192 rows: against the float32 product of the
  quantized x and the dequantized weight (the math _scaled_mm does: within bfloat16's 1e-2) and against the reference
  (fp8_linear_ref: x itself, what the CPU engine runs; within the error of quantizing x, 0.05); with a bias, in
  float16, in a CUDA graph, and the reference's path where _scaled_mm cannot take the case (float32, N not a multiple
  of 16). The per-token quantization kernel against its reference: the same bytes.
- The decode kernels with float8 weights at M = 1..64 rows (qkv and gate_up with the RMSNorm prologue, gate_up with
  SiLU·mul, o and down plain, qkv with RoPE + KV store, the LM head's argmax): against their float32 references on the
  same float8 weights (bfloat16's 1e-2, float32's 1e-5) and on the bfloat16 weights they were quantized from (0.05;
  0.1 for SiLU·mul, which multiplies two such products).

    python -m pytest -m cuda tests/gpu/test_fp8_linear_cuda.py      (on a GPU machine; skipped elsewhere)
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from tests.utils import CUDA_ONLY, relative_error  # noqa: E402
from tinyvllm import ops  # noqa: E402
from tinyvllm.ops.fp8 import (  # noqa: E402
    dequantize_fp8_weight,
    fp8_linear_ref,
    quantize_fp8_per_token,
    quantize_fp8_per_token_triton,
    quantize_fp8_weight,
)
from tinyvllm.ops.fused_linear import (  # noqa: E402
    fused_linear_ref,
    fused_linear_triton,
    fused_norm_linear_ref,
    fused_norm_linear_triton,
    linear_argmax_triton,
)
from tinyvllm.ops.rotary import RopeStore, build_cos_sin_cache  # noqa: E402

pytestmark = CUDA_ONLY

DEVICE = "cuda"
HIDDEN, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2048, 32, 8, 64, 16
# (N, K) of the Llama-3.2-1B products
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
          "lm_head": (128256, 2048)}
LINEAR_ROWS = [1, 3, 16, 128, 1000, 8192]
DECODE_ROWS = [1, 2, 4, 8, 16, 32, 64]
EPS = 1e-5
SAME_MATH = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}  # against the same float8 operands
FP8_ROUNDING = 0.05  # against unquantized operands (the weight's, or x's in fp8_linear)
SILU_ROUNDING = 0.1  # silu(gate) * up: two products' rounding


def fresh_generator() -> tuple[torch.Generator, int]:
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator(device=DEVICE).manual_seed(seed), seed


def rand(*shape: int, generator: torch.Generator, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, generator=generator).to(dtype)


def fp8_weight(n: int, k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the bfloat16 weight [n, k], its float8 w8 [n, k] output-major, its scales [n]); rows differ in magnitude by up
    to 10x, so that a scale applied to the wrong channel shows."""
    magnitude = 10.0 ** (torch.rand(n, 1, device=DEVICE, generator=generator) - 0.5)
    weight = (torch.randn(n, k, device=DEVICE, generator=generator) * magnitude).to(torch.bfloat16)
    w8, scale = quantize_fp8_weight(weight)
    return weight, w8, scale


def assert_close(what: str, out: torch.Tensor, ref: torch.Tensor, tolerance: float) -> None:
    assert bool(torch.isfinite(out).all()), f"{what}: {int((~torch.isfinite(out)).sum())} non-finite values"
    error = relative_error(out, ref)
    assert error <= tolerance, f"{what}: ||out - ref|| / ||ref|| = {error:.2e} > {tolerance:.0e}"


# ------------------------------------------------------------------------------------------------ fp8_linear


@pytest.mark.parametrize("m", LINEAR_ROWS)
@pytest.mark.parametrize("product", list(SHAPES))
def test_fp8_linear(product: str, m: int) -> None:
    """ops.fp8_linear on CUDA bfloat16: the tensor cores' product of x quantized per token and the float8 weight."""
    generator, seed = fresh_generator()
    n, k = SHAPES[product]
    weight, w8, scale = fp8_weight(n, k, generator)
    x = rand(m, k, generator=generator)
    y = ops.fp8_linear(x, w8, scale)
    what = f"fp8_linear {product} {n}x{k} M={m} (seed {seed})"
    assert y.dtype == torch.bfloat16 and y.shape == (m, n), what
    x8, x_scale = quantize_fp8_per_token(x)
    w = dequantize_fp8_weight(w8, scale)
    assert_close(what + " against the quantized operands", y, (x8.float() * x_scale) @ w.t(), SAME_MATH[torch.bfloat16])
    assert_close(what + " against fp8_linear_ref", y, x.float() @ w.t(), FP8_ROUNDING)
    del w, weight


@pytest.mark.parametrize("m", [1, 64, 8192])
@pytest.mark.parametrize("k", [2048, 8192])
def test_per_token_quantization(k: int, m: int) -> None:
    """The kernel's float8 bytes and scales are its reference's (both divide in float32 rounded to nearest), with a
    row of zeros. The reference runs on the host: torch's CUDA division by a Python number multiplies by its
    reciprocal instead, which rounds differently."""
    generator, seed = fresh_generator()
    x = rand(m, k, generator=generator) * 10
    x[m // 2] = 0
    x8, scale = quantize_fp8_per_token_triton(x)
    ref8, ref_scale = quantize_fp8_per_token(x.cpu())
    assert torch.equal(scale.cpu(), ref_scale), f"M={m} K={k} (seed {seed})"
    different = int((x8.cpu().view(torch.uint8) != ref8.view(torch.uint8)).sum())
    assert different == 0, f"M={m} K={k} (seed {seed}): {different} bytes differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_fp8_linear_with_bias(dtype: torch.dtype) -> None:
    """A bias (qkv of Qwen2), in the model's dtype, added in _scaled_mm's epilogue; float16 models too."""
    generator, seed = fresh_generator()
    _, w8, scale = fp8_weight(3072, 2048, generator)
    x, bias = rand(100, 2048, generator=generator, dtype=dtype), rand(3072, generator=generator, dtype=dtype)
    y = ops.fp8_linear(x, w8, scale, bias)
    assert y.dtype == dtype
    assert_close(f"fp8_linear + bias {dtype} (seed {seed})", y, fp8_linear_ref(x, w8, scale, bias).float(),
                 FP8_ROUNDING)
    x8, x_scale = quantize_fp8_per_token(x)
    exact = (x8.float() * x_scale) @ dequantize_fp8_weight(w8, scale).t() + bias.float()
    assert_close(f"fp8_linear + bias {dtype} against the quantized operands (seed {seed})", y, exact, SAME_MATH[dtype])


def test_fp8_linear_falls_back_to_the_reference() -> None:
    """float32 x (the engine's exact mode) and N not a multiple of 16 run fp8_linear_ref's math on the GPU."""
    generator, _ = fresh_generator()
    _, w8, scale = fp8_weight(2048, 2048, generator)
    x = rand(7, 2048, generator=generator, dtype=torch.float32)
    torch.testing.assert_close(ops.fp8_linear(x, w8, scale), fp8_linear_ref(x, w8, scale), atol=1e-5, rtol=1e-5)
    odd8, odd_scale = w8[:1000], scale[:1000]
    x = rand(7, 2048, generator=generator)
    torch.testing.assert_close(ops.fp8_linear(x, odd8, odd_scale), fp8_linear_ref(x, odd8, odd_scale))


def test_fp8_linear_in_cuda_graph() -> None:
    """The quantization kernel and _scaled_mm captured once, replayed on new inputs."""
    generator, seed = fresh_generator()
    _, w8, scale = fp8_weight(2048, 8192, generator)
    x = rand(16, 8192, generator=generator)
    ops.fp8_linear(x, w8, scale)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.fp8_linear(x, w8, scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ops.fp8_linear(x, w8, scale)
    for replay in range(2):
        x.copy_(rand(16, 8192, generator=generator))
        graph.replay()
        torch.cuda.synchronize()
        what = f"fp8_linear in a CUDA graph, replay {replay} (seed {seed})"
        assert_close(what, y, fp8_linear_ref(x, w8, scale).float(), FP8_ROUNDING)
        assert torch.equal(y, ops.fp8_linear(x, w8, scale)), f"replay {replay}: not the eager result (seed {seed})"


# ---------------------------------------------------------------------------------- the decode kernels


@pytest.mark.parametrize("m", DECODE_ROWS)
@pytest.mark.parametrize("product", ["qkv", "o", "gate_up", "down"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_fp8_decode_product(dtype: torch.dtype, product: str, m: int) -> None:
    """qkv and gate_up with the RMSNorm prologue and the residual add (gate_up with SiLU·mul), o and down plain, with
    float8 weights (up to gemv.GEMV_MAX_ROWS rows on the GEMV, then on the tiled kernel)."""
    if dtype == torch.float32 and m not in (1, 4, 16):
        pytest.skip("float32 at a few row counts")
    generator, seed = fresh_generator()
    n, k = SHAPES[product]
    weight, w8, scale = fp8_weight(n, k, generator)
    x, residual = rand(m, k, generator=generator, dtype=dtype), rand(m, k, generator=generator, dtype=dtype)
    norm_weight = 1 + 0.1 * rand(k, generator=generator, dtype=dtype)
    what = f"{product} {n}x{k} float8 weights M={m} {dtype} (seed {seed})"
    silu = product == "gate_up"
    if product in ("qkv", "gate_up"):
        y, new_residual = fused_norm_linear_triton(x, residual, norm_weight, EPS, w8, silu, weight_scale=scale)
        args = (x.float(), residual.float(), norm_weight.float(), EPS)
        ref, ref_residual = fused_norm_linear_ref(*args, w8, silu, weight_scale=scale)
        original, _ = fused_norm_linear_ref(*args, weight.float(), silu)
        assert_close(what + " new residual", new_residual, ref_residual, SAME_MATH[dtype])
    else:
        y = fused_linear_triton(x, w8, weight_scale=scale)
        ref = fused_linear_ref(x.float(), w8, weight_scale=scale)
        original = fused_linear_ref(x.float(), weight.float())
    assert_close(what, y, ref, SAME_MATH[dtype])
    assert_close(what + " against the bfloat16 weight", y, original, SILU_ROUNDING if silu else FP8_ROUNDING)


@pytest.mark.parametrize("m", [1, 2, 4, 16])
def test_fp8_qkv_rope_store(m: int) -> None:
    """qkv with the norm prologue and the RoPE + KV-store epilogue, float8 weights (the GEMV's rows scaled before the
    rotation; above its rows, the tiled kernel then rotary.py's): y and the stored slots against the references."""
    generator, seed = fresh_generator()
    n, k = SHAPES["qkv"]
    weight, w8, scale = fp8_weight(n, k, generator)
    x, residual = rand(m, k, generator=generator), rand(m, k, generator=generator)
    norm_weight = 1 + 0.1 * rand(k, generator=generator)
    cos_sin = build_cos_sin_cache(HEAD_DIM, 4096, 500000.0, None, torch.device(DEVICE))
    caches = rand(2, 8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    slots = torch.randperm(8 * BLOCK_SIZE, device=DEVICE, generator=generator)[:m]
    positions = torch.randint(0, 4096, (m,), device=DEVICE, generator=generator)
    ref_caches, original_caches = caches.float(), caches.float()
    rope = RopeStore(positions, cos_sin, caches[0], caches[1], slots, NUM_Q_HEADS, NUM_KV_HEADS)
    y, _ = fused_norm_linear_triton(x, residual, norm_weight, EPS, w8, rope=rope, weight_scale=scale)
    args = (x.float(), residual.float(), norm_weight.float(), EPS)
    ref, _ = fused_norm_linear_ref(*args, w8, weight_scale=scale,
                                   rope=rope._replace(k_cache=ref_caches[0], v_cache=ref_caches[1]))
    original, _ = fused_norm_linear_ref(*args, weight.float(),
                                        rope=rope._replace(k_cache=original_caches[0], v_cache=original_caches[1]))
    what = f"qkv + RoPE + KV store, float8 weights, M={m} (seed {seed})"
    assert_close(what, y, ref, SAME_MATH[torch.bfloat16])
    assert_close(what + " against the bfloat16 weight", y, original, FP8_ROUNDING)
    stored = caches.flatten(1, 2)[:, slots]
    assert_close(what + " K/V cache", stored, ref_caches.flatten(1, 2)[:, slots], SAME_MATH[torch.bfloat16])
    assert_close(what + " K/V cache against the bfloat16 weight", stored, original_caches.flatten(1, 2)[:, slots],
                 FP8_ROUNDING)


@pytest.mark.parametrize("m", DECODE_ROWS)
def test_fp8_lm_head_argmax(m: int) -> None:
    """The greedy tokens of a float8 LM head: each token's logit (float32, of the dequantized weight) is the row's
    largest up to one bfloat16 step (the kernel compares logits rounded to bfloat16, as the sampler reads them)."""
    generator, seed = fresh_generator()
    n, k = SHAPES["lm_head"]
    _, w8, scale = fp8_weight(n, k, generator)
    x = rand(m, k, generator=generator)
    tokens = linear_argmax_triton(x, w8, weight_scale=scale)
    logits = x.float() @ dequantize_fp8_weight(w8, scale).t()
    what = f"lm_head argmax, float8 weights, M={m} (seed {seed})"
    assert tokens.dtype == torch.int64 and tokens.shape == (m,), what
    row_max = logits.max(-1).values
    gap = row_max - logits.gather(1, tokens[:, None]).squeeze(1)
    step = 2.0 ** (torch.floor(torch.log2(row_max.abs())) - 7)  # one bfloat16 step at the row's max
    assert bool((gap <= step + 1e-3 * logits.abs().max()).all()), f"{what}: a token's logit is {gap.tolist()} below"
