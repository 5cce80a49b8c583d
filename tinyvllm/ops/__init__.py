"""The engine's non-matmul ops, and a skinny matmul for decode batches (linear.py; measured, not used by the
model yet: see benchmarks/RESULTS.md). Each op has a
plain-PyTorch reference (`*_ref`) and, where Triton is available, a Triton kernel (`*_triton`) with the
same signature. The names exported here pick the Triton kernel for CUDA tensors and the reference
otherwise; TINYVLLM_REFERENCE_OPS=1 forces the references everywhere (to check the kernels against them
on a GPU)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from tinyvllm.ops.activation import silu_and_mul_ref
from tinyvllm.ops.attention import AttentionMetadata, paged_attention_ref
from tinyvllm.ops.cascade_attention import cascade_attention_ref
from tinyvllm.ops.embedding import embedding_ref
from tinyvllm.ops.layernorm import fused_add_rms_norm_ref, rms_norm_ref
from tinyvllm.ops.linear import skinny_matmul_ref
from tinyvllm.ops.rotary import build_cos_sin_cache, rotary_embedding_and_store_ref
from tinyvllm.ops.sampling import sample_ref

__all__ = [
    "AttentionMetadata",
    "build_cos_sin_cache",
    "embedding",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding_and_store",
    "silu_and_mul",
    "skinny_matmul",
    "paged_attention",
    "sample",
    "triton_available",
]

_FORCE_REFERENCE = os.environ.get("TINYVLLM_REFERENCE_OPS", "0") == "1"


def triton_available() -> bool:
    """True when the Triton kernels can run on this machine's GPU."""
    if _FORCE_REFERENCE or not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_kernels() -> dict[str, Callable[..., Any]]:
    """The Triton implementations, imported only when a GPU will run them."""
    if not triton_available():
        return {}
    try:
        from tinyvllm.ops import triton_kernels
        from tinyvllm.ops.linear import skinny_matmul_triton
    except ImportError:
        return {}
    return {**triton_kernels.KERNELS, "skinny_matmul": skinny_matmul_triton}


_TRITON = _triton_kernels()


def _dispatch(name: str, reference: Callable[..., Any]) -> Callable[..., Any]:
    kernel = _TRITON.get(name)
    if kernel is None:
        return reference

    def op(first: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return (kernel if first.is_cuda else reference)(first, *args, **kwargs)

    op.__name__ = name
    op.__doc__ = reference.__doc__
    return op


embedding = _dispatch("embedding", embedding_ref)
rms_norm = _dispatch("rms_norm", rms_norm_ref)
fused_add_rms_norm = _dispatch("fused_add_rms_norm", fused_add_rms_norm_ref)
rotary_embedding_and_store = _dispatch("rotary_embedding_and_store", rotary_embedding_and_store_ref)
silu_and_mul = _dispatch("silu_and_mul", silu_and_mul_ref)
skinny_matmul = _dispatch("skinny_matmul", skinny_matmul_ref)
_plain_attention = _dispatch("paged_attention", paged_attention_ref)
_cascade_attention = _dispatch("cascade_attention", cascade_attention_ref)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Attention over the paged cache (paged_attention_ref's contract); a decode step whose sequences share a
    prefix of blocks (meta.common_prefix_len) goes through cascade attention, which reads that prefix once."""
    if meta.common_prefix_len is not None and meta.is_decode:
        return _cascade_attention(q, k_cache, v_cache, meta, scale)
    return _plain_attention(q, k_cache, v_cache, meta, scale)


sample = _dispatch("sample", sample_ref)
