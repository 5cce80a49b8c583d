"""The skinny matmul kernel against its PyTorch reference, under the Triton interpreter on CPU tensors in
float32 (conftest sets TRITON_INTERPRET=1). Shapes are small and not multiples of the tiles; both weight
layouts the engine uses are covered. Outputs and split-K partials the wrapper allocates are poisoned with
NaN, so an unwritten element fails."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from tinyvllm.ops.linear import (  # noqa: E402
    _COUNTERS,
    SkinnyConfig,
    skinny_matmul_config,
    skinny_matmul_ref,
    skinny_matmul_triton,
)

pytestmark = pytest.mark.usefixtures("poison_outputs")  # (conftest: unwritten outputs show as NaN)


def _weight(n: int, k: int, input_major: bool) -> torch.Tensor:
    """W [n, k] as F.linear takes it: rows of k contiguous, or (input_major) stored [k, n] and transposed,
    as model/loader.py keeps the projections on CUDA."""
    w = torch.randn(n, k)
    return w.t().contiguous().t() if input_major else w


def _check(x: torch.Tensor, w: torch.Tensor, config: SkinnyConfig | None = None) -> torch.Tensor:
    y = skinny_matmul_triton(x, w, config)
    expected = skinny_matmul_ref(x, w)
    assert y.shape == expected.shape
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)
    return y


def test_reference_is_f_linear() -> None:
    x, w = torch.randn(3, 5, 24), torch.randn(40, 24)
    torch.testing.assert_close(skinny_matmul_ref(x, w), F.linear(x, w))


@pytest.mark.parametrize("input_major", [False, True])
@pytest.mark.parametrize("n, k", [(100, 70), (64, 256), (33, 129)])
@pytest.mark.parametrize("split", [1, 2, 3])
def test_gemv(input_major: bool, n: int, k: int, split: int) -> None:
    """M = 1 on the CUDA-core path; splits of K whose last one is partial (k not a multiple of the step)."""
    torch.manual_seed(n * k + split)
    config = SkinnyConfig(block_m=1, block_n=32, block_k=32, split_k=split)
    _check(torch.randn(1, k), _weight(n, k, input_major), config)


@pytest.mark.parametrize("input_major", [False, True])
@pytest.mark.parametrize("m", [1, 2, 5, 16, 17, 40])
@pytest.mark.parametrize("split", [1, 4])
def test_dot(input_major: bool, m: int, split: int) -> None:
    """The tl.dot path: rows past M masked in the 16-row tile (M = 1 too), and M over one tile (17, 40)."""
    torch.manual_seed(m + split)
    n, k = 72, 200
    config = SkinnyConfig(block_m=16, block_n=32, block_k=32, split_k=split)
    _check(torch.randn(m, k), _weight(n, k, input_major), config)


@pytest.mark.parametrize("m, block_m", [(1, 1), (3, 16)])
def test_split_k_reduce(m: int, block_m: int) -> None:
    torch.manual_seed(7)
    config = SkinnyConfig(block_m=block_m, block_n=16, block_k=16, split_k=4)
    _check(torch.randn(m, 100), _weight(50, 100, True), config)


def test_serial_reduce_resets_its_counters() -> None:
    """The last program of each tile zeroes its counter, so the next launch (a CUDA graph replays the same
    buffer) counts from zero: two launches in a row are both right, and the counters end at zero."""
    torch.manual_seed(3)
    w = _weight(96, 128, True)
    config = SkinnyConfig(block_m=1, block_n=32, block_k=16, split_k=8)
    for _ in range(2):
        _check(torch.randn(1, 128), w, config)
    assert int(_COUNTERS[torch.device("cpu")].abs().sum()) == 0


@pytest.mark.parametrize("input_major", [False, True])
@pytest.mark.parametrize("m", [1, 4])
def test_default_config(input_major: bool, m: int) -> None:
    """The wrapper's own choice (which splits K here: few column tiles for 132 SMs), with leading dims."""
    torch.manual_seed(m)
    n, k = 48, 1024
    config = skinny_matmul_config(m, n, k, not input_major)
    assert config.split_k > 1
    _check(torch.randn(1, m, k), _weight(n, k, input_major))


def test_config_rules() -> None:
    """Tiles along the contiguous dimension of W; K split only until the grid fills the GPU."""
    lm_head = skinny_matmul_config(1, 128256, 2048, k_contiguous=True)
    assert (lm_head.block_m, lm_head.split_k) == (1, 1)
    o_proj = skinny_matmul_config(1, 2048, 2048, k_contiguous=False)
    assert o_proj.block_n >= 64 and o_proj.split_k > 1
    batch = skinny_matmul_config(40, 2048, 2048, k_contiguous=False)
    assert batch.block_m == 64
