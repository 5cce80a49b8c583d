"""The fused decode kernels (tinyvllm/ops/fused_linear.py) against their PyTorch references, under the Triton
interpreter on CPU tensors in float32 (conftest sets TRITON_INTERPRET=1): the plain product, the RMSNorm prologue
with and without the residual, the SiLU·mul epilogue, split K, and the LM head's argmax with ties. Shapes are tiny
and not multiples of the tiles, in both weight layouts the engine uses. Outputs and partials the wrappers allocate
are poisoned with NaN (or -1), so an unwritten element fails."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.utils import compile_for_hopper  # noqa: E402
from tinyvllm.ops.fused_linear import (  # noqa: E402
    _KEYS,
    fused_linear_ref,
    fused_linear_triton,
    fused_norm_linear_ref,
    fused_norm_linear_triton,
    linear_argmax_ref,
    linear_argmax_triton,
)
from tinyvllm.ops.linear import _COUNTERS, SkinnyConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("poison_outputs")  # (conftest: unwritten outputs show as NaN)

K, N = 48, 40  # K: three 16-wide steps; N: three 16-wide column tiles, the last one partial
EPS = 1e-5
CPU = torch.device("cpu")


def _weight(n: int, k: int, input_major: bool) -> torch.Tensor:
    """W [n, k] as F.linear takes it: rows of k contiguous, or (input_major) stored [k, n] and transposed, as
    model/loader.py keeps the projections on CUDA."""
    w = torch.randn(n, k)
    return w.t().contiguous().t() if input_major else w


def _config(m: int, split: int) -> SkinnyConfig:
    """16-wide tiles; the CUDA-core GEMV path for one row, tl.dot's 16-row tiles otherwise."""
    return SkinnyConfig(block_m=1 if m == 1 else 16, block_n=16, block_k=16, split_k=split)


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def _counters_are_zero() -> bool:
    return int(_COUNTERS[CPU].abs().sum()) == 0 if CPU in _COUNTERS else True


@pytest.mark.parametrize("input_major", [False, True])
@pytest.mark.parametrize("m", [1, 2, 4, 17])
@pytest.mark.parametrize("split", [1, 3])
def test_plain_product(input_major: bool, m: int, split: int) -> None:
    """o_proj / down_proj: y = x W^T, rows past M masked in the tile (17: two m tiles), K split in three."""
    torch.manual_seed(m * 10 + split)
    x, w = torch.randn(m, K), _weight(N, K, input_major)
    _close(fused_linear_triton(x, w, config=_config(m, split)), fused_linear_ref(x, w))
    assert _counters_are_zero()


@pytest.mark.parametrize("input_major", [False, True])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("split", [1, 3])
def test_silu_and_mul_epilogue(input_major: bool, m: int, split: int) -> None:
    """gate_up: the program's tile holds gate columns j and up columns I + j; the output is [M, I]."""
    torch.manual_seed(m + split)
    x, w = torch.randn(m, K), _weight(2 * N, K, input_major)
    y = fused_linear_triton(x, w, silu_and_mul=True, config=_config(m, split))
    assert y.shape == (m, N)
    _close(y, fused_linear_ref(x, w, silu_and_mul=True))


@pytest.mark.parametrize("input_major", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("silu_and_mul", [False, True])
@pytest.mark.parametrize("m, split", [(1, 1), (1, 3), (4, 3), (17, 1)])
def test_norm_prologue(input_major: bool, with_residual: bool, silu_and_mul: bool, m: int, split: int) -> None:
    """qkv_proj (and gate_up, with the epilogue) after RMSNorm: the product of rms_norm(x + residual) and the new
    residual stream, which the first column tile's programs write (every split its part of K); without a residual
    (the first layer) the stream is x itself. The inputs are left as they were."""
    torch.manual_seed(m + split + 100 * with_residual)
    x, w = torch.randn(m, K), _weight(2 * N if silu_and_mul else N, K, input_major)
    residual = torch.randn(m, K) if with_residual else None
    norm_weight = torch.rand(K) + 0.5
    x_before, residual_before = x.clone(), None if residual is None else residual.clone()
    y, new_residual = fused_norm_linear_triton(x, residual, norm_weight, EPS, w, silu_and_mul, config=_config(m, split))
    y_ref, new_residual_ref = fused_norm_linear_ref(x, residual, norm_weight, EPS, w, silu_and_mul)
    _close(y, y_ref)
    torch.testing.assert_close(new_residual, new_residual_ref, atol=0, rtol=0)
    assert torch.equal(x, x_before) and (residual is None or torch.equal(residual, residual_before))
    if residual is None:
        assert new_residual is x


def test_default_configs_and_leading_dims() -> None:
    """The wrappers' own tiles and split (linear.py's config; the K of 1024 is split for 132 SMs), on
    [batch, tokens, K] inputs, each fusion once."""
    torch.manual_seed(5)
    k = 1024
    x, residual, norm_weight = torch.randn(1, 2, k), torch.randn(1, 2, k), torch.rand(k) + 0.5
    w, w_gate_up = _weight(24, k, True), _weight(48, k, True)
    _close(fused_linear_triton(x, w), fused_linear_ref(x, w))
    y, new_residual = fused_norm_linear_triton(x, residual, norm_weight, EPS, w_gate_up, True)
    y_ref, new_residual_ref = fused_norm_linear_ref(x, residual, norm_weight, EPS, w_gate_up, True)
    assert y.shape == (1, 2, 24) and new_residual.shape == x.shape
    _close(y, y_ref)
    torch.testing.assert_close(new_residual, new_residual_ref)
    assert torch.equal(linear_argmax_triton(x[0], w), linear_argmax_ref(x[0], w))
    assert _counters_are_zero()


@pytest.mark.parametrize("input_major", [False, True])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 20])
def test_argmax(input_major: bool, m: int) -> None:
    """The LM head's greedy tokens equal torch.argmax of the float32 logits; the keys and counters are reset
    for the next launch (a second call on other inputs is right too)."""
    vocab = 100  # 7 column tiles of 16
    torch.manual_seed(m)
    w = _weight(vocab, K, input_major)
    for _ in range(2):
        x = torch.randn(m, K)
        tokens = linear_argmax_triton(x, w, config=_config(m, 1))
        assert tokens.dtype == torch.int64
        assert torch.equal(tokens, linear_argmax_ref(x, w))
    assert _counters_are_zero()
    assert bool((_KEYS[CPU] == -(2**63 - 1)).all())


@pytest.mark.parametrize("m", [1, 3])
def test_argmax_ties_pick_the_lowest_index(m: int) -> None:
    """Equal logits within one tile, across tiles, and all-negative logits: the lowest index wins, as
    torch.argmax. Row r of W is e_(r % 8) scaled by +1 or -1, so many columns share the row's max exactly."""
    vocab = 70
    signs = torch.tensor([1.0 if r % 3 else -1.0 for r in range(vocab)])
    w = torch.zeros(vocab, K)
    w[torch.arange(vocab), torch.arange(vocab) % 8] = signs
    x = torch.zeros(m, K)
    x[0, 2] = 1.0  # columns 2, 10, 18, ... tie at +1 (those with sign +1); the first is 2
    if m > 1:
        x[1, 3] = -1.0  # +1 where r % 8 == 3 and the sign is -1 (r % 3 == 0): 3, 27, 51; the first is 3
        x[2, :] = -1.0  # logit -sign: +1 at every multiple of 3, in every tile; the first is 0
    config = _config(m, 1)._replace(block_n=8)  # nine tiles: the ties span them
    tokens = linear_argmax_triton(x, w, config=config)
    expected = linear_argmax_ref(x, w)
    assert torch.equal(tokens, expected), (tokens, expected)
    assert int(tokens[0]) == 2
    negative = -torch.rand(vocab, K)  # every logit below zero: the order of negative floats' keys
    x = torch.rand(m, K)
    assert torch.equal(linear_argmax_triton(x, negative, config=config), linear_argmax_ref(x, negative))


def test_dispatch_on_cpu_is_the_reference() -> None:
    """On CPU tensors the ops are the references, and the model never asks for the decode kernels."""
    from tinyvllm import ops

    x, w = torch.randn(2, 16), torch.randn(8, 16)
    torch.testing.assert_close(ops.fused_linear(x, w), fused_linear_ref(x, w))
    assert torch.equal(ops.linear_argmax(x, w), linear_argmax_ref(x, w))
    assert not any(ops.use_decode_kernel(product, x) for product in ops.DECODE_KERNEL_MAX_ROWS)


# Compiles the kernel for Hopper (sm_90) with Triton's own compiler, which needs no GPU, in a process without the
# interpreter: the interpreter runs the kernel as Python, so what only the compiler refuses (a branch that is not
# static, mismatched types between branches) would first show on the device. Prints "compiled N".
COMPILE_FOR_HOPPER = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tinyvllm.ops.fused_linear import _fused_linear_kernel

ints = ["M", "N", "K", "stride_x", "stride_r", "stride_nr", "stride_y", "stride_w", "k_per_split"]
pointers = ["y_ptr", "x_ptr", "w_ptr", "residual_ptr", "new_residual_ptr", "norm_weight_ptr", "partial_ptr",
            "counter_ptr", "keys_ptr", "scale_ptr"]
count = 0
for dtype, block_m, block_n, split, k_contiguous, norm, silu, argmax in json.loads(sys.argv[1]):
    types = {name: "*" + dtype for name in pointers}
    types.update(partial_ptr="*fp32", counter_ptr="*i32", keys_ptr="*i64", scale_ptr="*fp32")
    if argmax:
        types["y_ptr"] = "*i64"
    signature = {**types, **{name: "i32" for name in ints}, "eps": "fp32"}
    constants = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, NORM_BLOCK=max(4096 // block_m, 16),
                     SPLIT_K=split, W_K_CONTIGUOUS=k_contiguous, NORM=norm, HAS_RESIDUAL=norm, SILU_MUL=silu,
                     ARGMAX=argmax, W_SCALED=False, PRECISION="ieee" if dtype == "fp32" else "tf32", USE_PDL=True)
    signature.update({name: "constexpr" for name in constants})
    names = list(signature)
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in pointers + ints[1:]}  # as the JIT sees them
    source = ASTSource(_fused_linear_kernel, signature, constants, aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    ptx = compiled.asm["ptx"]
    assert "griddepcontrol.wait" in ptx, "no PDL wait"
    assert not argmax or "max.s64" in ptx, "no 64-bit atomic max"
    count += 1
print("compiled", count)
"""
HOPPER_CASES = [  # dtype, BLOCK_M, BLOCK_N, split, W k-contiguous, norm, silu_and_mul, argmax
    ("bf16", 16, 64, 4, False, True, False, False),  # qkv: norm prologue, split K
    ("bf16", 16, 32, 2, False, True, True, False),  # gate_up: norm, SiLU·mul, split K
    ("bf16", 1, 16, 1, True, False, False, True),  # the LM head at M = 1: GEMV, argmax
    ("fp32", 64, 64, 1, False, False, False, True),  # an untied LM head at 64 rows, float32
]


def test_kernels_compile_for_hopper() -> None:
    compile_for_hopper(COMPILE_FOR_HOPPER, HOPPER_CASES, 300)

