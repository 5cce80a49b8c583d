"""Balanced decode attention (tinyvllm/ops/balanced_decode.py) under the Triton interpreter on CPU tensors, tiny
shapes, against paged_attention_ref: sequences cut between programs at many places (a few programs, short tiles),
rows without a token or without keys, more programs than tiles, a plan shared by several layers, float8 caches.
Outputs the kernels allocate are poisoned with NaN, and every slot of the cache no sequence owns is NaN."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.test_ops_triton import (  # noqa: E402
    _ATTENTION_SHAPES,
    _FP8_SHAPES,
    _close,
    _close_fp8_attention,
    _fp8_paged_batch,
    _paged_batch,
)
from tinyvllm.ops.attention import paged_attention_ref  # noqa: E402
from tinyvllm.ops.balanced_decode import (  # noqa: E402
    BALANCED_MIN_PROGRAMS,
    balanced_batch,
    balanced_decode_triton,
    paged_attention_balanced,
)

pytestmark = pytest.mark.usefixtures("poison_outputs")

# ragged contexts, partial last blocks, one sequence shorter than a block, one without a token this step, and a
# CUDA graph's padding row (one token, context 0: zeros, as the reference gives)
QUERY_LENS, CONTEXT_LENS = [1, 1, 0, 1, 1, 1], [5, 35, 9, 70, 0, 130]


@pytest.mark.parametrize("shape", _ATTENTION_SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv-d{s[2]}-bs{s[3]}-{s[4]}")
@pytest.mark.parametrize("programs", [1, 3, 7, 40], ids=lambda p: f"{p}-programs")
def test_balanced_decode(shape: tuple, programs: int) -> None:
    """40 programs: more than the 16-key tiles, so only the first T programs take one tile each and every sequence of
    more than one tile is cut at each of its tiles."""
    q, k_cache, v_cache, meta = _paged_batch(QUERY_LENS, CONTEXT_LENS, *shape)
    scale = shape[2] ** -0.5
    expected = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    out = balanced_decode_triton(q, k_cache, v_cache, meta, scale, programs=programs, config=(16, 4, 2))
    _close(out, expected)


@pytest.mark.parametrize("programs", [2, 5, 19])
def test_balanced_decode_one_long_sequence(programs: int) -> None:
    """A lone sequence of 300 keys cut into `programs` pieces, merged by the piece that ends last."""
    q, k_cache, v_cache, meta = _paged_batch([1], [300], 8, 2, 64, 16, torch.float32)
    expected = paged_attention_ref(q, k_cache, v_cache, meta, 0.125)
    _close(balanced_decode_triton(q, k_cache, v_cache, meta, 0.125, programs=programs, config=(16, 4, 2)), expected)


def test_balanced_decode_plan_shared_by_layers() -> None:
    """The first layer's call makes the step's plan and the next layers' calls reuse it: each layer right, and the
    per-sequence counts back at zero after each launch (the next launch starts from them)."""
    q, k_cache, v_cache, meta = _paged_batch(QUERY_LENS, CONTEXT_LENS, 8, 2, 64, 16, torch.float32)
    first = balanced_decode_triton(q, k_cache, v_cache, meta, 0.125, programs=4, config=(16, 4, 2))
    plan = meta.decode_plan
    assert plan is not None and int(plan.cu_tiles[-1]) == sum((c + 15) // 16 for c, n in
                                                               zip(CONTEXT_LENS, QUERY_LENS) if n)
    assert not plan.counters.any()
    _close(first, paged_attention_ref(q, k_cache, v_cache, meta, 0.125))
    k2, v2 = k_cache * -1.5, v_cache * 2  # another layer's pool: other values (unowned slots still NaN)
    second = balanced_decode_triton(q, k2, v2, meta, 0.125, programs=4, config=(16, 4, 2))
    assert meta.decode_plan is plan and not plan.counters.any()
    _close(second, paged_attention_ref(q, k2, v2, meta, 0.125))


@pytest.mark.usefixtures("fp8_casts_as_on_the_gpu")
@pytest.mark.parametrize("shape", _FP8_SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv-d{s[2]}-bs{s[3]}-{s[4]}")
@pytest.mark.parametrize("config", [(16, 4, 2), (128, 4, 1)], ids=["block16", "block128"])
def test_balanced_decode_fp8_cache(shape: tuple, config: tuple[int, int, int]) -> None:
    q, k_cache, v_cache, meta = _fp8_paged_batch(QUERY_LENS, CONTEXT_LENS, shape)
    scale = shape[2] ** -0.5
    expected = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    out = balanced_decode_triton(q, k_cache, v_cache, meta, scale, programs=3, config=config)
    assert out.dtype == q.dtype
    _close_fp8_attention(out, expected)


def test_balanced_decode_is_for_large_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switched on (TINYVLLM_BALANCED_DECODE=1), the engine's attention op sends decode steps of large batches to the
    balanced kernel (it leaves a plan on the step's metadata) and every other step to the plain kernels."""
    import tinyvllm.ops.balanced_decode as balanced

    seqs = BALANCED_MIN_PROGRAMS // 8
    assert balanced_batch(seqs, 8) and not balanced_batch(seqs - 1, 8)
    monkeypatch.setattr(balanced, "_ON", True)
    monkeypatch.setattr(balanced, "BALANCED_MIN_PROGRAMS", 8)  # (a tiny batch stands for a large one)
    for query_lens, context_lens, planned in (([1] * 4, [40, 3, 17, 90], True), ([1], [40], False),
                                              ([3, 1, 1, 1], [40, 3, 17, 90], False)):
        q, k_cache, v_cache, meta = _paged_batch(query_lens, context_lens, 8, 2, 64, 16, torch.float32)
        expected = paged_attention_ref(q, k_cache, v_cache, meta, 0.125)
        _close(paged_attention_balanced(q, k_cache, v_cache, meta, 0.125), expected)
        assert (meta.decode_plan is not None) == planned
