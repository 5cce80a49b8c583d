"""The prefetching GEMV (tinyvllm/ops/gemv.py) against fused_linear.py's references, under the Triton interpreter on
CPU tensors in float32 (conftest sets TRITON_INTERPRET=1): the plain product, the RMSNorm prologue with and
without the residual, the SiLU·mul epilogue, at one and several rows, with K and N that are not powers of two or
multiples of the tile, and through fused_linear's entry points, which pick it for output-major weights and a few
rows. Outputs are poisoned with NaN, so an unwritten element fails."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from tests.utils import count_gemv_launches, head_major  # noqa: E402
from tinyvllm.ops.fused_linear import (  # noqa: E402
    fused_linear_ref,
    fused_linear_triton,
    fused_norm_linear_ref,
    fused_norm_linear_triton,
)
from tinyvllm.ops.gemv import GEMV_MAX_ROWS, GemvConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("poison_outputs")  # (conftest: unwritten outputs show as NaN)

K, N = 48, 40  # K padded to 64 in the kernel; N: the last program's rows partly past the end
EPS = 1e-5


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m", [1, 3, GEMV_MAX_ROWS])
@pytest.mark.parametrize("block_n", [1, 16])
@pytest.mark.parametrize("k", [K, 64])
def test_plain_product(m: int, block_n: int, k: int) -> None:
    """o_proj / down_proj; K = 64 fills the padded row exactly (the loads without a K mask)."""
    torch.manual_seed(m * 100 + block_n + k)
    x, w = torch.randn(m, k), torch.randn(N, k)
    _close(fused_linear_triton(x, w, config=GemvConfig(block_n)), fused_linear_ref(x, w))


@pytest.mark.parametrize("m", [1, 3])
def test_silu_and_mul_epilogue(m: int) -> None:
    """gate_up: gate rows n and up rows N + n of the merged weight; the output is [M, N]."""
    torch.manual_seed(m)
    x, w = torch.randn(m, K), torch.randn(2 * N, K)
    y = fused_linear_triton(x, w, silu_and_mul=True, config=GemvConfig(8))
    assert y.shape == (m, N)
    _close(y, fused_linear_ref(x, w, silu_and_mul=True))


@pytest.mark.parametrize("fuse_norm", [True, False])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("silu_and_mul", [False, True])
@pytest.mark.parametrize("m", [1, GEMV_MAX_ROWS])
def test_norm_prologue(with_residual: bool, silu_and_mul: bool, m: int, fuse_norm: bool) -> None:
    """qkv (input_layernorm) and gate_up (post_attention_layernorm): rms_norm(x + residual) times W, and the new
    residual stream written once (by program 0) for every row; fuse_norm=False: the norm in layernorm.py's kernel
    before a plain GEMV, the same contract."""
    torch.manual_seed(m + 10 * with_residual + 100 * silu_and_mul)
    x, norm_weight = torch.randn(m, K), 1 + 0.1 * torch.randn(K)
    residual = torch.randn(m, K) if with_residual else None
    w = torch.randn(2 * N if silu_and_mul else N, K)
    y, new_residual = fused_norm_linear_triton(x, residual, norm_weight, EPS, w, silu_and_mul,
                                               GemvConfig(8, fuse_norm=fuse_norm))
    ref, ref_residual = fused_norm_linear_ref(x, residual, norm_weight, EPS, w, silu_and_mul)
    _close(y, ref)
    if with_residual:
        _close(new_residual, ref_residual)
    else:
        assert new_residual is x


def test_fused_linear_entry_points_pick_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """fused_linear and fused_norm_linear run the GEMV for output-major weights and up to GEMV_MAX_ROWS rows (the
    tiled kernel otherwise: more rows, or input-major weights), with the same results as the references either
    way."""
    launches = count_gemv_launches(monkeypatch)
    torch.manual_seed(0)
    output_major = torch.randn(N, K)
    input_major = output_major.t().contiguous().t()
    for m, w, gemv in ((1, output_major, True), (GEMV_MAX_ROWS, output_major, True),
                       (GEMV_MAX_ROWS + 1, output_major, False), (1, input_major, False)):
        launches.clear()
        x, residual, norm_weight = torch.randn(m, K), torch.randn(m, K), 1 + 0.1 * torch.randn(K)
        _close(fused_linear_triton(x, w), fused_linear_ref(x, w))
        y, new_residual = fused_norm_linear_triton(x, residual, norm_weight, EPS, w)
        ref, ref_residual = fused_norm_linear_ref(x, residual, norm_weight, EPS, w)
        _close(y, ref)
        _close(new_residual, ref_residual)
        assert len(launches) == (2 if gemv else 0), (m, w.stride())


def _rope_case(m: int, seed: int, kv_heads: int = 1) -> tuple[Any, ...]:
    """A qkv product of 4 q heads and `kv_heads` KV heads of dim 8 (one: 48 outputs, 24 pairs of head halves, not a
    power of two), a cache of 3 blocks of 4 slots with random contents, and slots that include -1 (a padding row:
    nothing stored)."""
    from tinyvllm.ops.rotary import RopeStore, build_cos_sin_cache

    torch.manual_seed(seed)
    q_heads, head_dim = 4, 8
    x, residual, norm_weight = torch.randn(m, K), torch.randn(m, K), 1 + 0.1 * torch.randn(K)
    w = torch.randn((q_heads + 2 * kv_heads) * head_dim, K)
    caches = torch.randn(2, 3, 4, kv_heads, head_dim)
    slots = torch.tensor([5, -1, 11, 2][:m])
    positions = torch.tensor([17, 3, 250, 0][:m])
    cos_sin = build_cos_sin_cache(head_dim, 256, 10000.0, None, torch.device("cpu"))
    rope = RopeStore(positions, cos_sin, caches[0], caches[1], slots, q_heads, kv_heads)
    return x, residual, norm_weight, w, caches, rope


@pytest.mark.parametrize("m,block_n,fuse_norm", [(1, 1, True), (1, 16, True), (1, 32, True), (2, 1, True),
                                                  (2, 16, True), (2, 32, True), (1, 4, False), (2, 4, False)])
def test_rope_store_epilogue(m: int, block_n: int, fuse_norm: bool) -> None:
    """qkv with the rotary embedding and the KV-cache store in its epilogue (block_n counts pairs of a head's
    halves; 16 leave the second program half empty, 32 run past the 24 there are): y holds q rotated and k, v as the
    product gives them, and the cache gets the rotated k and v at each slot but -1, as norm, product and rotary.py's
    kernel one after the other give them."""
    x, residual, norm_weight, w, caches, rope = _rope_case(m, seed=m * 10 + block_n)
    ref_caches = caches.clone()
    ref, ref_residual = fused_norm_linear_ref(x, residual, norm_weight, EPS, w,
                                              rope=rope._replace(k_cache=ref_caches[0], v_cache=ref_caches[1]))
    y, new_residual = fused_norm_linear_triton(x, residual, norm_weight, EPS, w,
                                               config=GemvConfig(block_n, fuse_norm=fuse_norm), rope=rope)
    _close(y, ref)
    _close(new_residual, ref_residual)
    _close(caches, ref_caches)
    assert not torch.equal(ref[:, :32], fused_norm_linear_ref(x, residual, norm_weight, EPS, w)[0][:, :32])


def test_rope_store_without_the_gemv() -> None:
    """On the tiled kernel (more rows than the GEMV takes, or a config that asks for it) rotary.py's kernel does the
    epilogue's work after the product: the same contract."""
    from tinyvllm.ops.linear import SkinnyConfig

    x, residual, norm_weight, w, caches, rope = _rope_case(2, seed=7)
    ref_caches = caches.clone()
    ref, _ = fused_norm_linear_ref(x, residual, norm_weight, EPS, w,
                                   rope=rope._replace(k_cache=ref_caches[0], v_cache=ref_caches[1]))
    y, _ = fused_norm_linear_triton(x, residual, norm_weight, EPS, w, config=SkinnyConfig(16, 16, 16, 1), rope=rope)
    _close(y, ref)
    _close(caches, ref_caches)


def test_rope_store_epilogue_into_a_head_major_pool() -> None:
    """The epilogue addresses the KV pool through its strides: into a pool of 2 KV heads stored [blocks, heads,
    block_size, head_dim] (ops.kv_pool's default layout) it stores what it stores into a token-major one."""
    x, residual, norm_weight, w, caches, rope = _rope_case(2, seed=3, kv_heads=2)
    moved = head_major(caches)
    assert moved.stride(3) == caches.shape[2] * caches.shape[4] and torch.equal(moved, caches)
    for pools in (caches, moved):
        fused_norm_linear_triton(x, residual, norm_weight, EPS, w, config=GemvConfig(16),
                                 rope=rope._replace(k_cache=pools[0], v_cache=pools[1]))
    assert torch.equal(moved, caches) and not torch.equal(caches, _rope_case(2, seed=3, kv_heads=2)[4])


@pytest.mark.usefixtures("fp8_casts_as_on_the_gpu")
@pytest.mark.parametrize("m,block_n,magnitude", [(1, 16, 1.0), (2, 4, 1.0), (1, 16, 100.0)])
def test_rope_store_epilogue_into_fp8_cache(m: int, block_n: int, magnitude: float) -> None:
    """kv_cache_dtype="fp8": the epilogue stores k and v rounded to e4m3 as the reference does, y unchanged; with
    large weights (magnitude 100: products far beyond 448) every stored value saturates at +-448, none is NaN."""
    x, residual, norm_weight, w, caches, rope = _rope_case(m, seed=m * 10 + block_n)
    w = magnitude * w
    caches = caches.to(torch.float8_e4m3fn)
    rope = rope._replace(k_cache=caches[0], v_cache=caches[1])
    ref_caches = caches.clone()
    ref, _ = fused_norm_linear_ref(x, residual, norm_weight, EPS, w,
                                   rope=rope._replace(k_cache=ref_caches[0], v_cache=ref_caches[1]))
    y, _ = fused_norm_linear_triton(x, residual, norm_weight, EPS, w, config=GemvConfig(block_n), rope=rope)
    torch.testing.assert_close(y, ref, atol=1e-4 * magnitude, rtol=1e-4)
    same = caches.view(torch.uint8) == ref_caches.view(torch.uint8)
    assert float(same.float().mean()) > 0.99  # (the rest one e4m3 step apart: a product on a rounding boundary)
    torch.testing.assert_close(caches.float(), ref_caches.float(), atol=2.0**-9, rtol=0.125)
    stored = caches.flatten(1, 2)[:, rope.slot_mapping[rope.slot_mapping >= 0]].float()
    assert not stored.isnan().any()
    if magnitude > 1:
        assert (stored.abs() == 448).float().mean() > 0.5
